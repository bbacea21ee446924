"""Speculative sampling leaves the output distribution unchanged.

600 requests with the same prompt and different seeds sample 3 tokens, once with speculation
(num_steps 2: drafts sampled from the MTP head's own distribution, rejection sampling) and once
without. For the 2nd and the 3rd token, which pass through acceptance, a two-sample chi-square test
of homogeneity must not reject at significance level 0.001 (the seeds are fixed, so the verdict is
deterministic). The critical value uses the Wilson-Hilferty approximation.

Three cases:

* ``top_k``: temperature 1, top-k 6, the model's own random MTP head (few drafts accepted);
* ``top_p``: temperature 1, top-p 0.8, an *echoing* MTP head (below) so that about half of the
  drafts are accepted and both the accept and the residual paths carry weight;
* ``hisparse``: temperature 1, top-p 0.9 with top-k 8, the echoing head, on HiSparse memory with a
  prompt of 19 tokens over a device buffer of HOT = 8 columns, so the steps swap KV in from host
  (the reference is plain sampling on the same HiSparse configuration; 150 requests run at once
  there, which only makes the run faster: each request samples with its own generator).
"""

from __future__ import annotations

from collections import Counter
from functools import cache

import pytest
import torch
from _spec_util import RandomSwitch, quiet_logs

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.model.reference import DecodeSession
from pipeline.sampling import SamplingParams, probabilities

from tiny_models import build_tiny_model

N = 600
Z_999 = 3.0902  # standard normal quantile for 1 - 0.001
HOT = 8  # the tiny model's index_topk
SHORT_PROMPT = [5, 9, 2, 7]
LONG_PROMPT = torch.randint(0, 256, (2 * HOT + 3,), generator=torch.Generator().manual_seed(3)).tolist()

CASES = {
    "top_k": dict(params=dict(temperature=1.0, top_k=6), echo=False, prompt=SHORT_PROMPT, hisparse=False),
    "top_p": dict(params=dict(temperature=1.0, top_p=0.8), echo=True, prompt=SHORT_PROMPT, hisparse=False),
    "hisparse": dict(
        params=dict(temperature=1.0, top_p=0.9, top_k=8), echo=True, prompt=LONG_PROMPT, hisparse=True
    ),
}


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


def echo_mtp(model):
    """The MTP layer proposes from the next token's embedding alone (``eh_proj`` passes the
    embedding half, the block adds nothing): a bigram drafter close to, but not equal to, the target,
    which adds its attention and MLP on top of the same embedding. The target is untouched."""
    d = model.cfg.hidden_size
    with torch.no_grad():
        mtp = model.mtp[0]
        mtp.eh_proj.weight.zero_()
        mtp.eh_proj.weight[:, :d] = torch.eye(d, dtype=model.dtype)
        mtp.block.self_attn.o_proj.weight.zero_()
        for p in mtp.block.mlp.parameters():
            p.zero_()
    return model


def sharp_model(echo: bool):
    model = build_tiny_model(seed=11)
    with torch.no_grad():  # sharper distributions: target and draft disagree more, rejections matter
        model.lm_head.weight.mul_(25.0)
    return echo_mtp(model) if echo else model


@cache
def run_case(name: str) -> dict[str, object]:
    case = CASES[name]
    model = sharp_model(case["echo"])
    params = case["params"]
    out = {}
    always = SpeculativeConfig(num_steps=2, max_batch_size=None, timed=False, min_accept_length=None,
                                   plain_tail=False, plain_while_prefilling=False)
    for mode, spec in (("plain", None), ("spec", always), ("switch", always)):
        cfg = EngineConfig(
            dtype="float64",
            page_size=4,
            max_context_len=64,
            max_running_requests=150 if case["hisparse"] else 64,
            device_pool_tokens=4800 if case["hisparse"] else 1024,
            hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=4)
            if case["hisparse"]
            else None,
            speculative=spec,
        )
        executor = Executor(cfg, model=model)
        # "switch": adaptive speculation forced at random, rounds and plain steps mixed
        policy = RandomSwitch(seed=5) if mode == "switch" else None
        driver = SyncDriver(executor, spec_policy=policy)
        out[mode + "_policy"] = policy
        reqs = [
            driver.submit(case["prompt"], SamplingParams(max_new_tokens=3, seed=i, ignore_eos=True, **params))
            for i in range(N)
        ]
        with quiet_logs():
            driver.run()
        assert all(len(r.output_ids) == 3 for r in reqs)
        out[mode] = [r.output_ids for r in reqs]
        out[mode + "_executor"] = executor
    out["model"] = model
    return out


@pytest.fixture(scope="module", params=list(CASES))
def samples(request):
    return run_case(request.param)


@pytest.mark.parametrize("mode", ["spec", "switch"])
@pytest.mark.parametrize("index", [1, 2])
def test_sampled_token_distribution_matches_plain_sampling(samples, index, mode):
    """``switch``: the same with each step a round or a plain step at random (adaptive speculation)."""
    spec = Counter(t[index] for t in samples[mode])
    plain = Counter(t[index] for t in samples["plain"])
    stat, df = homogeneity(spec, plain)
    assert df >= 3, "the test needs several outcomes to mean anything"
    assert stat < chi2_critical(df), f"chi-square {stat:.1f} with {df} df rejects at 0.001"


def test_switching_really_mixed_rounds_and_plain_steps(samples):
    policy = samples["switch_policy"]
    assert policy.rounds > 0 and policy.plain > 0
    assert samples["switch_executor"].spec_counters.verify_rounds > 0


def test_speculation_really_accepted_and_rejected_drafts(samples):
    counters = samples["spec_executor"].spec_counters
    assert 0 < counters.accepted_drafts < counters.proposed_drafts


def test_the_echoing_drafter_gets_a_good_share_of_drafts_accepted():
    """Without it the top-p case would exercise the residual path almost alone."""
    assert 0.25 < run_case("top_p")["spec_executor"].spec_counters.accept_rate < 0.9


def test_top_p_really_cuts_the_distribution():
    """The nucleus leaves out a material part of the first token's mass, so a verify that ignored
    top-p would sample tokens plain sampling never produces."""
    model = run_case("top_p")["model"]
    with torch.no_grad():
        logits = model.logits(DecodeSession(model, 16).target(SHORT_PROMPT, 0))[-1]
    full = probabilities(logits, SamplingParams(temperature=1.0))
    nucleus = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert int((nucleus > 0).sum()) >= 3
    assert float(full[nucleus == 0].sum()) > 0.1
    seen = {t[0] for t in run_case("top_p")["plain"]} | {t[0] for t in run_case("top_p")["spec"]}
    assert seen <= set(torch.nonzero(nucleus).reshape(-1).tolist())


def test_hisparse_case_swaps_kv_in_from_host():
    for mode in ("plain", "spec"):
        counters = run_case("hisparse")[mode + "_executor"].memory.counters_dict()
        assert sum(counters["misses"]) > 0, f"{mode}: the long prompt must need host rows"
        assert sum(counters["unrecoverable"]) == 0
