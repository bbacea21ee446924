"""Speculative greedy decoding equals plain greedy decoding, token for token.

A random tiny model's MTP head almost never agrees with its target, so on its own it would only
test the all-rejected path. The *oracle drafter* used here replaces the MTP's proposals by the
true continuation (known from a plain run) with one deliberate error at a pseudo-random draft
position per round, so every accept length from 1 to num_steps + 1 occurs and the verify, finalize
and draft-extend paths run with partial acceptance. The bundled model is checked with its real MTP
head in ``test_bundled.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from pipeline import executor as executor_module
from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.sampling import SamplingParams
from pipeline.speculative.draft_state import DraftState

from tiny_models import build_tiny_model

PAGE = 8  # the draft zone holds PAGE - 1 = 7 verify tokens: num_steps 1..6 are allowed
HOT = 16
MAX_NEW = 24


def config(hisparse: bool, num_steps: int | None) -> EngineConfig:
    return EngineConfig(
        dtype="float64",
        page_size=PAGE,
        max_context_len=320,
        max_running_requests=8,
        device_pool_tokens=1024,
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2) if hisparse else None,
        speculative=SpeculativeConfig(num_steps=num_steps) if num_steps else None,
    )


def make_prompts(batch: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = [3, HOT - 2, HOT, 2 * HOT + 5, 9 * HOT + 1, 7, 50, HOT + 1][:batch]  # crossing HOT
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]


def oracle_drafter(monkeypatch, executor: Executor, truth: dict[str, list[int]]) -> None:
    """Drafts = the true continuation, wrong at one pseudo-random position per round (or none)."""
    real = executor_module.draft_chain

    def chain(model, memory, rows, states, params, generators, num_steps):
        states = real(model, memory, rows, states, params, generators, num_steps)
        out = []
        for row, state in zip(rows, states):
            rid = executor._by_row[row]
            n = memory.length(row)
            full = truth[rid]
            drafts = [full[n + j] if n + j < len(full) else 0 for j in range(1, num_steps + 1)]
            wrong = random.Random(f"{rid}:{n}").randint(0, num_steps)  # num_steps = no error
            if wrong < num_steps:
                drafts[wrong] = (drafts[wrong] + 1) % 256
            out.append(DraftState(state.bonus, state.hidden, tuple(drafts), state.draft_probs))
        return out

    monkeypatch.setattr(executor_module, "draft_chain", chain)


def generate(model, cfg, prompts, monkeypatch=None, truth=None):
    executor = Executor(cfg, model=model)
    if truth is not None:
        oracle_drafter(monkeypatch, executor, truth)
    driver = SyncDriver(executor, check=True)
    reqs = driver.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    empty = Executor(cfg, model=model).pool_counts()
    assert executor.pool_counts() == empty, "a pool did not return to its initial free count"
    executor.close()
    return reqs, executor


@pytest.mark.parametrize("hisparse", [False, True], ids=["resident", "hisparse"])
@pytest.mark.parametrize("num_steps", [1, 2, 3, 4, 5, 6])
def test_every_num_steps_with_partial_acceptance(tiny_model, monkeypatch, hisparse, num_steps):
    prompts = make_prompts(8, seed=num_steps)
    plain, _ = generate(tiny_model, config(hisparse, None), prompts)
    truth = {f"req-{i}": [*r.prompt_ids, *r.output_ids] for i, r in enumerate(plain)}
    spec, executor = generate(tiny_model, config(hisparse, num_steps), prompts, monkeypatch, truth)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    lengths = executor.spec_counters.accept_length_histogram
    assert len(lengths) == num_steps + 1 or sum(lengths.values()) < 3 * (num_steps + 1)
    assert max(lengths) > 1, "the oracle drafter must get drafts accepted"


@pytest.mark.parametrize("batch", [1, 2, 5, 8])
def test_batch_sizes_with_the_random_mtp_head(batch, monkeypatch):
    """The model's own (random) MTP head: whatever it drafts, the output is plain greedy's."""
    model = build_tiny_model(seed=batch, index_topk=4)
    prompts = make_prompts(batch, seed=100 + batch)
    for hisparse in (False, True):
        plain, _ = generate(model, config(hisparse, None), prompts)
        spec, _ = generate(model, config(hisparse, 3), prompts)
        assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
