"""Offline replay: LRU replayed over a recorded plain-decode trace reproduces the engine's own miss
counters exactly, and Belady's MIN never needs more loads than LRU or CLOCK."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given

from pipeline.config import EngineConfig, HiSparseConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.hisparse.replay import POLICIES, replay, wanted_sets
from pipeline.hisparse.trace import read_trace
from pipeline.sampling import SamplingParams

HOT = 16


def test_lru_replay_reproduces_the_engines_misses(tiny_model, tmp_path):
    path = tmp_path / "topk.jsonl"
    config = EngineConfig(
        dtype="float64",
        page_size=4,
        max_context_len=256,
        max_running_requests=3,
        device_pool_tokens=256,
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2),
        speculative=None,
    )
    executor = Executor(config, model=tiny_model, trace_path=str(path))
    prompts = [[(7 * i) % 256 for i in range(n)] for n in (5, 40, 90)]  # short, crossing, long
    SyncDriver(executor).generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    engine_misses = sum(executor.memory.counters.misses)
    executor.close()
    result = replay(read_trace(path), HOT)
    assert result.steps > 0
    assert result.misses["lru"] == engine_misses
    assert result.misses["min"] <= min(result.misses["lru"], result.misses["clock"])


def test_replay_refuses_a_hot_region_smaller_than_a_step():
    records = [{"request": "r", "layer": 0, "phase": "decode", "position": 30, "top_k": list(range(10))}]
    with pytest.raises(ValueError, match="more than hot"):
        replay(records, hot=8)
    assert len(wanted_sets(records, hot=8)[("r", 0)][0]) == 10


@given(
    st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6), min_size=1, max_size=30),
    st.integers(6, 12),
)
def test_min_is_optimal_on_random_streams(steps, hot):
    steps = [list(dict.fromkeys(s)) for s in steps]
    counts = {name: fn(steps, hot) for name, fn in POLICIES.items()}
    assert counts["min"] <= counts["lru"] and counts["min"] <= counts["clock"]
    cold = {t for s in steps for t in s} - set(range(hot))
    assert counts["min"] >= len(cold)  # every position outside the initial cache is loaded at least once
