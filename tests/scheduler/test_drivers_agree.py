"""Both drivers run the same core: the async engine and the synchronous driver give every request the
same tokens and the same lifecycle events, for random workloads with aborts.

Aborts are asked for by the consumer once its request has ``abort_after`` output tokens; the engine
applies them at its next safe point, possibly a step later than the driver does. So an aborted
request's events are the un-aborted run's events up to some point, then ``AbortRequested``, and its
tokens a prefix of the un-aborted run's tokens; every other request matches exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from _engine_util import config, make_prompts

from pipeline import Engine, SamplingParams
from pipeline.driver import SyncDriver
from pipeline.executor import Executor

LIFECYCLE = {
    "Admitted", "PrefillDone", "FinishedAtPrefill", "StagingDone", "JoinedBatch", "DraftStarted",
    "DraftDone", "Verified", "StepDone", "Demoted", "Promoted", "Finished", "AbortRequested", "Crashed",
    "Retracted",
}

workloads = st.lists(
    st.tuples(
        st.integers(1, 30),  # prompt length
        st.integers(1, 12),  # max_new_tokens
        st.sampled_from([None, 1, 3]),  # abort once it has this many output tokens (None: never)
        st.booleans(),  # sampled (seeded) instead of greedy
    ),
    min_size=1,
    max_size=5,
)


def events_by_request(logs: list[dict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for entry in logs:
        if entry.get("event") in LIFECYCLE:
            out.setdefault(entry["request_id"], []).append(entry["event"])
    return out


def params_of(max_new: int, sampled: bool, i: int) -> SamplingParams:
    if sampled:
        return SamplingParams(max_new_tokens=max_new, temperature=0.9, seed=1000 + i, ignore_eos=True)
    return SamplingParams(max_new_tokens=max_new, ignore_eos=True)


def run_driver(model, cfg, prompts, params, aborts: dict[str, int]) -> dict[str, list[int]]:
    executor = Executor(cfg, model=model)
    driver = SyncDriver(executor, check=True)
    reqs = [driver.submit(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    while driver.step():
        for req in reqs:
            limit = aborts.get(req.request_id)
            if limit is not None and not req.is_finished and len(req.output_ids) >= limit:
                driver.abort(req.request_id)
    executor.close()
    return {r.request_id: list(r.output_ids) for r in reqs}


async def run_engine(model, cfg, prompts, params, aborts: dict[str, int]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    async with Engine(cfg, model=model) as engine:

        async def consume(rid: str, prompt, sp) -> None:
            got: list[int] = []
            async with engine.generate(prompt, sp, request_id=rid) as stream:
                async for delta in stream:
                    got.extend(delta.token_ids)
                    limit = aborts.get(rid)
                    if limit is not None and len(got) >= limit and not delta.finished:
                        engine.abort(rid)
            tokens[rid] = got

        with anyio.fail_after(120):  # a hang guard, not a timing assertion
            async with anyio.create_task_group() as tg:
                for i, (prompt, sp) in enumerate(zip(prompts, params)):
                    tg.start_soon(consume, f"r{i}", prompt, sp)
    assert engine.final_pool_counts == engine.initial_pool_counts
    return tokens


@pytest.mark.parametrize("num_steps", [pytest.param(None, marks=pytest.mark.slow), 2])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads)
def test_engine_and_driver_agree(tiny_model, num_steps, workload):
    cfg = config(num_steps=num_steps)
    prompts = make_prompts([n for n, *_ in workload], seed=len(workload))
    params = [params_of(m, sampled, i) for i, (_, m, _, sampled) in enumerate(workload)]
    aborts = {f"r{i}": a for i, (_, _, a, _) in enumerate(workload) if a is not None}

    with structlog.testing.capture_logs() as logs:
        reference = run_driver(tiny_model, cfg, prompts, params, {})
    ref_events = events_by_request(logs)
    with structlog.testing.capture_logs() as logs:
        driver = run_driver(tiny_model, cfg, prompts, params, aborts)
    driver_events = events_by_request(logs)
    with structlog.testing.capture_logs() as logs:
        engine = anyio.run(run_engine, tiny_model, cfg, prompts, params, aborts)
    engine_events = events_by_request(logs)

    for rid in reference:
        for name, toks, evs in (("driver", driver, driver_events), ("engine", engine, engine_events)):
            if evs[rid][-1] != "AbortRequested":
                assert toks[rid] == reference[rid], f"{name} {rid}: tokens differ"
                assert evs[rid] == ref_events[rid], f"{name} {rid}: events differ"
            else:
                assert rid in aborts, f"{name} {rid} aborted without being asked to"
                assert toks[rid] == reference[rid][: len(toks[rid])], f"{name} {rid}: not a prefix"
                assert evs[rid][:-1] == ref_events[rid][: len(evs[rid]) - 1], f"{name} {rid}: events"
