"""Chunked prefill in the async engine: running requests decode between the chunks of a long prompt,
and an abort that arrives while a chunk's forward runs releases everything."""

from __future__ import annotations

import anyio
import attrs
import pytest
from _engine_util import Gate, config, driver_outputs, live_request, make_prompts, until

from pipeline import Engine, SamplingParams
from pipeline.messages import Mixed, PrefillChunk
from statemachines.request import State

CHUNK = 8


def chunked(**kw):
    return attrs.evolve(config(**kw), chunked_prefill_tokens=CHUNK)


def continuing(rid: str, *, after: int = 0):
    """Match a ``prefill_chunks`` call that carries a chunk of ``rid`` starting past ``after``."""

    def match(chunks) -> bool:
        return any(c.request_id == rid and c.start > after for c in chunks)

    return match


IDS = ("running", "long")


# the executor methods that run prefill chunks: alone (``prefill_chunks(chunks)``) or in the decode
# step's forward (``_mixed_step(Mixed, idle)``)
CHUNK_METHODS = ("prefill_chunks", "_mixed_step")


def chunks_of(args: tuple) -> tuple[PrefillChunk, ...]:
    """The chunks of a call to one of ``CHUNK_METHODS``."""
    return tuple(args[0].prefill.chunks if isinstance(args[0], Mixed) else args[-1])


def chunk_sizes(executor, rid: str) -> list[int]:
    """The sizes of ``rid``'s chunks as the executor runs them (alone or in a mixed step), in order."""
    sizes: list[int] = []
    for method in CHUNK_METHODS:
        real = getattr(executor, method)

        def recorded(*args, real=real):
            sizes.extend(c.end - c.start for c in chunks_of(args) if c.request_id == rid)
            return real(*args)

        setattr(executor, method, recorded)
    return sizes


async def running_then_long(engine, prompts, params, meanwhile=None) -> dict:
    """Start ``running``; once it decodes, start ``long`` (then await ``meanwhile()``, if given);
    returns both results by request id."""
    results = {}

    async def one(i):
        results[IDS[i]] = await engine.generate_text(prompts[i], params[i], request_id=IDS[i])

    def decoding() -> bool:
        """``running`` has decoded a token (a condition that stays true once met: a state such as
        DECODE may come and go between two looks, a speculative round's DRAFT and VERIFY between)."""
        running = live_request(engine, IDS[0])
        return IDS[0] in results or (running is not None and len(running.output_ids) > 0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, 0)
        await until(decoding)
        tg.start_soon(one, 1)
        if meanwhile is not None:
            await meanwhile()
    return {rid: list(r.token_ids) for rid, r in results.items()}


@pytest.mark.asyncio
async def test_running_requests_decode_between_the_chunks_of_a_long_prompt(tiny_model):
    """While a long prompt is held in its second chunk, the running request keeps decoding (its
    steps run between the chunks), and every output equals the synchronous driver's."""
    cfg = chunked()
    prompts = make_prompts([6, 120], seed=3)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (40, 4)]
    expected = driver_outputs(tiny_model, cfg, prompts, params, list(IDS))
    async with Engine(cfg, model=tiny_model) as engine:

        async def meanwhile():
            await until(lambda: (r := live_request(engine, "long")) is not None and r.state is State.PREFILL)
            running = live_request(engine, "running")
            tokens_then = len(running.output_ids)
            await until(lambda: len(running.output_ids) >= tokens_then + 3)
            long = live_request(engine, "long")
            assert long is not None and long.state is State.PREFILL, "decode steps ran between the chunks"

        tokens = await running_then_long(engine, prompts, params, meanwhile)
    assert tokens == expected
    assert engine.executor.pool_counts() == engine.initial_pool_counts


@pytest.mark.asyncio
async def test_an_abort_while_a_chunk_runs_releases_everything(tiny_model):
    """The long prompt's consumer is cancelled while the executor runs one of its later chunks (in
    a step whose other request is decoding): it ends ABORTED once the chunk returns, every pool is
    back at its initial count, and the other request's tokens are the driver's."""
    cfg = chunked()
    prompts = make_prompts([6, 120], seed=4)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    expected = driver_outputs(tiny_model, cfg, prompts[:1], [params], ["other"])
    async with Engine(cfg, model=tiny_model) as engine:
        gate = Gate(lambda *args: continuing("victim", after=3 * CHUNK)(chunks_of(args)))
        for method in CHUNK_METHODS:
            gate.install(engine, method)
        results = {}

        async def other():
            results["other"] = await engine.generate_text(prompts[0], params, request_id="other")

        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            scope = anyio.CancelScope()

            async def victim():
                with scope:
                    await engine.generate_text(prompts[1], params, request_id="victim")

            tg.start_soon(victim)
            await gate.wait_entered()
            assert live_request(engine, "victim").state is State.PREFILL
            scope.cancel()  # the consumer leaves while its chunk's forward runs
            await anyio.sleep(0.01)
            gate.open()
        await engine.wait_idle()
        assert engine.stats()["requests"]["ended"].get("abort") == 1
        assert list(results["other"].token_ids) == expected["other"]
        assert engine.executor.pool_counts() == engine.initial_pool_counts


@pytest.mark.asyncio
async def test_paced_chunks_give_the_drivers_tokens(tiny_model):
    """``prefill_pacing``: chunk sizes follow the measured device times (so they vary run to run);
    the tokens are still the fixed-chunk driver's, no chunk is larger than the configured budget,
    and the pools come back."""
    cfg = attrs.evolve(config(), chunked_prefill_tokens=64)
    prompts = make_prompts([6, 200], seed=6)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (30, 4)]
    expected = driver_outputs(tiny_model, cfg, prompts, params, list(IDS))
    async with Engine(cfg, model=tiny_model, prefill_pacing=True) as engine:
        chunks = chunk_sizes(engine.executor, "long")
        tokens = await running_then_long(engine, prompts, params)
    assert engine.executor.pool_counts() == engine.initial_pool_counts
    assert tokens == expected
    assert sum(chunks) == 200 and max(chunks) <= 64 and len(chunks) >= 4


@pytest.mark.asyncio
@pytest.mark.parametrize("pacing", [False, True], ids=["fixed", "paced"])
async def test_the_engine_runs_chunks_in_the_decode_steps_forward(tiny_model, pacing):
    """Mixed steps (the default): the actor holds the chunk for the running request's next Decode and
    runs both as one forward; most of the long prompt's chunks are mixed, the tokens are the
    driver's, and the pools come back."""
    cfg = chunked()
    prompts = make_prompts([6, 120], seed=5)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (60, 4)]
    expected = driver_outputs(tiny_model, cfg, prompts, params, list(IDS))
    async with Engine(cfg, model=tiny_model, prefill_pacing=pacing) as engine:
        tokens = await running_then_long(engine, prompts, params)
        stats = engine.stats()
    assert tokens == expected
    assert engine.executor.pool_counts() == engine.initial_pool_counts
    mixed, forwards = stats["prefill"]["mixed_forwards"], stats["prefill"]["forwards"]
    assert mixed >= forwards // 2, f"{mixed} of {forwards} prefill forwards were mixed"


@pytest.mark.asyncio
async def test_without_mixed_steps_the_engine_alternates_forwards(tiny_model):
    cfg = attrs.evolve(chunked(), mixed_steps=False)
    prompts = make_prompts([6, 120], seed=5)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (30, 4)]
    expected = driver_outputs(tiny_model, cfg, prompts, params, list(IDS))
    async with Engine(cfg, model=tiny_model) as engine:
        tokens = await running_then_long(engine, prompts, params)
        assert engine.stats()["prefill"]["mixed_forwards"] == 0
    assert tokens == expected


@pytest.mark.asyncio
async def test_an_abort_in_the_middle_of_a_mixed_step_releases_everything(tiny_model):
    """Both consumers leave while one mixed forward runs: the long prompt's (its chunk in the
    forward) and a decoding request's (its token in the same forward). Both end ABORTED once the
    step returns, the third request's tokens are the driver's, every pool is back."""
    cfg = chunked()
    prompts = make_prompts([6, 9, 120], seed=7)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    expected = driver_outputs(tiny_model, cfg, prompts[:1], [params], ["other"])
    async with Engine(cfg, model=tiny_model) as engine:

        def victims_inside(command: Mixed, idle: bool) -> bool:
            inside = "decoder" in command.decode.request_ids
            return inside and continuing("victim", after=2 * CHUNK)(command.prefill.chunks)

        gate = Gate(victims_inside).install(engine, "_mixed_step")
        results = {}
        scopes = {rid: anyio.CancelScope() for rid in ("decoder", "victim")}

        async def run(rid, prompt):
            with scopes.get(rid, anyio.CancelScope()):
                results[rid] = await engine.generate_text(prompt, params, request_id=rid)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "other", prompts[0])
            tg.start_soon(run, "decoder", prompts[1])
            await until(lambda: all(
                (r := live_request(engine, rid)) is not None and r.state is State.DECODE
                for rid in ("other", "decoder")
            ))
            tg.start_soon(run, "victim", prompts[2])
            await gate.wait_entered()
            assert live_request(engine, "victim").state is State.PREFILL
            assert live_request(engine, "decoder").state is State.DECODE
            for scope in scopes.values():  # both consumers leave while the mixed forward runs
                scope.cancel()
            await anyio.sleep(0.01)
            gate.open()
        await engine.wait_idle()
        assert engine.stats()["requests"]["ended"].get("abort") == 2
        assert list(results["other"].token_ids) == expected["other"]
        assert engine.executor.pool_counts() == engine.initial_pool_counts


def test_no_mixed_steps_on_the_command_line():
    from pipeline.generate import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["--no-mixed-steps", "hi"])).mixed_steps is False
    assert engine_config(build_parser().parse_args(["hi"])).mixed_steps is True


def test_mixed_steps_must_be_a_bool():
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="mixed_steps"):
        attrs.evolve(config(), mixed_steps="yes")


@pytest.mark.asyncio
@pytest.mark.parametrize("num_steps", [None, 2], ids=["plain", "speculative"])
async def test_a_chunk_whose_decode_partner_stops_coming_still_runs(tiny_model, num_steps):
    """The running request ends a few steps into the long prompt's chunks (plain), or decodes in
    speculative rounds, which are never mixed: a chunk the actor holds for the next Decode runs
    alone once the decode stage waits for work or takes a round. No hang; the driver's tokens."""
    cfg = attrs.evolve(config(num_steps=num_steps), chunked_prefill_tokens=CHUNK)
    prompts = make_prompts([6, 120], seed=8)
    running = SamplingParams(max_new_tokens=4 if num_steps is None else 30, ignore_eos=True)
    params = [running, SamplingParams(max_new_tokens=4, ignore_eos=True)]
    expected = driver_outputs(tiny_model, cfg, prompts, params, list(IDS))
    async with Engine(cfg, model=tiny_model) as engine:
        with anyio.fail_after(60):  # a hang guard, not a timing assertion
            tokens = await running_then_long(engine, prompts, params)
    assert tokens == expected
    assert engine.executor.pool_counts() == engine.initial_pool_counts


@pytest.mark.asyncio
@pytest.mark.parametrize("budget", [CHUNK, "auto"], ids=["budget-one-chunk", "budget-auto"])
async def test_prompts_arriving_together_share_prefill_forwards_up_to_the_budget(tiny_model, budget):
    """Eight prompts of 20 tokens, chunks of 8: with a forward budget of one chunk they take at least
    20 prefill forwards (160 tokens, 8 a forward); with the default budget each forward carries the
    next chunk of every admitted prompt, so far fewer. The tokens are the driver's either way."""
    cfg = attrs.evolve(chunked(), prefill_batch_tokens=budget)
    prompts = make_prompts([20] * 8, seed=3)
    params = [SamplingParams(max_new_tokens=3, ignore_eos=True)] * 8
    ids = [f"p{i}" for i in range(8)]
    expected = driver_outputs(tiny_model, cfg, prompts, params, ids)
    results = {}
    async with Engine(cfg, model=tiny_model) as engine:

        async def one(i):
            result = await engine.generate_text(prompts[i], params[i], request_id=ids[i])
            results[ids[i]] = list(result.token_ids)

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i)
        forwards = engine.stats()["prefill"]["forwards"]
    assert results == expected
    assert engine.executor.pool_counts() == engine.initial_pool_counts
    if budget == CHUNK:
        assert forwards >= 20
    else:
        assert forwards < 20 and forwards >= 3, forwards  # each prompt takes 3 chunks
