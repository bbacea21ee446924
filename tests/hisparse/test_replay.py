"""Offline replay: every engine policy replayed over a recorded trace reproduces the engine's own
per-layer miss counters exactly (plain decode, speculative verify of 2-4 tokens, retraction and
re-admission, abort, chunked prefill, prefix-cache hits), and Belady's MIN is a floor (and the
optimum, by brute force on small traces)."""

from __future__ import annotations

import functools
import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kernels.swap_in_policy import NEAR_POLICIES, POLICIES
from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.hisparse.replay import (
    ALL_POLICIES,
    Step,
    main,
    min_misses,
    policy_function,
    replay,
    swap_in_steps,
)
from pipeline.hisparse.trace import read_header, read_trace
from pipeline.sampling import SamplingParams

HOT = 16


def _record(
    tiny_model, path, *, policy: str, num_steps: int | None, pool: int = 176, chunk: int | None = None,
    prefix_cache: bool = False,
):
    """A workload on small pools: prompts short, crossing HOT and long; one request aborted midway.
    By default prompts are prefilled whole and recomputed on re-admission (no prefix cache); with
    ``chunk`` they are prefilled in chunks, and with ``prefix_cache`` two more prompts share the long
    ones' first 100 tokens (their first chunk starts past HOT)."""
    config = EngineConfig(
        dtype="float64",
        page_size=8,
        max_context_len=160,
        max_running_requests=4,
        device_pool_tokens=pool,
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=1, policy=policy),
        # not timed: the same turns are rounds (the same retractions and round restarts) however busy
        # the machine is
        speculative=(
            SpeculativeConfig(num_steps=num_steps, max_batch_size=8, timed=False) if num_steps else None
        ),
        chunked_prefill_tokens=chunk,
        prefix_cache=prefix_cache,
    )
    executor = Executor(config, model=tiny_model, trace_path=str(path))
    driver = SyncDriver(executor)
    prompts = [[(7 * i + j) % 256 for i in range(n)] for j, n in enumerate((5, 40, 90, 120))]
    if prefix_cache:
        prompts += [[*p[:100], 1, 2, 3] for p in prompts[2:]]
    reqs = [driver.submit(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in prompts]
    for turn in itertools.count():
        if not driver.step():
            break
        if turn == 12:
            driver.abort(reqs[1].request_id)
    misses = list(executor.memory.counters.misses)
    retractions = sum(r.metrics.num_retractions for r in reqs)
    executor.close()
    return misses, retractions


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("num_steps", [None, 1, 3])
def test_replay_reproduces_the_engines_misses_per_layer(tiny_model, tmp_path, policy, num_steps):
    path = tmp_path / "topk.jsonl"
    engine_misses, retractions = _record(tiny_model, path, policy=policy, num_steps=num_steps)
    assert retractions > 0  # the pools are small enough that a request is retracted and re-admitted
    header = read_header(path)
    assert (header["hot"], header["policy"]) == (HOT, policy)
    records = read_trace(path)
    assert ("verify" in {r["phase"] for r in records}) == bool(num_steps)
    if num_steps == 3:  # 4 verify steps of top-k 8 do not all fit HOT 16: the backend's rounds run
        assert _round_restarts(swap_in_steps(records, HOT)) > 0
    # the near positions are recorded whatever the policy (the default margin while tracing: top_k)
    assert header["near_margin"] == header["top_k"]
    assert all(
        len(r["near"]) > 0 for r in records if r["phase"] != "prefill" and r["position"] > header["top_k"]
    )
    result = replay(records, HOT, row_bytes=header["row_bytes"], top_k=header["top_k"])
    assert result.misses[policy] == engine_misses
    assert sum(engine_misses) > 0
    floor = result.total("min")
    assert all(floor <= result.total(name) for name in ALL_POLICIES)


def test_the_default_policy_on_a_cpu_is_adaptive_and_replays_as_such(tiny_model, tmp_path):
    """``HiSparseConfig(policy="auto")``, the default: a CPU engine runs ``adaptive``, its trace
    says so, and replaying that policy gives the engine's miss counters."""
    path = tmp_path / "topk.jsonl"
    engine_misses, _ = _record(tiny_model, path, policy="auto", num_steps=None)
    header = read_header(path)
    assert header["policy"] == "adaptive"
    records = read_trace(path)
    result = replay(
        records, HOT, row_bytes=header["row_bytes"], top_k=header["top_k"], policies=("adaptive", "lru")
    )
    assert result.misses["adaptive"] == engine_misses
    assert result.misses["lru"] != engine_misses  # the two differ on this workload: the check has teeth


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("num_steps", [None, 3])
def test_replay_reproduces_the_engines_misses_with_chunked_prefill(tiny_model, tmp_path, policy, num_steps):
    # prompts of up to 120 tokens in chunks of 24 (HOT 16): every chunk after the first reads the
    # earlier positions through the hot region, which leaves its columns in another recency order;
    # a prefix-cache hit starts its prompt's first chunk past HOT too. Replay follows both
    path = tmp_path / "topk.jsonl"
    engine_misses, _ = _record(
        tiny_model, path, policy=policy, num_steps=num_steps, chunk=24, prefix_cache=True, pool=512
    )
    records = read_trace(path)
    assert any(r["phase"] == "prefill" and r["position"] == 24 for r in records)  # a second chunk ran
    steps = swap_in_steps(records, HOT)
    assert any(s.prefill for stream in steps.values() for s in stream)
    result = replay(records, HOT, policies=[policy], top_k=read_header(path)["top_k"])
    assert result.misses[policy] == engine_misses


def test_prefill_chunks_are_runs_of_one_request_and_layer():
    # layers 0 and 1 of a request's chunk [0, 20), then of [20, 40) (HOT 4): the other layer's records
    # part the forwards, and the second chunk reads 0 (layer 0) and 2 (layer 1) through the hot region
    def chunk(layer, a, b, picked):
        return [
            {"request": "r", "layer": layer, "phase": "prefill", "position": p, "top_k": picked}
            for p in range(a, b)
        ]

    def decode(layer, position, picked):
        return {"request": "r", "layer": layer, "phase": "decode", "position": position, "top_k": picked}

    rec = [*chunk(0, 0, 20, [0]), *chunk(1, 0, 20, [1]), *chunk(0, 20, 40, [0, 25]), *chunk(1, 20, 40, [2])]
    rec += [decode(0, 40, [10]), decode(1, 40, [10]), decode(0, 41, [0]), decode(1, 41, [0])]
    steps = swap_in_steps(rec, hot=4)
    assert [s.prefill for s in steps[("r", 0)]] == [((0,),), ()]
    assert [s.prefill for s in steps[("r", 1)]] == [((2,),), ()]
    assert [s.reset for s in steps[("r", 0)]] == [True, False]
    # layer 0: the chunk made 0 the most recent, so LRU evicts 1 for 10 and 0 is a hit next; layer 1
    # evicts 0 for 10 (2 was the one made recent) and misses 0 again
    assert policy_function("lru")(steps[("r", 0)], 4) == 1
    assert policy_function("lru")(steps[("r", 1)], 4) == 2
    # a re-admission (its positions start over) forgets the first admission's chunks
    again = [*rec, *chunk(0, 0, 20, [0]), *chunk(1, 0, 20, [0]), *chunk(0, 20, 30, [3]), decode(0, 30, [1])]
    assert swap_in_steps(again, hot=4)[("r", 0)][2].prefill == ((3,),)
    # one layer and nothing between two forwards: the chunks cannot be told apart (read as one from 0)
    merged = [*chunk(0, 0, 20, [0]), *chunk(0, 20, 40, [3])]
    assert swap_in_steps([*merged, decode(0, 40, [1])], hot=4)[("r", 0)][0].prefill == ()


def _round_restarts(streams) -> int:
    """Verify steps that start a new swap-in round (the call stopped before them)."""
    count = 0
    for steps in streams.values():
        protected: set[int] = set()
        for step in steps:
            if step.call_start or step.reset:
                protected = set()
            if step.long and len(protected | set(step.want)) > HOT:
                count, protected = count + 1, set()
            protected |= set(step.want) if step.long else set(step.selected)
    return count


def test_replay_cli_side_by_side_and_json(tiny_model, tmp_path, capsys):
    import json

    path = tmp_path / "topk.jsonl"
    engine_misses, _ = _record(tiny_model, path, policy="lru", num_steps=3)
    assert main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "lru (engine)" in text and "min" in text and "slide" in text
    assert main([str(path), "--hot", "16", "--hot", "32", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    first, second = payload["results"]
    assert (first["hot"], second["hot"]) == (16, 32)
    lru = first["policies"]["lru"]
    assert lru["misses_per_layer"] == engine_misses
    assert lru["h2d_bytes"] == sum(engine_misses) * payload["recorded"]["row_bytes"]
    assert first["policies"]["min"]["over_min"] == 1.0


def test_replay_refuses_a_hot_region_smaller_than_a_step():
    records = [{"request": "r", "layer": 0, "phase": "decode", "position": 30, "top_k": list(range(10))}]
    with pytest.raises(ValueError, match="more than hot"):
        replay(records, hot=8)
    assert len(swap_in_steps(records, hot=8)[("r", 0)][0].want) == 10


def test_replay_refuses_verify_records_without_their_step():
    records = [{"request": "r", "layer": 0, "phase": "verify", "position": 30, "top_k": [1]}]
    with pytest.raises(ValueError, match="step"):
        replay(records, hot=8)


def test_verify_steps_see_the_newest_and_draft_columns():
    # a request at committed length 20 verifies positions 20..22 (HOT 8): the draft zone holds them.
    # Two are accepted; the decode at 22 then writes 22 into the newest column, over 21 (the last
    # accepted, which finalize had put there), so 21 and 20 must come from the hot region
    rec = [{"request": "r", "layer": 0, "phase": "prefill", "position": 0, "top_k": [0]}]
    rec += [
        {
            "request": "r",
            "layer": 0,
            "phase": "verify",
            "step": j,
            "position": 20 + j,
            "top_k": [20 + j, 19, 3, 21],
        }
        for j in range(3)
    ]
    rec += [{"request": "r", "layer": 0, "phase": "decode", "position": 22, "top_k": [22, 21, 20, 19]}]
    steps = swap_in_steps(rec, hot=8)[("r", 0)]
    assert [s.want for s in steps] == [(19, 3), (19, 3), (19, 3), (21, 20, 19)]
    assert [s.call_start for s in steps] == [True, False, False, True]
    assert steps[0].reset and not any(s.reset for s in steps[1:])
    # the call loads 19 once (a hit for its later steps; 3 is an identity column); the decode misses 21, 20
    assert policy_function("lru")(steps, 8) == 1 + 2


def _brute_force(steps: list[Step], hot: int) -> int:
    """The fewest loads of any eviction choices under the swap-in rules (tiny streams only)."""
    from pipeline.hisparse.replay import _rounds

    # the protected set each step sees (policy-independent); _rounds mutates the set it yields
    protected_sets = [frozenset(protected) for _, protected, _ in _rounds(steps, hot)]

    @functools.cache
    def best(i: int, resident: frozenset[int]) -> int:
        if i == len(steps):
            return 0
        step = steps[i]
        if step.reset:
            resident = frozenset(range(hot))
        if not step.long:
            return best(i + 1, resident)
        missed = [t for t in step.want if t not in resident]
        pinned = set(step.want) | protected_sets[i]
        evictable = sorted(resident - pinned)
        options = []
        for out in itertools.combinations(evictable, len(missed)):
            options.append(best(i + 1, (resident - set(out)) | set(missed)))
        return len(missed) + min(options)

    return best(0, frozenset(range(hot)))


streams = st.lists(
    st.tuples(st.lists(st.integers(0, 9), min_size=1, max_size=3, unique=True), st.booleans(), st.booleans()),
    min_size=1,
    max_size=9,
)


@settings(max_examples=60, deadline=None)
@given(streams, st.integers(3, 4))
def test_min_is_the_optimum_and_a_floor_on_small_streams(raw, hot):
    # (wanted positions, first step of a call, restart) per step; all steps long
    steps = [
        Step(tuple(w), tuple(sorted(w)), True, start or i == 0, reset and i > 0)
        for i, (w, start, reset) in enumerate(raw)
    ]
    floor = min_misses(steps, hot)
    assert floor == _brute_force(steps, hot)
    for name in ALL_POLICIES:
        assert floor <= policy_function(name)(steps, hot)


@pytest.mark.parametrize("policy", NEAR_POLICIES)
def test_a_near_policy_reads_the_recorded_near_positions(tiny_model, tmp_path, policy):
    # the engine ran the near-policy: replay reproduces it with the recorded near positions, and a
    # trace without them (a version 2 file: the near-policies then see none, as with near_margin 0)
    # replays the engine's misses no more: the near positions changed which columns were evicted
    path = tmp_path / "topk.jsonl"
    engine_misses, _ = _record(tiny_model, path, policy=policy, num_steps=None)
    records = read_trace(path)
    stripped = [{k: v for k, v in r.items() if k != "near"} for r in records]
    with_near = replay(records, HOT, policies=[policy]).misses[policy]
    without = replay(stripped, HOT, policies=[policy]).misses[policy]
    assert with_near == engine_misses
    assert without != engine_misses
