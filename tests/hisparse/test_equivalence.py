"""HiSparse is invisible to the math (invariant I10, docs/invariants.md).

HiSparse decode yields exactly the tokens of all-resident decode for batches that mix contexts from
below HOT to over 8x HOT, and in float64 the logits of every forward are bit-identical too: the
synchronous driver forms the same batches in both modes, and swap-in hands attention the same rows
in the same order, only from other slots. A third opinion comes from the model's own reference
decoder, which knows nothing of the engine.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.sampling import SamplingParams

HOT = 16
PAGE = 4
# below HOT, exactly HOT, between, and more than 8x HOT
PROMPT_LENS = (5, 16, 40, 3 * HOT + 1, 8 * HOT + 9)


def engine_config(hisparse: bool, **kw) -> EngineConfig:
    return EngineConfig(
        dtype="float64",
        page_size=PAGE,
        max_context_len=512,
        max_running_requests=6,
        device_pool_tokens=512,
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2) if hisparse else None,
        speculative=None,
        **kw,
    )


def two_page_config(hisparse: HiSparseConfig | None, num_steps: int | None) -> EngineConfig:
    """float64, pages of 2 x PAGE, 4 request rows: the configuration the one-call and policy
    equivalence tests compare their backends under (speculative with ``num_steps``)."""
    return EngineConfig(
        dtype="float64",
        page_size=2 * PAGE,
        max_context_len=480,
        max_running_requests=4,
        device_pool_tokens=512,
        hisparse=hisparse,
        # any batch size may run rounds (on a CPU the default rule keeps them to a request alone); the
        # rule is not timed, so both runs take the same forwards however busy the machine is
        speculative=(
            SpeculativeConfig(num_steps=num_steps, max_batch_size=None, timed=False) if num_steps else None
        ),
    )


def prompts(seed: int, lens=PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]


def run(model, hisparse: bool, prompt_list, params, monkeypatch, *, check: bool = True):
    """Tokens of every request and the logits of every forward, in call order."""
    executor = Executor(engine_config(hisparse), model=model)
    calls: list[torch.Tensor] = []
    original = model.logits
    monkeypatch.setattr(model, "logits", lambda hidden: calls.append(original(hidden)) or calls[-1])
    try:
        driver = SyncDriver(executor, check=check)
        reqs = driver.generate(prompt_list, params)
        assert executor.pool_counts() == Executor(engine_config(hisparse), model=model).pool_counts()
        return [r.output_ids for r in reqs], calls, executor
    finally:
        monkeypatch.setattr(model, "logits", original)
        executor.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_hisparse_equals_resident_tokens_and_float64_logits(tiny_model, monkeypatch, seed):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plist = prompts(seed)
    hs_tokens, hs_logits, hs_exec = run(tiny_model, True, plist, params, monkeypatch)
    res_tokens, res_logits, _ = run(tiny_model, False, plist, params, monkeypatch)
    assert hs_tokens == res_tokens
    assert len(hs_logits) == len(res_logits)
    for a, b in zip(hs_logits, res_logits):
        assert torch.equal(a, b)
    counters = hs_exec.memory.counters
    assert sum(counters.misses) > 0, "the long prompts must really swap rows in"
    assert sum(counters.unrecoverable) == 0


def test_hisparse_equals_the_models_reference_decoder(tiny_model, monkeypatch):
    from pipeline.model.reference import ReferenceDecoder

    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plist = prompts(7, lens=(3, 37, 150))
    hs_tokens, _, _ = run(tiny_model, True, plist, params, monkeypatch)
    reference = ReferenceDecoder(tiny_model)
    for prompt, tokens in zip(plist, hs_tokens):
        assert list(reference.generate(prompt, max_new_tokens=20, stop_at_eos=False).token_ids) == tokens


def test_sampled_decoding_is_identical_too(tiny_model, monkeypatch):
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
    plist = prompts(3, lens=(9, 70))
    hs_tokens, _, _ = run(tiny_model, True, plist, params, monkeypatch)
    res_tokens, _, _ = run(tiny_model, False, plist, params, monkeypatch)
    assert hs_tokens == res_tokens
