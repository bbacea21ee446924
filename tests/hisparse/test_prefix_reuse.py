"""Property of the prefix cache over HiSparse memory: a request that ends leaves its full pages to the
cache, and a later prompt that starts with the same tokens shares them from its admission (its
shared positions are computed already), decoding the tokens the first request decoded."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from pipeline.config import EngineConfig, HiSparseConfig
from pipeline.driver import prefill_whole
from pipeline.executor import Executor, NewSequence
from pipeline.sampling import SamplingParams

from tiny_models import build_tiny_model

PAGE = 4
MODEL = build_tiny_model()
CONFIG = EngineConfig(
    dtype="float64",
    page_size=PAGE,
    max_context_len=64,
    max_running_requests=2,
    device_pool_tokens=64,
    hisparse=HiSparseConfig(device_buffer_size=8, host_to_device_ratio=2),
    speculative=None,
    prefix_cache=True,
)
GREEDY = SamplingParams(max_new_tokens=10_000, ignore_eos=True)


def run(executor: Executor, rid: str, prompt: tuple[int, ...], steps: int) -> list[int]:
    """Admit ``prompt``, stage it, decode ``steps`` tokens; the tokens it produced."""
    first = prefill_whole(executor, [NewSequence(rid, prompt, GREEDY)]).first_tokens[rid]
    executor.wait_staging()
    assert executor.collect_ready() == [rid]
    out = [first]
    for _ in range(steps):
        out.extend(executor.decode([rid]).tokens[rid])
    return out


@pytest.mark.proptest
@settings(max_examples=8, deadline=None)
@given(length=st.integers(PAGE + 1, 20), steps=st.integers(1, 6), seed=st.integers(0, 99))
def test_a_prompt_shares_the_pages_an_earlier_request_left(length, steps, seed):
    executor = Executor(CONFIG, model=MODEL)
    try:
        prompt = tuple((seed * 7 + i * 13) % 256 for i in range(length))
        first = run(executor, "a", prompt, steps)
        executor.release("a")
        coord = executor.memory
        cached = coord.pools()["host"]["cached"]
        assert cached > 0, "the ended request left no page to the cache"
        again = prompt + tuple(first[:-1])  # its prompt and what it decoded, but the last token
        prefill_whole(executor, [NewSequence("b", again, GREEDY)])
        shared = coord.shared_len(executor.seqs["b"].row)
        assert shared == min(cached, (len(again) - 1) // PAGE * PAGE), (shared, cached, len(again))
        executor.check_integrity()
    finally:
        executor.close()
