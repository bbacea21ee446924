"""Where the engine runs its executor's commands (``EngineConfig.executor_thread``): the executor's
thread by default, the event loop when asked; the same tokens either way, and the loop's other
tasks keep running between commands."""

from __future__ import annotations

import threading

import anyio
import attrs
import pytest
from _engine_util import config, driver_outputs, make_prompts

from pipeline import Engine, SamplingParams


@pytest.mark.asyncio
@pytest.mark.parametrize(("setting", "on_loop"), [(None, False), (False, True), (True, False)])
async def test_commands_run_where_the_config_says_with_the_drivers_tokens(tiny_model, setting, on_loop):
    cfg = attrs.evolve(config(num_steps=2), executor_thread=setting)
    prompts = make_prompts([14, 30, 7], seed=4)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    ids = ["a", "b", "c"]
    threads: set[str] = set()
    ticks = 0

    async with Engine(cfg, model=tiny_model) as engine:
        run = engine.executor.run

        def recording(*args, **kwargs):
            threads.add(threading.current_thread().name)
            return run(*args, **kwargs)

        engine.executor.run = recording
        results = {}
        done = anyio.Event()

        async def ticker() -> None:  # another task of the application's loop
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await anyio.sleep(0)

        async def one(rid, prompt) -> None:
            results[rid] = await engine.generate_text(prompt, params, request_id=rid)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            async with anyio.create_task_group() as requests:
                for rid, prompt in zip(ids, prompts):
                    requests.start_soon(one, rid, prompt)
            done.set()
        commands = engine.stats()["executor_commands"]

    loop_thread = threading.current_thread().name
    assert threads == ({loop_thread} if on_loop else {"hispec-executor"})
    assert ticks >= commands  # the loop took a turn for its other tasks at least once a command
    expected = driver_outputs(tiny_model, cfg, prompts, [params] * 3, ids)
    assert {rid: list(r.token_ids) for rid, r in results.items()} == expected
