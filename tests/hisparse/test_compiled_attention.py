"""The one-call CPU attention (``kernels.hisparse_attend_numba``) serves decode, verify and draft
layers exactly as the step-by-step backends do: the same tokens, bit-identical logits, the same
swap-in counts per layer, with HiSparse and all-resident, plain and speculative, including verify
steps that do not fit the hot region in one swap-in call."""

from __future__ import annotations

import pytest
import torch
from test_equivalence import HOT, prompts, two_page_config

from kernels import hisparse_attend_numba
from pipeline.config import HiSparseConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.hisparse.backend import HiSparseBackend
from pipeline.model.resident import ResidentBackend
from pipeline.sampling import SamplingParams


def _run(model, monkeypatch, *, hisparse: bool, num_steps: int | None, compiled: bool):
    config = two_page_config(
        HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2) if hisparse else None, num_steps
    )
    calls = {"one": 0, "resident": 0}
    with monkeypatch.context() as patch:
        if not compiled:
            patch.setattr(HiSparseBackend, "_compiled_fits", lambda self, inputs: False)
            patch.setattr(ResidentBackend, "_compiled_fits", lambda self, inputs, layout: False)
        for name, key in (("attend_views", "one"), ("attend_resident", "resident")):
            inner = getattr(hisparse_attend_numba, name)
            patch.setattr(
                hisparse_attend_numba,
                name,
                lambda *a, _inner=inner, _key=key: calls.__setitem__(_key, calls[_key] + 1) or _inner(*a),
            )
        executor = Executor(config, model=model)
        calls.update(one=0, resident=0)  # the start's warm-up aside: what the forwards called
        logits: list[torch.Tensor] = []
        original = model.logits
        patch.setattr(model, "logits", lambda hidden: logits.append(original(hidden)) or logits[-1])
        try:
            reqs = SyncDriver(executor, check=True).generate(
                prompts(5, lens=(7, 3 * HOT + 1, 8 * HOT + 9)),
                SamplingParams(max_new_tokens=16, ignore_eos=True),
            )
            counters = executor.memory.counters if hisparse else None
            counts = (
                (list(counters.hits), list(counters.misses), list(counters.h2d_bytes)) if counters else None
            )
            return [r.output_ids for r in reqs], logits, counts, calls
        finally:
            executor.close()


@pytest.mark.parametrize("num_steps", [None, 3])
@pytest.mark.parametrize("hisparse", [True, False])
def test_one_call_serves_like_the_steps(tiny_model, monkeypatch, hisparse, num_steps):
    tokens, logits, counts, calls = _run(
        tiny_model, monkeypatch, hisparse=hisparse, num_steps=num_steps, compiled=True
    )
    ref_tokens, ref_logits, ref_counts, ref_calls = _run(
        tiny_model, monkeypatch, hisparse=hisparse, num_steps=num_steps, compiled=False
    )
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) and all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    assert counts == ref_counts
    assert ref_calls == {"one": 0, "resident": 0}
    # decode (and verify) layers took the one call; the MTP layer's draft steps the resident one
    assert calls["one" if hisparse else "resident"] > 0
    if num_steps:
        assert calls["resident"] > 0
    if hisparse:
        assert sum(counts[1]) > 0, "the long prompts must really swap rows in"


def test_a_forward_that_records_gradients_keeps_the_step_by_step_backends(tiny_model, monkeypatch):
    """The compiled loops record no gradient, so a forward with autograd on never takes them (the
    same forward without it does)."""
    from pipeline.model.resident import ForwardLayout, ResidentKV

    calls = []
    real = hisparse_attend_numba.attend_resident
    monkeypatch.setattr(hisparse_attend_numba, "attend_resident", lambda *a: calls.append(1) or real(*a))
    n = 5
    ids = torch.randint(0, 200, (n,))
    for grad in (True, False):
        calls.clear()
        store = ResidentKV.allocate(tiny_model.cfg, 64, 2, 32, tiny_model.dtype)
        backend = ResidentBackend(store)
        backend.begin(ForwardLayout(torch.zeros(n, dtype=torch.int64), torch.arange(n), torch.arange(n)))
        with torch.set_grad_enabled(grad):
            hidden = tiny_model(ids, torch.arange(n), backend)
        assert hidden.requires_grad == grad
        assert bool(calls) != grad
