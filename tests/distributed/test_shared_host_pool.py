"""One HiSparse host pool per node, shared by its tensor-parallel ranks.

In one process (a leader and a follower over one store, fast):

* the follower maps the leader's segment: what one writes the other reads; the name is gone once
  both have mapped it, or once the leader closes when the follower never came;
* a follower's copy is a handle on the leader's copy of the same number: it lands when the leader's
  lands (and not before), fails when the leader's fails or wrote other rows, and a leader that
  closes (or a timeout) fails a follower's wait instead of leaving it waiting.

Over spawned ranks (gloo, float64):

* TP 2 over a shared pool gives the tokens of TP 1 (HiSparse misses), with every invariant checked
  after every step on every rank (each rank compares its device rows with the shared host rows, and
  the ranks' host maps agree); only rank 0 writes the rows; nothing is left under /dev/shm;
* the same with speculation and prefix-cache hits, shared and unshared pools alike, pools restored;
* a killed rank fails the engine cleanly (``WorkerLost``), with no hang and no segment left.

``hispec plan --tp N`` counts the pool once a node when shared, N times when not.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import signal
import threading
import types

import anyio
import attrs
import pytest
import torch
import torch.distributed as dist
from _engine_util import HOT, config, driver_outputs, make_prompts, until

from pipeline import Engine, SamplingParams
from pipeline.cli import main
from pipeline.distributed.executor import DistributedExecutor, WorkerLost
from pipeline.distributed.shared_pool import (
    SEGMENT_DIR,
    SEGMENT_PREFIX,
    HostPoolLost,
    LeaderCopyFailed,
    SharedHostPool,
)
from pipeline.driver import SyncDriver
from pipeline.errors import ConfigError
from pipeline.hisparse.transfer import DoneHandle, FailedHandle
from statemachines.request import State

SHAPE = (2, 8, 4)  # [layers, host tokens, row_dim]


def segments() -> set[str]:
    """The segments this process leads (rank 0 is the test's process; other tests may run beside)."""
    mine = f"{SEGMENT_PREFIX}{os.getpid()}-"
    return {name for name in os.listdir(SEGMENT_DIR) if name.startswith(mine)}


def node(timeout_s: float = 30.0) -> tuple[SharedHostPool, SharedHostPool]:
    """A leader and a follower of one node over one store (what ``SharedHostPool`` reads of a
    ``TensorGroup``)."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=timeout_s))

    def rank(local_rank: int) -> SharedHostPool:
        group = types.SimpleNamespace(node=0, local_rank=local_rank, local_size=2, store=store,
                                      timeout_s=timeout_s)
        return SharedHostPool(group)  # type: ignore[arg-type]

    return rank(0), rank(1)


class GatedStream:
    """A transfer stream whose copies run when the test opens their gate (a failing one raises)."""

    def __init__(self) -> None:
        self.gates: list[threading.Event] = []

    def copy_rows(self, dst, dst_idx, src, src_idx):
        gate = threading.Event()
        self.gates.append(gate)
        return _GatedHandle(gate, lambda: dst.index_copy_(1, dst_idx, src.index_select(1, src_idx)))

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        for gate in self.gates:
            gate.set()


class _GatedHandle:
    def __init__(self, gate: threading.Event, run) -> None:
        self.gate, self.run, self.done = gate, run, False

    def query(self) -> bool:
        return self.gate.is_set() and self._finish()

    def wait(self) -> None:
        assert self.gate.wait(30), "a gate the test never opened"
        self._finish()

    def order_after(self) -> None:
        self.wait()

    def _finish(self) -> bool:
        if not self.done:
            self.run()
            self.done = True
        return True


def test_the_ranks_of_a_node_map_one_segment():
    before = segments()
    leader, follower = node()
    kv = leader.allocate(SHAPE, torch.float32, pinned=False)
    assert len(segments() - before) == 1  # the follower has not mapped it yet: the name stays
    seen = follower.allocate(SHAPE, torch.float32, pinned=False)
    assert segments() == before  # both mapped: the name is gone, the memory stays
    assert seen.shape == SHAPE and bool((seen == 0).all())
    kv[1, 3] = 7.0
    assert torch.equal(seen[1, 3], torch.full((4,), 7.0))  # written through one, read through the other
    seen[0, 5, 2] = -1.0
    assert float(kv[0, 5, 2]) == -1.0


def test_a_segment_nobody_else_maps_is_removed_when_the_leader_closes():
    before = segments()
    leader, _ = node()
    leader.allocate(SHAPE, torch.float32, pinned=False)
    assert len(segments() - before) == 1
    leader.close()
    assert segments() == before


def test_shared_memory_too_small_is_a_clear_error_on_every_rank_and_leaves_nothing(monkeypatch):
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = segments()
    leader, follower = node()
    with pytest.raises(ConfigError, match=r"shared_host_pool.*--no-shared-host-pool"):
        leader.allocate(SHAPE, torch.float32, pinned=False)
    with pytest.raises(ConfigError, match=r"shared_host_pool.*leader could not create it"):
        follower.allocate(SHAPE, torch.float32, pinned=False)  # told at once, not after the store's timeout
    assert segments() == before


def test_a_followers_copy_lands_with_the_leaders():
    leader, follower = node()
    kv = leader.allocate(SHAPE, torch.float32, pinned=False)
    seen = follower.allocate(SHAPE, torch.float32, pinned=False)
    gated = GatedStream()
    mine = leader.stream("backup", gated)
    theirs = follower.stream("backup", GatedStream())
    src = torch.arange(2 * 6 * 4, dtype=torch.float32).view(2, 6, 4)
    dst_idx, src_idx = torch.tensor([2, 5]), torch.tensor([1, 4])
    try:
        mine.copy_rows(kv, dst_idx, src, src_idx)
        follows = theirs.copy_rows(seen, dst_idx, src, src_idx)
        assert not follows.query()  # the leader's copy has not run
        nothing = theirs.copy_rows(seen, dst_idx[:0], src, src_idx[:0])
        assert isinstance(nothing, DoneHandle)  # no copy, no number
        gated.gates[0].set()
        follows.wait()  # the leader's publisher saw it land
        assert follows.query()
        assert torch.equal(seen[:, dst_idx], src[:, src_idx])
    finally:
        mine.close()
        theirs.close()


def test_a_failed_leader_copy_fails_the_followers_and_the_numbering_stays_in_step():
    leader, follower = node()
    kv = leader.allocate(SHAPE, torch.float32, pinned=False)
    seen = follower.allocate(SHAPE, torch.float32, pinned=False)
    gated = GatedStream()
    mine, theirs = leader.stream("staging", gated), follower.stream("staging", GatedStream())
    src = torch.ones(2, 3, 4)
    idx = torch.tensor([0])
    try:
        real = gated.copy_rows
        gated.copy_rows = lambda *a: FailedHandle(RuntimeError("injected copy failure"))  # type: ignore[method-assign]
        mine.copy_rows(kv, idx, src, idx)
        failed = theirs.copy_rows(seen, idx, src, idx)
        with pytest.raises(LeaderCopyFailed):
            failed.wait()
        gated.copy_rows = real  # type: ignore[method-assign]
        mine.copy_rows(kv, idx + 1, src * 2, idx)
        gated.gates[-1].set()
        theirs.copy_rows(seen, idx + 1, src * 2, idx).wait()  # the second copy is the leader's second
        assert torch.equal(seen[:, 1], torch.full((2, 4), 2.0))
        with pytest.raises(LeaderCopyFailed):
            failed.query()
    finally:
        mine.close()
        theirs.close()


def test_a_follower_out_of_step_with_the_leader_fails_its_copy():
    leader, follower = node()
    kv = leader.allocate(SHAPE, torch.float32, pinned=False)
    seen = follower.allocate(SHAPE, torch.float32, pinned=False)
    gated = GatedStream()
    mine, theirs = leader.stream("backup", gated), follower.stream("backup", GatedStream())
    src = torch.ones(2, 3, 4)
    try:
        mine.copy_rows(kv, torch.tensor([0]), src, torch.tensor([0]))
        other_rows = theirs.copy_rows(seen, torch.tensor([1]), src, torch.tensor([0]))
        gated.gates[0].set()
        with pytest.raises(HostPoolLost, match="out of step"):
            other_rows.wait()
    finally:
        mine.close()
        theirs.close()


def test_a_follower_never_waits_forever():
    leader, follower = node(timeout_s=0.2)
    kv = leader.allocate(SHAPE, torch.float32, pinned=False)
    seen = follower.allocate(SHAPE, torch.float32, pinned=False)
    mine, theirs = leader.stream("backup", GatedStream()), follower.stream("backup", GatedStream())
    idx, src = torch.tensor([0]), torch.ones(2, 1, 4)
    waiting = theirs.copy_rows(seen, idx, src, idx)  # a copy the leader never makes
    with pytest.raises(HostPoolLost, match="did not settle"):
        waiting.wait()  # bounded by the timeout: a hung leader
    mine.close()
    with pytest.raises(HostPoolLost, match="closed"):
        waiting.query()  # a leader that closed fails the wait at once
    theirs.close()  # its synchronize gives up as the handle does, and raises nothing
    del kv


def test_a_broken_group_ends_a_followers_wait_at_once():
    leader, follower = node(timeout_s=30)
    leader.allocate(SHAPE, torch.float32, pinned=False)
    seen = follower.allocate(SHAPE, torch.float32, pinned=False)
    mine, theirs = leader.stream("staging", GatedStream()), follower.stream("staging", GatedStream())
    idx, src = torch.tensor([0]), torch.ones(2, 1, 4)
    waiting = theirs.copy_rows(seen, idx, src, idx)  # a copy the leader never makes
    follower.group.broken = "a collective failed"  # what a lost rank leaves the group with
    with pytest.raises(HostPoolLost, match="group broke"):
        waiting.wait()  # not the 30 s of the timeout
    theirs.close()
    mine.close()


@pytest.mark.cuda
def test_on_cuda_the_segment_is_pinned_and_the_row_copy_kernel_addresses_it():
    from kernels.kv_copy import copy_rows, host_addressable

    leader, follower = node()
    kv = leader.allocate(SHAPE, torch.float32, pinned=True)
    seen = follower.allocate(SHAPE, torch.float32, pinned=True)
    try:
        assert host_addressable(kv) and host_addressable(seen)
        src = torch.randn(2, 5, 4, device="cuda")
        copy_rows(kv, torch.tensor([1, 6]), src, torch.tensor([0, 3], device="cuda"))
        torch.cuda.synchronize()
        assert torch.equal(seen[:, [1, 6]], src[:, [0, 3]].cpu())  # written by one, read by the other
        back = torch.zeros(2, 2, 4, device="cuda")
        copy_rows(back, torch.tensor([0, 1], device="cuda"), seen, torch.tensor([1, 6]))
        assert torch.equal(back.cpu(), src[:, [0, 3]].cpu())
    finally:
        leader.close()
        follower.close()


# --- over spawned ranks --------------------------------------------------------------------------

LENGTHS = [3, HOT + 1, 2 * HOT + 5, 5 * HOT + 3]  # past HOT: HiSparse swaps rows in


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def tp2(cfg, *, shared: bool = True):
    return attrs.evolve(cfg, tensor_parallel_size=2, shared_host_pool=shared)


def run_tp(model, cfg, batches: list[tuple[list, list, list]]) -> tuple[dict[str, list[int]], dict, dict]:
    """The batches one after another (a later one may hit the prefix cache of an earlier one), every
    invariant checked after every step; (tokens by request, rank 0's stats, rank 1's stats)."""
    before = segments()
    executor = DistributedExecutor(cfg, model=model)
    try:
        assert segments() == before  # every rank mapped the segment: its name is gone already
        initial = executor.pool_counts()
        driver = SyncDriver(executor, check=True)
        outputs: dict[str, list[int]] = {}
        for prompts, params, ids in batches:
            reqs = [driver.submit(p, sp, request_id=rid) for p, sp, rid in zip(prompts, params, ids)]
            driver.run()
            outputs |= {r.request_id: list(r.output_ids) for r in reqs}
        assert executor.pool_counts() == initial  # every rank's pools, the cache's pages counted free
        stats, follower = executor.stats(), executor._rank_stats[1]
    finally:
        executor.close()
    assert segments() == before
    return outputs, stats, follower


def test_tp2_over_a_shared_host_pool_gives_the_tokens_of_tp1(tiny_model):
    cfg = config(max_running_requests=4)
    prompts = make_prompts(LENGTHS, seed=21)
    params = [greedy(n) for n in (6, 4, 5, 3)]
    ids = [f"shared-{i}" for i in range(len(prompts))]
    expected = driver_outputs(tiny_model, cfg, prompts, params, ids)
    got, stats, follower = run_tp(tiny_model, tp2(cfg), [(prompts, params, ids)])
    assert got == expected
    assert sum(stats["hisparse"]["misses"]) > 0  # rows were swapped in from the shared pool
    leader = stats["host_pool"]
    assert leader["shared"] and leader["writes"] and leader["bytes_per_node"] == leader["bytes"]
    assert follower["host_pool"]["shared"] and not follower["host_pool"]["writes"]
    # /metrics: kv_cache_bytes{memory="host_node"}
    assert stats["kv_cache"]["host_node_bytes"] == leader["bytes"]


@pytest.mark.parametrize("shared", [True, False])
def test_plan_counts_the_host_pool_once_a_node_when_shared(tmp_path, capsys, shared):
    out = tmp_path / "plan.json"
    args = ["plan", "--context", "256", "--tp", "4", "--json", str(out)]
    assert main([*args, *([] if shared else ["--no-shared-host-pool"])]) == 0
    host = json.loads(out.read_text())["host"]
    assert host["shared"] is shared and host["pool_bytes"] > 0
    assert host["node_bytes"] == host["pool_bytes"] * (1 if shared else 4)
    assert ("counted once" if shared else "counted 4 times") in capsys.readouterr().out


@pytest.mark.slow
def test_shared_and_unshared_pools_give_tp1s_tokens_with_speculation_and_the_prefix_cache(tiny_model):
    cfg = config(num_steps=2, max_running_requests=4)
    first = make_prompts(LENGTHS, seed=22)
    again = [p + make_prompts([5], seed=23 + i)[0] for i, p in enumerate(first)]  # cached prefixes
    batches = [
        (first, [greedy(n) for n in (8, 6, 7, 5)], [f"a{i}" for i in range(4)]),
        (again, [greedy(n) for n in (5, 7, 4, 6)], [f"b{i}" for i in range(4)]),
    ]
    expected: dict[str, list[int]] = {}
    for prompts, params, ids in batches:  # TP 1: one driver a batch, as the cache does not change tokens
        expected |= driver_outputs(tiny_model, cfg, prompts, params, ids)
    shared, stats, follower = run_tp(tiny_model, tp2(cfg), batches)
    unshared, plain_stats, _ = run_tp(tiny_model, tp2(cfg, shared=False), batches)
    assert shared == expected == unshared
    assert stats["speculative"]["verify_rounds"] > 0
    assert stats["prefix_cache"]["hit_tokens"] > 0
    assert stats["host_pool"]["bytes_per_node"] * 2 == plain_stats["host_pool"]["bytes_per_node"]
    assert not plain_stats["host_pool"]["shared"] and follower["host_pool"]["shared"]


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_killed_rank_fails_the_engine_cleanly_and_leaves_no_segment(tiny_model):
    before = segments()
    reqs, procs = [], []
    with pytest.raises(ExceptionGroup) as info:
        async with Engine(tp2(config(max_running_requests=4)), model=tiny_model) as engine:
            procs = list(engine.executor._procs)

            async def consume(prompt):
                await engine.generate_text(prompt, greedy(250))

            async with anyio.create_task_group() as tg:
                for prompt in make_prompts([5, 20, 40], seed=24):
                    tg.start_soon(consume, prompt)
                await until(
                    lambda: len(engine._registry.live) == 3 and engine.stats()["requests"]["decoding"] > 0
                )
                reqs = list(engine._registry.live.values())
                os.kill(procs[0].pid, signal.SIGKILL)
    assert info.group_contains(WorkerLost)
    assert reqs and all(r.state is State.FAILED for r in reqs)
    assert not any(p.is_alive() for p in procs)
    assert segments() == before
