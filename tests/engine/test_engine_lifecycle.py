"""Lifecycle: logs replay through the state machine, shutdown in every state, bad requests, memory
pressure, and one request failing alone."""

from __future__ import annotations

import io
import subprocess
import sys

import anyio
import attrs
import pytest
import structlog
from _engine_util import Gate, Hold, config, driver_outputs, live_request, make_prompts, until

from pipeline import Engine, RequestError, RequestFailed, SamplingParams, configure_logging
from pipeline.logs import read_json_lines, replay
from pipeline.messages import CollectReady, Decode, Draft, Prefill, StepResult, Verify
from pipeline.scheduler import DecodePart
from statemachines.request import TERMINAL, State


async def mixed_run(engine, prompts, params, *, abort_one: bool = True) -> dict:
    """Run every prompt concurrently; abort the second one once it has output."""
    results = {}

    async def consume(i, prompt):
        rid = f"r{i}"
        async for delta in engine.generate(prompt, params, request_id=rid):
            if abort_one and i == 1 and not delta.finished:
                engine.abort(rid)
        results[rid] = delta

    async with anyio.create_task_group() as tg:
        for i, prompt in enumerate(prompts):
            tg.start_soon(consume, i, prompt)
    return results


@pytest.mark.asyncio
@pytest.mark.parametrize("num_steps", [None, 3])
async def test_captured_log_replays_legally(tiny_model, num_steps):
    # small pools: requests are refused at prefill and retracted while decoding (in speculative mode
    # also when two requests each pass alone but not together)
    cfg = config(num_steps=num_steps, device_pool_tokens=128, max_context_len=120, max_running_requests=6)
    prompts = make_prompts([5, 30, 12, 60, 9, 40, 22, 14], seed=1)
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    configure_logging(level="info", stream=io.StringIO())  # capture_logs keeps the level filter
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        async with Engine(cfg, model=tiny_model) as engine:
            results = await mixed_run(engine, prompts, params)
    assert {d.finish_reason for d in results.values()} == {"length", "abort"}
    final = replay(logs)
    assert set(final) == set(results) and all(state in TERMINAL for state in final.values())
    lifecycle = [e for e in logs if "from_state" in e]
    assert all(e["request_id"] and e["stage"] for e in lifecycle)  # bound through contextvars
    names = {e["event"] for e in lifecycle}
    assert {"Admitted", "PrefillDone", "StagingDone", "JoinedBatch", "AbortRequested"} <= names
    assert "Retracted" in names  # the small pools forced retractions
    steps = [e for e in lifecycle if e["event"] in ("StepDone", "Verified")]
    assert all("step_hits" in e and "batch_size" in e for e in steps)
    if num_steps:
        assert {"DraftStarted", "DraftDone", "Verified"} <= names


@pytest.mark.asyncio
async def test_json_log_file_replays_legally(tiny_model, tmp_path):
    path = tmp_path / "run.jsonl"
    sink = configure_logging(json=path, level="info")
    try:
        async with Engine(config(num_steps=2), model=tiny_model) as engine:
            await mixed_run(engine, make_prompts([9, 40, 17], seed=3), SamplingParams(max_new_tokens=12))
    finally:
        sink.close()
    records = read_json_lines(path)
    final = replay(records)
    assert len(final) == 3 and all(state in TERMINAL for state in final.values())
    assert all("timestamp" in r for r in records)


def test_importing_never_configures_logging():
    code = (
        "import structlog, pipeline; from pipeline import Engine, EngineConfig, SamplingParams;"
        "import pipeline.engine, pipeline.stages.wiring, pipeline.logs;"
        "assert not structlog.is_configured(), 'configured at import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# the decode stage's command held in each scenario, and the state the first request is then in:
# DECODE (plain decoding), DRAFT or VERIFY (speculative); the other states are the same in all three
FIRST = {"decode": (Decode, State.DECODE), "draft": (Draft, State.DRAFT), "verify": (Verify, State.VERIFY)}


@pytest.mark.asyncio
@pytest.mark.parametrize("first", list(FIRST))
@pytest.mark.parametrize("on_exit", ["abort", "finish"])
async def test_shutdown_with_requests_in_every_state_restores_pools(tiny_model, first, on_exit):
    """Leave the engine with a request in every state at once (checked at the moment of leaving):

    * s0 in DECODE, DRAFT or VERIFY: the decode stage's first step is held before it is sent (for
      DRAFT it is then let go and held inside the device command, after the draft started);
    * s1 READY: staged meanwhile, it waits to join the batch between two steps;
    * s2 STAGING: the staging stage's poll for it is held;
    * s3 PREFILL: held inside the device command (for DRAFT, which holds the device, its command is
      held before it is sent);
    * s4, s5 QUEUED: only 4 request rows.

    ``on_exit="abort"`` aborts all six, ``"finish"`` gives each the synchronous driver's tokens;
    either way every pool is back at its initial count."""
    spec = first != "decode"
    cfg = config(num_steps=3 if spec else None, max_running_requests=4)
    prompts = make_prompts([5, 40, 18, 33, 12, 8], seed=5)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ids = [f"s{i}" for i in range(len(prompts))]
    ends: dict[str, str] = {}
    tokens: dict[str, list[int]] = {}

    async def consume(engine, rid, prompt):
        tokens[rid] = []
        async for last in engine.generate(prompt, params, request_id=rid):
            tokens[rid] += last.token_ids
        ends[rid] = last.finish_reason

    async with anyio.create_task_group() as tg, Engine(cfg, model=tiny_model, on_exit=on_exit) as engine:
        pipe = engine._pipe
        holds: list = []

        def hold(h):
            holds.append(h)
            return h

        def state_of(rid: str) -> State | None:
            req = live_request(engine, rid)
            return None if req is None else req.state

        def start(*rids: str) -> None:
            for rid in rids:
                tg.start_soon(consume, engine, rid, prompts[ids.index(rid)])

        try:
            command, first_state = FIRST[first]
            step = hold(Hold(command).install(pipe.decode))
            start("s0")
            await step.wait_entered()
            start("s1")
            await until(lambda: state_of("s1") is State.READY)
            poll = hold(Hold(CollectReady).install(pipe.staging))
            start("s2")
            await poll.wait_entered()
            if first == "draft":
                prefill = hold(Hold(Prefill).install(pipe.prefill))
            else:
                prefill = hold(Gate().install(engine, "prefill_chunks"))
            start("s3")
            await prefill.wait_entered()
            start("s4", "s5")
            await until(lambda: {r.request_id for r in pipe.core.admission.queue} == {"s4", "s5"})
            if first == "draft":
                drafting = hold(Gate().install(engine, "draft"))
                step.open()
                await drafting.wait_entered()
            held = {rid: state_of(rid) for rid in ids}
            assert held == {
                "s0": first_state,
                "s1": State.READY,
                "s2": State.STAGING,
                "s3": State.PREFILL,
                "s4": State.QUEUED,
                "s5": State.QUEUED,
            }
        except BaseException:
            for h in holds:
                h.open()
            raise
        tg.start_soon(_open_when_closing, engine, holds)
    assert engine.final_pool_counts == engine.initial_pool_counts
    assert set(ends) == set(ids)
    if on_exit == "finish":
        assert set(ends.values()) == {"length"}
        assert tokens == driver_outputs(tiny_model, cfg, prompts, [params] * len(ids), ids)
    else:
        assert set(ends.values()) == {"abort"}


async def _open_when_closing(engine, holds) -> None:
    await until(lambda: not engine._running)
    for h in holds:
        h.open()


@pytest.mark.asyncio
async def test_bad_requests_raise_for_that_call_only(tiny_model):
    cfg = config(max_context_len=64)
    async with Engine(cfg, model=tiny_model) as engine:
        cases = [
            ("", SamplingParams(), "prompt"),
            ([], SamplingParams(), "prompt"),
            ([1] * 64, SamplingParams(), "prompt"),
            ([1, 300], SamplingParams(), "prompt"),
            ("ok", SamplingParams(temperature=-1.0), "temperature"),
            ("ok", SamplingParams(top_p=0.0), "top_p"),
            ("ok", SamplingParams(max_new_tokens=0), "max_new_tokens"),
            ("ok", SamplingParams(top_k=-2), "top_k"),
            (42, SamplingParams(), "prompt"),
        ]
        for prompt, params, field in cases:
            with pytest.raises(RequestError) as info:
                engine.generate(prompt, params)
            assert info.value.field == field
            with pytest.raises(RequestError):
                await engine.generate_text(prompt, params)
        stream = engine.generate("abc", SamplingParams(max_new_tokens=50), request_id="dup")
        first = await anext(stream)
        with pytest.raises(RequestError) as info:
            engine.generate("abc", request_id="dup")
        assert info.value.field == "request_id" and not first.finished
        await stream.aclose()
        result = await engine.generate_text("def f():", SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert len(result.token_ids) == 8 and result.finish_reason == "length"


@pytest.mark.asyncio
@pytest.mark.parametrize("num_steps", [None, 3])
async def test_memory_pressure_retracts_and_completes(tiny_model, num_steps):
    """A device pool of 8 pages and host/logical pools of 16 cannot hold four requests growing to 7
    or 8 pages each: some are retracted while decoding (output kept) and re-admitted later, and
    every request still gets exactly the tokens of an unconstrained plain greedy run."""
    # with speculation, admission holds each request's whole device buffer (3 of the pages), so
    # the pressure that forces retractions comes from the logical and host pools instead
    small = (
        config(num_steps=num_steps, device_pool_tokens=64, max_context_len=64, ratio=2)
        if num_steps is None
        else config(num_steps=num_steps, device_pool_tokens=72, max_context_len=64, ratio=1)
    )
    roomy = config(num_steps=None, max_context_len=64)
    prompts = make_prompts([6, 9, 4, 8], seed=6)  # short: all admitted at once, then they grow
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    ids = [f"m{i}" for i in range(len(prompts))]
    expected = driver_outputs(tiny_model, roomy, prompts, [params] * len(ids), ids)
    results = {}
    async with Engine(small, model=tiny_model) as engine:

        async def consume(rid, prompt):
            results[rid] = await engine.generate_text(prompt, params, request_id=rid)

        async with anyio.create_task_group() as tg:
            for rid, prompt in zip(ids, prompts):
                tg.start_soon(consume, rid, prompt)
    assert {rid: list(r.token_ids) for rid, r in results.items()} == expected
    assert sum(r.metrics.num_retractions for r in results.values()) > 0
    assert engine.final_pool_counts == engine.initial_pool_counts
    # the synchronous driver under the same pressure (it retracts before drafting, too)
    assert driver_outputs(tiny_model, small, prompts, [params] * len(ids), ids) == expected


@pytest.mark.asyncio
async def test_one_failing_request_fails_alone(tiny_model):
    cfg = config()
    prompts = make_prompts([10, 20, 30], seed=8)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    async with Engine(cfg, model=tiny_model) as engine:
        real = engine.executor.decode
        steps = {"n": 0}

        def decode(ids):
            result = real(ids)
            steps["n"] += 1
            if steps["n"] == 5 and "bad" in result.tokens:  # the executor reports it failed
                tokens = {k: v for k, v in result.tokens.items() if k != "bad"}
                return StepResult(tokens, result.refused, failed={"bad": "injected fault"})
            return result

        engine.executor.decode = decode
        outcomes = {}

        async def consume(rid, prompt):
            try:
                outcomes[rid] = await engine.generate_text(prompt, params, request_id=rid)
            except RequestFailed as exc:
                outcomes[rid] = exc

        async with anyio.create_task_group() as tg:
            for rid, prompt in zip(["bad", "good1", "good2"], prompts):
                tg.start_soon(consume, rid, prompt)
        assert isinstance(outcomes["bad"], RequestFailed) and outcomes["bad"].reason == "injected fault"
        assert [outcomes[r].finish_reason for r in ("good1", "good2")] == ["length", "length"]
        await engine.wait_idle()
        assert engine.stats()["requests"]["ended"] == {"error": 1, "length": 2}
    assert engine.final_pool_counts == engine.initial_pool_counts
    assert live_request(engine, "bad") is None


@pytest.mark.asyncio
async def test_a_failed_release_leaves_the_engine_serving(tiny_model):
    """Releasing one request's memory raises once: the failure is logged with the request id, the
    memory is freed all the same, and the engine goes on serving (every request ends normally)."""
    async with Engine(config(), model=tiny_model) as engine:
        real = engine.executor.release
        calls = {"n": 0}

        def release(rid, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("release broke")
            real(rid, **kwargs)

        engine.executor.release = release
        results = {}

        async def consume(i):
            prompt = make_prompts([9 + i])[0]
            results[i] = await engine.generate_text(prompt, SamplingParams(max_new_tokens=4 + 6 * i))

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(consume, i)
        assert [results[i].finish_reason for i in range(3)] == ["length"] * 3
        after = await engine.generate_text(make_prompts([5])[0], SamplingParams(max_new_tokens=3))
        assert after.finish_reason == "length"
        await engine.wait_idle()
        assert engine.executor.pool_counts() == engine.initial_pool_counts
    assert calls["n"] >= 4
    assert engine.final_pool_counts == engine.initial_pool_counts


@pytest.mark.asyncio
async def test_a_stage_that_raises_stops_the_engine_cleanly(tiny_model, monkeypatch):
    """A bug in a stage (its turn raises): the engine's task group cancels the block, every live
    request ends FAILED, and every pool is given back before the executor closes."""
    reqs = []
    with pytest.raises(ExceptionGroup) as info:
        async with Engine(config(), model=tiny_model) as engine:
            real = DecodePart.turn
            calls = {"n": 0}

            def turn(self, *args, **kwargs):
                calls["n"] += 1
                if calls["n"] == 3:
                    raise RuntimeError("decode stage bug")
                return real(self, *args, **kwargs)

            monkeypatch.setattr(DecodePart, "turn", turn)

            async def consume(i):
                params = SamplingParams(max_new_tokens=40 + 6 * i)
                await engine.generate_text(make_prompts([9 + i])[0], params)

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(consume, i)
                await until(lambda: len(engine._registry.live) == 3)
                reqs = list(engine._registry.live.values())
    assert info.group_contains(RuntimeError, match="decode stage bug")
    assert all(r.state in TERMINAL for r in reqs) and any(r.state is State.FAILED for r in reqs)
    assert engine.final_pool_counts == engine.initial_pool_counts


@pytest.mark.asyncio
async def test_a_running_engine_keeps_what_was_alive_out_of_the_collector(tiny_model):
    """``freeze_gc``: while engines run, the objects alive at their start are frozen (``gc.freeze``);
    when the last of them closes they are handed back; ``freeze_gc=False`` leaves the collector be."""
    import gc

    import attrs

    gc.unfreeze()
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    async with Engine(config(), model=tiny_model) as first:
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the model, torch's modules, ...
        async with Engine(config(), model=tiny_model) as second:
            await second.generate_text("ab", params)
        assert gc.get_freeze_count() >= frozen  # the first one still runs
        await first.generate_text("ab", params)
    assert gc.get_freeze_count() == 0
    async with Engine(attrs.evolve(config(), freeze_gc=False), model=tiny_model) as engine:
        await engine.generate_text("ab", params)
        assert gc.get_freeze_count() == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("executor_thread", [False, True], ids=["on-the-loop", "in-a-thread"])
async def test_what_a_closed_engine_left_behind_is_not_frozen_by_the_next_one(tiny_model, executor_thread):
    """A dropped engine's memory (its pools) is freed at once: the coordinator holds no reference
    cycle, and no worker thread still holds the executor (the one that closed it, the one that ran
    its commands) while it waits for the GIL after handing its last result back. Cyclic garbage
    left behind when the next engine freezes the collector (a closed engine's, an application's) is
    collected first instead of frozen with the rest: frozen, it would stay for that engine's whole
    run, one more lot for every engine started after another (the soak benchmark's RSS grew by about
    1 MiB per round before, 294 -> 874 MiB in 3 minutes)."""
    import gc
    import weakref

    import torch

    gc.unfreeze()
    gc.collect()
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    cfg = attrs.evolve(config(num_steps=2), executor_thread=executor_thread)
    async with Engine(cfg, model=tiny_model) as first:
        await first.generate_text("ab", params)
        memory = weakref.ref(first.executor.memory)
    del first
    assert memory() is None, "a dropped engine's memory waits for the cyclic collector"
    # cyclic garbage old enough that only a full collection frees it
    junk: list = [torch.zeros(1024)]
    junk.append(junk)
    tensor = weakref.ref(junk[0])
    gc.collect(1)
    gc.collect(1)
    del junk
    assert tensor() is not None
    async with Engine(config(), model=tiny_model) as second:
        assert tensor() is None, "the next engine froze what the last one left behind"
        await second.generate_text("ab", params)
