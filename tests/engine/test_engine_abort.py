"""Abort and backpressure: cancelling a consumer aborts its request in whatever state it is, frees
everything it held, and leaves the other requests untouched; a slow consumer blocks nobody else."""

from __future__ import annotations

import anyio
import pytest
from _engine_util import Gate, Hold, config, driver_outputs, live_request, make_prompts, until

from pipeline import Engine, SamplingParams
from pipeline.messages import Decode
from statemachines.request import State

# where to hold the victim, the executor method to gate (None: hold the decode stage on the event
# loop, see below), and the state the victim is in meanwhile
HOLDS = {
    "queued": ("prefill_chunks", State.QUEUED),  # another request's prefill holds the device
    "prefill": ("prefill_chunks", State.PREFILL),
    "staging": ("collect_ready", State.STAGING),
    # another request's decode step is held before it is sent: the decode stage joins new requests
    # only between steps, so the victim, staged meanwhile, waits READY with its device buffer
    "ready": (None, State.READY),
    "decode": ("decode", State.DECODE),
    "draft": ("draft", State.DRAFT),
    "verify": ("verify", State.VERIFY),
}
# a streaming consumer is cancelled mid-stream, after its first delta: in the states after prefill
STREAMED = [where for where in HOLDS if where not in ("queued", "prefill")]


def involves(rid: str):
    """Match an executor call whose arguments mention request ``rid`` (a sequence or an id list)."""

    def match(*args) -> bool:
        if not args:
            return True  # collect_ready(): the victim is the only request staging
        items = args[0]
        return any(getattr(x, "request_id", x) == rid for x in items)

    return match


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("where", "consumer"), [(w, "text") for w in HOLDS] + [(w, "stream") for w in STREAMED]
)
async def test_cancelling_the_consumer_aborts_in_every_state(tiny_model, where, consumer):
    """The victim's consumer (``generate_text``, or a task iterating ``generate`` that has had at
    least one delta) is cancelled while the victim is held in ``where``: it ends ABORTED, every pool
    is back at its initial count, and a request submitted afterwards gets the driver's tokens."""
    method, state = HOLDS[where]
    spec = where in ("draft", "verify") or where == "staging"
    cfg = config(num_steps=3 if spec else None)
    prompts = make_prompts([21, 40, 9], seed=1)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    blocker = "other" if where in ("queued", "ready") else "victim"
    async with Engine(cfg, model=tiny_model) as engine:
        if method is None:
            gate = Hold(Decode).install(engine._pipe.decode)
        else:
            gate = Gate(involves(blocker)).install(engine, method)
        results = {}
        deltas = []  # what the streaming victim's consumer received

        async def consume(rid, prompt):
            results[rid] = await engine.generate_text(prompt, params, request_id=rid)

        async def stream(rid, prompt):
            async for delta in engine.generate(prompt, params, request_id=rid):
                deltas.append(delta)
            results[rid] = deltas[-1]  # not reached: cancelled mid-stream

        def victim_is(wanted: State) -> bool:
            req = live_request(engine, "victim")
            return req is not None and req.state is wanted

        try:
            async with anyio.create_task_group() as tg:
                if blocker == "other":
                    tg.start_soon(consume, "other", prompts[1])
                    await gate.wait_entered()
                victim_scope = anyio.CancelScope()
                victim_consumer = stream if consumer == "stream" else consume
                tg.start_soon(_run_in_scope, victim_scope, victim_consumer, "victim", prompts[0])
                if where == "queued":
                    await until(
                        lambda: any(r.request_id == "victim" for r in engine._pipe.core.admission.queue)
                    )
                elif where == "ready":
                    await until(lambda: victim_is(State.READY))
                else:
                    await gate.wait_entered()
                if consumer == "stream":
                    await until(lambda: len(deltas) >= 1)  # mid-stream: its first token was delivered
                victim = live_request(engine, "victim")
                assert victim.state is state
                victim_scope.cancel()
                await until(lambda: "victim" in engine._ctx.aborts.pending or victim.is_finished)
                gate.open()
                tg.start_soon(consume, "bystander", prompts[2])
        finally:
            gate.open()
        await engine.wait_idle()
        assert victim.state is State.ABORTED and victim.finish_reason == "abort"
        assert "victim" not in results
        assert engine.executor.pool_counts() == engine.initial_pool_counts
        assert engine.stats()["requests"]["ended"]["abort"] == 1
        assert results["bystander"].finish_reason == "length"
        if blocker == "other":
            assert results["other"].finish_reason == "length"
        if consumer == "stream":
            assert deltas and not any(d.finished for d in deltas)
            received = [t for d in deltas for t in d.token_ids]
            assert received == victim.output_ids[: len(received)]
    expected = driver_outputs(tiny_model, cfg, [prompts[2]], [params], ["bystander"])
    assert list(results["bystander"].token_ids) == expected["bystander"]


async def _run_in_scope(scope: anyio.CancelScope, fn, *args) -> None:
    with scope:
        await fn(*args)


@pytest.mark.asyncio
async def test_abort_by_id_and_breaking_out_of_the_iterator(tiny_model):
    cfg = config(num_steps=2)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    async with Engine(cfg, model=tiny_model) as engine:
        stream = engine.generate([5, 6, 7], params, request_id="a")
        deltas = [await anext(stream)]
        assert engine.abort("a") and not engine.abort("nobody")
        async for delta in stream:
            deltas.append(delta)
        assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
        # leaving the loop early and closing the iterator aborts too
        stream = engine.generate([8, 9], params, request_id="b")
        async for _delta in stream:
            break
        await stream.aclose()
        await engine.wait_idle()
        assert engine.stats()["requests"]["ended"] == {"abort": 2}
        assert engine.executor.pool_counts() == engine.initial_pool_counts


@pytest.mark.asyncio
@pytest.mark.parametrize("limit", [None, 3])
async def test_a_slow_consumer_blocks_nobody_else(tiny_model, limit):
    """One consumer stops reading after its first delta; the others run to the end meanwhile. With
    ``max_undelivered_tokens`` its own request is parked (backpressure on it alone); without, its
    output coalesces and it finishes too. Either way it then gets the driver's exact tokens."""
    cfg = config(num_steps=None)
    prompts = make_prompts([12, 30, 5, 17], seed=4)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ids = ["slow", "f1", "f2", "f3"]
    expected = driver_outputs(tiny_model, cfg, prompts, [params] * 4, ids)
    got: dict[str, list[int]] = {}
    resume = anyio.Event()
    deltas_of_slow = []
    finished = {rid: anyio.Event() for rid in ids}
    async with Engine(cfg, model=tiny_model, max_undelivered_tokens=limit) as engine:

        async def consume(rid, prompt):
            got[rid] = []
            async for delta in engine.generate(prompt, params, request_id=rid):
                got[rid] += delta.token_ids
                if rid == "slow":
                    deltas_of_slow.append(delta)
                    if len(deltas_of_slow) == 1:
                        await resume.wait()
            finished[rid].set()

        async with anyio.create_task_group() as tg:
            for rid, prompt in zip(ids, prompts):
                tg.start_soon(consume, rid, prompt)
            for rid in ids[1:]:
                await finished[rid].wait()  # while the slow consumer sleeps
            slow = live_request(engine, "slow")
            if limit is None:
                await until(lambda: "slow" not in engine._registry.live)  # ended, output undelivered
            else:
                assert slow is not None and slow.state is State.DECODE  # parked, memory kept
                assert len(slow.output_ids) <= 1 + limit
            resume.set()
    assert got == expected
    assert len(deltas_of_slow) >= 2
    if limit is None:  # everything it missed came as one coalesced delta
        assert len(deltas_of_slow) == 2 and deltas_of_slow[-1].finished


@pytest.mark.asyncio
async def test_a_deadline_aborts_the_request(tiny_model):
    """``generate_text(timeout=...)``: the request is held in prefill past its deadline."""
    cfg = config()
    async with Engine(cfg, model=tiny_model) as engine:
        gate = Gate().install(engine, "prefill_chunks")
        try:
            with pytest.raises(TimeoutError):
                await engine.generate_text(
                    [1, 2, 3], SamplingParams(max_new_tokens=5), request_id="late", timeout=0.05
                )
        finally:
            gate.open()
        await engine.wait_idle()
        assert engine.stats()["requests"]["ended"] == {"abort": 1}
        assert engine.executor.pool_counts() == engine.initial_pool_counts
        result = await engine.generate_text([1, 2, 3], SamplingParams(max_new_tokens=5), timeout=60)
        assert result.finish_reason == "length"
