"""The replacement policy never changes the answer: under every policy HiSparse decode (plain and
speculative) gives the tokens of all-resident decode, and in float64 bit-identical logits."""

from __future__ import annotations

import pytest
import torch
from test_equivalence import HOT, prompts, two_page_config

from kernels.swap_in_policy import POLICIES
from pipeline.config import HiSparseConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.sampling import SamplingParams


def _run(model, monkeypatch, *, policy: str | None, num_steps: int | None):
    config = two_page_config(
        HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2, policy=policy) if policy else None,
        num_steps,
    )
    executor = Executor(config, model=model)
    calls: list[torch.Tensor] = []
    original = model.logits
    monkeypatch.setattr(model, "logits", lambda hidden: calls.append(original(hidden)) or calls[-1])
    try:
        reqs = SyncDriver(executor, check=True).generate(
            prompts(3, lens=(9, 3 * HOT + 1, 8 * HOT + 9)), SamplingParams(max_new_tokens=20, ignore_eos=True)
        )
        misses = sum(executor.memory.counters.misses) if policy else 0
        return [r.output_ids for r in reqs], calls, misses
    finally:
        monkeypatch.setattr(model, "logits", original)
        executor.close()


@pytest.mark.parametrize("num_steps", [None, 3])
@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "lru"])
def test_every_policy_gives_the_resident_answer(tiny_model, monkeypatch, policy, num_steps):
    tokens, logits, misses = _run(tiny_model, monkeypatch, policy=policy, num_steps=num_steps)
    resident_tokens, resident_logits, _ = _run(tiny_model, monkeypatch, policy=None, num_steps=num_steps)
    assert tokens == resident_tokens
    assert len(logits) == len(resident_logits)
    assert all(torch.equal(a, b) for a, b in zip(logits, resident_logits))
    assert misses > 0, "the long prompts must really swap rows in"
