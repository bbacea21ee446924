"""Tensor parallelism over two gloo ranks on the CPU, float64: the same numbers as one process.

* the sharded model (heads, experts, MLP width and vocabulary split unevenly) gives the logits of
  the whole model within 1e-9, target and MTP;
* the engine at TP 2 gives exactly the tokens of the synchronous driver at TP 1, HiSparse on,
  contexts past the hot region, speculation off and on;
* a rank whose staging copies lag (injected): no request leaves staging before every rank has it;
* a worker killed mid-run fails every live request and stops the engine; no process is left.
"""

from __future__ import annotations

import os
import signal

import anyio
import attrs
import pytest
import torch
import torch.multiprocessing as mp
from _engine_util import HOT, config, driver_outputs, make_prompts, until
from _model_util import new_backend, random_model, run, tiny_config
from _tp_util import Busy, SlowStaging, rank_checks, segments

from pipeline import Engine, SamplingParams
from pipeline.distributed.executor import DistributedExecutor, WorkerLost
from pipeline.distributed.group import open_store
from pipeline.driver import SyncDriver
from pipeline.errors import ConfigError
from pipeline.model import ForwardLayout
from statemachines.request import State

LENGTHS = [3, HOT + 1, 2 * HOT + 5, 5 * HOT + 3, 9]  # past HOT: HiSparse swaps rows in


def tp(cfg, size: int = 2):
    return attrs.evolve(cfg, tensor_parallel_size=size)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


# 3 heads, 6 experts, MLP width 97 and 257 vocabulary rows: every split is uneven over 2 ranks
UNEVEN = dict(num_attention_heads=3, n_routed_experts=6, n_group=3, intermediate_size=97)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """(the whole model's logits, what rank 0 of a two-rank group saw): one spawn for both checks."""
    cfg = tiny_config(**UNEVEN)
    model = random_model(cfg)
    ids = make_prompts([37], seed=3)[0]
    n = len(ids)
    want = run(model, new_backend(model, num_rows=n, num_requests=1, max_ctx=n), ids, torch.arange(n))
    backend = new_backend(model, num_rows=n, num_requests=1, max_ctx=n)
    pos = torch.arange(n)
    backend.begin(ForwardLayout(req_rows=torch.zeros_like(pos), positions=pos, write_locs=pos))
    with torch.no_grad():
        hidden = model(torch.tensor(ids), pos, backend)
        want_mtp = model.mtp_forward(torch.tensor(ids), pos, hidden, backend).logits
    store = open_store(0, 3, host=True, timeout_s=60)
    out = tmp_path_factory.mktemp("ranks") / "rank0.pt"
    args = (2, store.port, cfg, dict(model.state_dict()), ids, str(out))
    mp.start_processes(rank_checks, args=args, nprocs=2, start_method="spawn")
    whole = {"logits": want, "mtp": want_mtp, "params": sum(p.numel() for p in model.parameters())}
    return whole, torch.load(out)


@pytest.mark.slow
def test_sharded_forward_matches_the_whole_model(two_ranks):
    want, seen = two_ranks
    got = seen["forward"]
    assert (got["logits"] - want["logits"]).abs().max() < 1e-9
    assert (got["mtp"] - want["mtp"]).abs().max() < 1e-9
    assert got["logits"].argmax(-1).tolist() == want["logits"].argmax(-1).tolist()
    assert got["params"] < 0.75 * want["params"]  # rank 0 holds its shard, not the model


@pytest.mark.slow
def test_objects_of_any_size_cross_the_group(two_ranks):
    """Commands and outcomes travel pickled in frames: a short payload costs one collective, a long
    one a second; both arrive whole, in rank order."""
    got = two_ranks[1]["objects"]
    assert got["received"] == [True] * 8
    assert got["collectives"] == 4 * 1 + 4 * 2  # 4 exchanges within a frame, 4 past it


async def run_engine(model, cfg, prompts, params, ids) -> tuple[dict[str, list[int]], dict]:
    outputs: dict[str, list[int]] = {}

    async def consume(prompt, sp, rid):
        result = await engine.generate_text(prompt, sp, request_id=rid)
        outputs[rid] = list(result.token_ids)

    async with Engine(cfg, model=model) as engine:
        procs = list(engine.executor._procs)
        async with anyio.create_task_group() as tg:
            for prompt, sp, rid in zip(prompts, params, ids):
                tg.start_soon(consume, prompt, sp, rid)
                await anyio.sleep(0)
        stats = engine.stats()
        assert engine.executor.pool_counts() == engine.initial_pool_counts
    assert engine.final_pool_counts == engine.initial_pool_counts  # every rank's pools (rank1.* keys)
    assert procs and not any(p.is_alive() for p in procs)  # the engine stopped its workers
    return outputs, stats


async def check_engine_tp2_equals_tp1(model, num_steps):
    cfg = config(num_steps=num_steps, max_running_requests=4)
    prompts = make_prompts(LENGTHS, seed=11)
    params = [greedy(n) for n in (14, 9, 12, 6, 10)]
    ids = [f"tp-{i}" for i in range(len(prompts))]
    expected = driver_outputs(model, cfg, prompts, params, ids)
    got, stats = await run_engine(model, tp(cfg), prompts, params, ids)
    assert got == expected
    ranks = stats["tensor_parallel"]["ranks"]
    assert len(ranks) == 2 and all(r["collectives"]["num_collectives"] > 0 for r in ranks)
    assert sum(stats["hisparse"]["misses"]) > 0  # contexts past HOT: rows were swapped in
    return stats


@pytest.mark.slow
@pytest.mark.asyncio
async def test_engine_tp2_gives_the_tokens_of_tp1(tiny_model):
    await check_engine_tp2_equals_tp1(tiny_model, num_steps=None)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_engine_tp2_gives_the_tokens_of_tp1_speculative(tiny_model):
    stats = await check_engine_tp2_equals_tp1(tiny_model, num_steps=3)
    assert stats["speculative"]["verify_rounds"] > 0  # rank 0's rounds; every rank ran the same


@pytest.mark.slow
def test_ready_set_agreed_when_one_rank_stages_slowly(tiny_model):
    """Rank 1's prompt copies land only after a few polls; rank 0's at once. Rank 0 holds each
    request back until rank 1 has it too (the MIN agreement), and the tokens are TP 1's
    (speculative rounds: drafts and acceptance decided alike on both ranks). Each rank copies to a
    host pool of its own (a shared one is written by rank 0 alone)."""
    cfg = config(num_steps=2, max_running_requests=4)
    prompts = make_prompts(LENGTHS, seed=12)
    params = [greedy(6)] * len(prompts)
    ids = [f"slow-{i}" for i in range(len(prompts))]
    expected = driver_outputs(tiny_model, cfg, prompts, params, ids)
    own_pools = attrs.evolve(tp(cfg), shared_host_pool=False)
    executor = DistributedExecutor(own_pools, model=tiny_model, transfer={1: SlowStaging(polls=3)})
    try:
        driver = SyncDriver(Busy(executor), check=True)
        reqs = [driver.submit(p, sp, request_id=rid) for p, sp, rid in zip(prompts, params, ids)]
        driver.run()
        stats = executor.stats()
        assert {r.request_id: list(r.output_ids) for r in reqs} == expected
        fast, slow = (r["readiness"] for r in stats["tensor_parallel"]["ranks"])
        assert fast["held_back"] > 0  # rank 0 had requests ready that rank 1 had not staged yet
        assert slow["held_back"] == 0  # rank 1 never waited for rank 0
        assert fast["agreements"] == slow["agreements"] > 0
    finally:
        executor.close()


@pytest.mark.asyncio
async def test_a_killed_worker_fails_every_request_and_stops_the_engine(tiny_model):
    """Rank 1 is killed mid-decode (the ranks share one host pool, the default): every request fails,
    the engine stops, and no process nor shared-memory segment is left behind."""
    cfg = tp(config(max_running_requests=4))
    before = segments()
    reqs, procs = [], []
    with pytest.raises(ExceptionGroup) as info:
        async with Engine(cfg, model=tiny_model) as engine:
            procs = list(engine.executor._procs)

            async def consume(prompt):
                await engine.generate_text(prompt, greedy(250))

            async with anyio.create_task_group() as tg:
                for prompt in make_prompts([5, 20, 40], seed=13):
                    tg.start_soon(consume, prompt)
                await until(
                    lambda: len(engine._registry.live) == 3 and engine.stats()["requests"]["decoding"] > 0
                )
                reqs = list(engine._registry.live.values())
                os.kill(procs[0].pid, signal.SIGKILL)
    assert info.group_contains(WorkerLost)
    assert reqs and all(r.state is State.FAILED for r in reqs)
    assert all("tensor-parallel rank 1" in r.error for r in reqs)
    assert not any(p.is_alive() for p in procs)
    assert segments() == before


@pytest.mark.slow
@pytest.mark.asyncio
async def test_abort_and_retraction_give_back_every_ranks_memory(tiny_model):
    """Small pools force retractions; one request is aborted mid-run: every rank's pools end at
    their initial counts and the other requests get the tokens of an unconstrained TP 1 run."""
    small = config(device_pool_tokens=64, max_context_len=64, ratio=2)
    roomy = config(max_context_len=64)
    prompts = make_prompts([6, 9, 4, 8], seed=6)
    params = greedy(50)
    ids = [f"m{i}" for i in range(len(prompts))]
    expected = driver_outputs(tiny_model, roomy, prompts, [params] * len(ids), ids)
    results = {}
    async with Engine(tp(small), model=tiny_model) as engine:

        async def consume(rid, prompt):
            results[rid] = await engine.generate_text(prompt, params, request_id=rid)

        async with anyio.create_task_group() as tg:
            for rid, prompt in zip(ids, prompts):
                tg.start_soon(consume, rid, prompt)
            tg.start_soon(consume, "gone", make_prompts([30], seed=9)[0])
            await until(lambda: engine._registry.live.get("gone") is not None)
            engine.abort("gone")
        assert engine.executor.pool_counts() == engine.initial_pool_counts
    assert results["gone"].finish_reason == "abort"
    assert {rid: list(results[rid].token_ids) for rid in ids} == expected
    assert sum(results[rid].metrics.num_retractions for rid in ids) > 0
    assert engine.final_pool_counts == engine.initial_pool_counts
    assert any(k.startswith("rank1.") for k in engine.final_pool_counts)


@pytest.mark.asyncio
async def test_more_ranks_than_heads_is_refused_naming_the_field(tiny_model):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        async with Engine(tp(config(), size=tiny_model.cfg.num_attention_heads + 1), model=tiny_model):
            pass
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        tp(config(), size=0)


@pytest.mark.slow
def test_a_hung_worker_is_lost_within_the_timeout(tiny_model):
    """A worker that stops answering (SIGSTOP) makes the next command raise ``WorkerLost`` once the
    group's timeout has passed, not hang; the stopped process is reaped by ``close``."""
    executor = DistributedExecutor(tp(config()), model=tiny_model, timeout_s=5)
    proc = executor._procs[0]
    try:
        driver = SyncDriver(executor)
        driver.submit(make_prompts([20], seed=14)[0], greedy(4))
        driver.run()  # the group works
        os.kill(proc.pid, signal.SIGSTOP)
        driver.submit(make_prompts([20], seed=15)[0], greedy(4))
        with pytest.raises(WorkerLost):
            driver.run()
        assert executor.lost is not None
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        executor.close()
    assert not proc.is_alive()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_engine_agrees_on_readiness_when_one_rank_stages_slowly(tiny_model, monkeypatch):
    """The async engine over ranks whose staging differs (rank 1's copies land only after polls):
    the busy engine's ``CollectReady`` does not wait, so the ranks must agree; same tokens as TP 1."""
    cfg = config(num_steps=2, max_running_requests=4)
    prompts = make_prompts(LENGTHS, seed=16)
    params = [greedy(n) for n in (10, 7, 9, 5, 8)]
    ids = [f"agree-{i}" for i in range(len(prompts))]
    expected = driver_outputs(tiny_model, cfg, prompts, params, ids)

    def build(self):
        return DistributedExecutor(self.config, model=self._model, transfer={1: SlowStaging(polls=3)})

    monkeypatch.setattr(Engine, "_build_executor", build)
    own_pools = attrs.evolve(tp(cfg), shared_host_pool=False)  # each rank copies to its own host pool
    got, stats = await run_engine(tiny_model, own_pools, prompts, params, ids)
    assert got == expected
    fast, slow = (r["readiness"] for r in stats["tensor_parallel"]["ranks"])
    assert slow["held_back"] == 0 and fast["agreements"] > 0
