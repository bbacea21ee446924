"""Speculative sampling leaves the output distribution unchanged.

600 requests with the same prompt and different seeds sample 3 tokens at temperature 1 (top-k 6),
once with speculation (drafts sampled from the MTP head's own distribution, rejection sampling) and
once without. For the 2nd and the 3rd token, which pass through acceptance, a two-sample chi-square
test of homogeneity must not reject at significance level 0.001 (the seeds are fixed, so the
verdict is deterministic). The critical value uses the Wilson-Hilferty approximation.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pipeline.config import EngineConfig, SpeculativeConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.sampling import SamplingParams

from tiny_models import build_tiny_model

N = 600
Z_999 = 3.0902  # standard normal quantile for 1 - 0.001


def chi2_critical(df: int) -> float:
    h = 2 / (9 * df)
    return df * (1 - h + Z_999 * h**0.5) ** 3


def homogeneity(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square over the union of outcomes, sparse bins pooled into one."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    bins, rest = [], [0, 0]
    for k in keys:
        if a[k] + b[k] >= 10:
            bins.append((a[k], b[k]))
        else:
            rest[0] += a[k]
            rest[1] += b[k]
    if sum(rest):
        bins.append(tuple(rest))
    stat = sum((x - y) ** 2 / (x + y) for x, y in bins)
    return stat, len(bins) - 1


@pytest.fixture(scope="module")
def samples():
    model = build_tiny_model(seed=11)
    with torch.no_grad():  # sharper distributions: target and draft disagree more, rejections matter
        model.lm_head.weight.mul_(25.0)
    out = {}
    for name, spec in (("plain", None), ("spec", SpeculativeConfig(num_steps=2))):
        cfg = EngineConfig(
            dtype="float64",
            page_size=4,
            max_context_len=64,
            max_running_requests=64,
            device_pool_tokens=1024,
            hisparse=None,
            speculative=spec,
        )
        executor = Executor(cfg, model=model)
        driver = SyncDriver(executor)
        reqs = [
            driver.submit([5, 9, 2, 7], SamplingParams(max_new_tokens=3, temperature=1.0, top_k=6, seed=i))
            for i in range(N)
        ]
        driver.run()
        out[name] = [r.output_ids for r in reqs]
        out[name + "_executor"] = executor
    return out


@pytest.mark.parametrize("index", [1, 2])
def test_sampled_token_distribution_matches_plain_sampling(samples, index):
    spec = Counter(t[index] for t in samples["spec"])
    plain = Counter(t[index] for t in samples["plain"])
    stat, df = homogeneity(spec, plain)
    assert df >= 3, "the test needs several outcomes to mean anything"
    assert stat < chi2_critical(df), f"chi-square {stat:.1f} with {df} df rejects at 0.001"


def test_speculation_really_accepted_and_rejected_drafts(samples):
    counters = samples["spec_executor"].spec_counters
    assert 0 < counters.accepted_drafts < counters.proposed_drafts
