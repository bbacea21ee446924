"""Never hang: memory pressure with speculation on, cancellation of the engine's scope, break-out of
a stream, and random arrivals with aborts all end in a bounded number of steps.

Each test has a hang guard (a step bound in the driver, ``fail_after`` in the engine); they bound
hangs, they are not timing assertions.
"""

from __future__ import annotations

import math

import anyio
import pytest
import structlog
from _reliability_util import small_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import Engine, SamplingParams
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from statemachines.request import TERMINAL

STEP_BOUND = 2000


def run_bounded(driver: SyncDriver) -> int:
    for steps in range(1, STEP_BOUND + 1):
        if not driver.step():
            return steps
    raise AssertionError(f"no progress after {STEP_BOUND} steps: the scheduler is stuck")


def prompts(lengths: list[int]) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate(lengths)]


@pytest.mark.parametrize("num_steps", [3, None])
def test_short_prompts_filling_the_device_pool_do_not_deadlock_staging(tiny_model, num_steps):
    """The reported reproduction: 8 prompts of 7 tokens, pages of 8, HOT 16, a 64-token device
    pool. Admission used to take all of them (one page each); with speculation each then needed its
    whole 3-page buffer to leave STAGING, which nothing would free. Now admission holds the buffer
    from the start, so requests queue instead, and every one is served."""
    cfg = small_config(num_steps=num_steps, device_pool_tokens=64, max_context_len=64)
    executor = Executor(cfg, model=tiny_model)
    initial = executor.pool_counts()
    driver = SyncDriver(executor, check=True)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    reqs = [driver.submit(p, params) for p in prompts([7] * 8)]
    run_bounded(driver)
    assert all(r.finish_reason == "length" and len(r.output_ids) == 20 for r in reqs)
    assert executor.pool_counts() == initial
    executor.close()


def test_admission_never_bounces_a_batch_back_to_the_queue(tiny_model):
    """Admission judges a batch as a whole: no request goes PREFILL -> QUEUED (the old code bounced
    candidates it had judged one by one against the same free memory)."""
    cfg = small_config(num_steps=3, device_pool_tokens=128, max_context_len=64)
    executor = Executor(cfg, model=tiny_model)
    driver = SyncDriver(executor, check=True)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with structlog.testing.capture_logs() as logs:
        for p in prompts([5, 30, 9, 17, 3, 25, 11, 40, 2, 8] * 2):
            driver.submit(p, params)
        run_bounded(driver)
    bounced = [e for e in logs if e["event"] == "Retracted" and e.get("from_state") == "prefill"]
    assert bounced == []
    executor.close()


@pytest.mark.slow
def test_the_default_config_serves_the_reported_workload():
    """The reported reproduction with the default configuration and the bundled model: prompts of
    [16, 4000, 4000, 4000, 4000, 368] tokens, max_prefill_tokens=20000 (slow: long prefills)."""
    from pipeline.config import EngineConfig

    lengths = [16, 4000, 4000, 4000, 4000, 368]

    async def main():
        async with Engine(EngineConfig(), max_prefill_tokens=20000) as engine:
            results = {}

            async def one(i, n):
                results[i] = await engine.generate_text(prompts([n])[0], SamplingParams(max_new_tokens=4))

            with anyio.fail_after(900):
                async with anyio.create_task_group() as tg:
                    for i, n in enumerate(lengths):
                        tg.start_soon(one, i, n)
        assert engine.final_pool_counts == engine.initial_pool_counts
        return results

    results = anyio.run(main)
    assert len(results) == len(lengths)


# --- cancellation of the engine's scope ------------------------------------------------------------


async def _serve_until_cancelled(engine, started: anyio.Event) -> None:
    async def one(i):
        await engine.generate_text(prompts([10 + i])[0], SamplingParams(max_new_tokens=200, ignore_eos=True))

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(one, i)
        while len(engine._registry.live) < 4 or not any(r.output_ids for r in engine._registry.live.values()):
            await anyio.sleep(0.005)
        started.set()
        await anyio.sleep_forever()


@pytest.mark.asyncio
@pytest.mark.parametrize("pattern", ["cancel-scope", "move-on-after", "sibling-raises"])
async def test_leaving_a_cancelled_scope_returns_and_releases_everything(tiny_model, pattern):
    """The engine's block is left by a cancellation with requests live (its scope cancelled, a
    timeout, a sibling task raising in an enclosing task group): it returns (hang guard), every
    request ends, and every pool is back at its initial count before the executor closes."""
    engine = Engine(small_config(num_steps=2), model=tiny_model)
    reqs = []

    async def body(scope: anyio.CancelScope | None) -> None:
        async with engine:
            started = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(_serve_until_cancelled, engine, started)
                await started.wait()
                reqs.extend(engine._registry.live.values())
                if pattern == "cancel-scope":
                    scope.cancel()
                elif pattern == "move-on-after":
                    # the timeout falls due once the requests run, whatever the machine's speed (a
                    # fixed one second fired before they started on a busy machine)
                    scope.deadline = anyio.current_time()
                elif pattern == "sibling-raises":
                    raise RuntimeError("a sibling task failed")
                await anyio.sleep_forever()

    with anyio.fail_after(60):  # hang guard
        if pattern == "cancel-scope":
            with anyio.CancelScope() as scope:
                await body(scope)
        elif pattern == "move-on-after":
            with anyio.move_on_after(math.inf) as scope:
                await body(scope)
        else:
            with pytest.raises(ExceptionGroup) as info:
                async with anyio.create_task_group() as outer:
                    outer.start_soon(body, None)
            assert info.group_contains(RuntimeError, match="a sibling task failed")
    assert len(reqs) == 4 and all(r.state in TERMINAL for r in reqs)
    assert not engine._registry.live
    assert engine.final_pool_counts == engine.initial_pool_counts


# --- break out of a stream ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_breaking_out_of_a_stream_block_aborts_at_once(tiny_model):
    async with Engine(small_config(num_steps=None), model=tiny_model) as engine:
        params = SamplingParams(max_new_tokens=300, ignore_eos=True)
        async with engine.generate(prompts([9])[0], params, request_id="leaver") as stream:
            async for _ in stream:
                break  # the iterator is still held here
        # the block has been left: the request is being aborted, not generating 300 tokens
        req_state = engine._registry.live.get("leaver")
        assert req_state is None or "leaver" in engine._ctx.aborts.pending
        with anyio.fail_after(30):
            await engine.wait_idle()
        assert engine.stats()["requests"]["ended"] == {"abort": 1}


# --- random arrivals, aborts and cancellations ---------------------------------------------------------

actions = st.lists(
    st.tuples(
        st.integers(1, 40),  # prompt length
        st.integers(1, 30),  # max_new_tokens
        st.sampled_from(["finish", "abort", "cancel", "timeout"]),
        st.floats(0, 0.02),  # arrival delay
    ),
    min_size=1,
    max_size=10,
)


@pytest.mark.asyncio
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=actions)
async def test_small_pools_with_speculation_always_drain(tiny_model, workload):
    """Random arrivals with aborts, consumer cancellations and timeouts, on pools small enough to
    retract: every request ends, the engine drains (hang guard), every pool comes back."""
    cfg = small_config(num_steps=3, device_pool_tokens=72, max_context_len=64, max_running_requests=4)
    async with Engine(cfg, model=tiny_model) as engine:

        async def one(i, n, m, how, delay):
            await anyio.sleep(delay)
            params = SamplingParams(max_new_tokens=m, ignore_eos=True)
            rid = f"w{i}"
            if how == "timeout":
                with pytest.raises(TimeoutError):
                    await engine.generate_text(prompts([n])[0], params, request_id=rid, timeout=1e-4)
                return
            with anyio.CancelScope() as scope:
                async with engine.generate(prompts([n])[0], params, request_id=rid) as stream:
                    async for delta in stream:
                        engine._pipe.check_integrity()  # every live request held by its owner (I11)
                        if delta.token_ids and how == "abort":
                            engine.abort(rid)
                        elif delta.token_ids and how == "cancel":
                            scope.cancel()

        with anyio.fail_after(120):  # hang guard
            async with anyio.create_task_group() as tg:
                for i, (n, m, how, delay) in enumerate(workload):
                    tg.start_soon(one, i, n, m, how, delay)
            await engine.wait_idle()
        assert engine.executor.pool_counts() == engine.initial_pool_counts
    assert engine.final_pool_counts == engine.initial_pool_counts
