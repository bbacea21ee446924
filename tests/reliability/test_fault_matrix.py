"""The fault matrix: every point where one request's work can fail, with speculation on and off and
HiSparse on and off (``pipeline.benchmarks.faults``; the points a configuration lacks are left out).

Five requests run at once through the engine (prompts past HOT, in chunks); a fault is pinned on one
of them, part way through its work. Then, for every cell:

* only the culprit fails (a release fault fails nobody: its request has ended already);
* every other request gets exactly the tokens of a fault-free run of the synchronous driver;
* the fault fired;
* the next request after it is served as if nothing had happened;
* every pool is back at its initial count, while the engine runs and after it has stopped.

The whole matrix takes about half a minute on a CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest
from _reliability_util import small_config

from pipeline import Engine, RequestFailed, SamplingParams
from pipeline.benchmarks.faults import POINTS, Culprit, Injector, applies

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from _engine_util import driver_outputs, make_prompts

LENGTHS = [10, 30, 14, 40, 12]  # the culprit's prompt (30) runs in two chunks and goes past HOT
CULPRIT = "m1"
# passages of the culprit through each point before its fault fires: part way through its work (an
# all-resident admission allocates once, its release frees once)
AFTER = dict(admit=1, prefill=1, staging=1, backup=3, swap_in=2, draft=1, verify=1, finalize=1, sample=0,
             release=1)
RESIDENT_AFTER = dict(AFTER, admit=0, release=0)
COPY_MODES = dict(staging="worker", backup="issue")  # (test_faults.py runs both modes of each)


def cells():
    for point in POINTS:
        for hisparse in (True, False):
            for speculative in (True, False):
                if not applies(point, hisparse=hisparse, speculative=speculative):
                    continue
                name = (
                    f"{point}-{'hisparse' if hisparse else 'resident'}-{'spec' if speculative else 'plain'}"
                )
                yield pytest.param(point, hisparse, speculative, id=name)


def config(hisparse: bool, speculative: bool):
    return small_config(hisparse=hisparse, num_steps=2 if speculative else None, chunked_prefill_tokens=16)


def requests(point: str) -> tuple[list[str], list[list[int]], list[SamplingParams]]:
    ids = [f"m{i}" for i in range(len(LENGTHS))]
    prompts = make_prompts(LENGTHS, seed=11)
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True) for _ in ids]
    if point == "sample":  # greedy steps draw nothing: the culprit samples
        params[1] = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, seed=5)
    return ids, prompts, params


@pytest.mark.asyncio
@pytest.mark.parametrize(("point", "hisparse", "speculative"), list(cells()))
async def test_a_fault_fails_its_culprit_only(tiny_model, point, hisparse, speculative):
    cfg = config(hisparse, speculative)
    ids, prompts, params = requests(point)
    expected = driver_outputs(tiny_model, cfg, prompts, params, ids)
    outcomes: dict[str, object] = {}
    async with Engine(cfg, model=tiny_model, max_prefill_tokens=10_000) as engine:
        after = (AFTER if hisparse else RESIDENT_AFTER)[point]
        injector = Injector(
            engine.executor, [Culprit(CULPRIT, point, after)], copy_mode=COPY_MODES.get(point, "worker")
        )

        async def one(rid, prompt, sp):
            try:
                outcomes[rid] = await engine.generate_text(prompt, sp, request_id=rid)
            except RequestFailed as exc:
                outcomes[rid] = exc

        with injector.installed() as fired, anyio.fail_after(120):  # hang guard
            async with anyio.create_task_group() as tg:
                for rid, prompt, sp in zip(ids, prompts, params):
                    tg.start_soon(one, rid, prompt, sp)
            # the fault left nothing behind: the next request is served as ever
            outcomes["next"] = await engine.generate_text(prompts[0], params[0], request_id="next")
        assert fired.counts[point] > 0, f"the {point} fault never fired"
        assert engine.executor.pool_counts() == engine.initial_pool_counts
    assert engine.final_pool_counts == engine.initial_pool_counts
    failed = {rid for rid, out in outcomes.items() if isinstance(out, RequestFailed)}
    if point == "release":
        assert not failed, {rid: outcomes[rid].reason for rid in failed}
    else:
        assert failed == {CULPRIT}, {rid: outcomes[rid].reason for rid in failed}
        assert f"injected {point}" in outcomes[CULPRIT].reason
    for rid, tokens in expected.items():
        if rid not in failed and not (rid == CULPRIT and point == "sample"):
            assert list(outcomes[rid].token_ids) == tokens, f"{rid} changed by the {point} fault"
    assert list(outcomes["next"].token_ids) == expected[ids[0]]
