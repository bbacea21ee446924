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
* a killed rank fails the engine cleanly (``WorkerLost``), with no hang and no segment left (in
  ``test_tensor_parallel.py``: its ranks share a host pool by default).

``hispec plan --tp N`` counts the pool once a node when shared, N times when not.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import threading
import types

import attrs
import pytest
import torch
import torch.distributed as dist
from _engine_util import HOT, config, driver_outputs, make_prompts
from _tp_util import segments

from pipeline import SamplingParams
from pipeline.cli import main
from pipeline.distributed.executor import DistributedExecutor
from pipeline.distributed.shared_pool import (
    _ISSUED,
    _ISSUED_KEPT,
    _SETTLED,
    HostPoolLost,
    LeaderCopyFailed,
    SharedHostPool,
)
from pipeline.driver import SyncDriver
from pipeline.errors import ConfigError
from pipeline.hisparse.transfer import DoneHandle, FailedHandle

SHAPE = (2, 8, 4)  # [layers, host tokens, row_dim]


def node(timeout_s: float = 30.0, store=None) -> tuple[SharedHostPool, SharedHostPool]:
    """A leader and a follower of one node over one store (what ``SharedHostPool`` reads of a
    ``TensorGroup``)."""
    if store is None:
        store = dist.HashStore()
        store.set_timeout(datetime.timedelta(seconds=timeout_s))

    def rank(local_rank: int) -> SharedHostPool:
        group = types.SimpleNamespace(node=0, rank=local_rank, size=2, local_rank=local_rank, local_size=2,
                                      store=store, timeout_s=timeout_s)
        return SharedHostPool(group)  # type: ignore[arg-type]

    return rank(0), rank(1)


class GatedStream:
    """A transfer stream whose copies run when the test opens their gate (a failing one raises)."""

    def __init__(self) -> None:
        self.gates: list[threading.Event] = []
        self.handles: list[_GatedHandle] = []

    def copy_rows(self, dst, dst_idx, src, src_idx):
        gate = threading.Event()
        self.gates.append(gate)
        handle = _GatedHandle(gate, lambda: dst.index_copy_(1, dst_idx, src.index_select(1, src_idx)))
        self.handles.append(handle)
        return handle

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        for gate in self.gates:
            gate.set()


class _GatedHandle:
    def __init__(self, gate: threading.Event, run) -> None:
        self.gate, self.run, self.done = gate, run, False
        self.waited = threading.Event()  # someone (the leader's publisher) waits for the copy

    def query(self) -> bool:
        return self.gate.is_set() and self._finish()

    def wait(self) -> None:
        self.waited.set()
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


def test_a_follower_that_cannot_see_the_leaders_segment_says_so_and_creates_nothing():
    """The leader's segment is not where its name says (another container's /dev/shm, or gone): the
    follower refuses, naming the field, rather than mapping a file of its own that nobody writes."""
    leader, follower = node()
    leader.allocate(SHAPE, torch.float32, pinned=False)
    assert leader.path is not None
    os.unlink(leader.path)  # what a rank that does not share the leader's /dev/shm sees
    with pytest.raises(ConfigError, match=r"shared_host_pool.*does not see.*--no-shared-host-pool"):
        follower.allocate(SHAPE, torch.float32, pinned=False)
    assert not os.path.exists(leader.path)
    leader.close()


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
    gated, own = GatedStream(), GatedStream()
    mine = leader.stream("backup", gated)
    theirs = follower.stream("backup", own)
    src = torch.arange(2 * 6 * 4, dtype=torch.float32).view(2, 6, 4)
    dst_idx, src_idx = torch.tensor([2, 5]), torch.tensor([1, 4])
    try:
        mine.copy_rows(kv, dst_idx, src, src_idx)
        follows = theirs.copy_rows(seen, dst_idx, src, src_idx)
        assert gated.handles[0].waited.wait(30), "the leader's publisher never waited for its copy"
        assert not follows.query()  # the leader's copy has not run: nothing is published yet
        nothing = theirs.copy_rows(seen, dst_idx[:0], src, src_idx[:0])
        assert isinstance(nothing, DoneHandle)  # no copy, no number
        gated.gates[0].set()
        follows.wait()  # the leader's publisher saw it land
        assert follows.query()
        assert torch.equal(seen[:, dst_idx], src[:, src_idx])
        assert not own.gates  # the follower wrote nothing to the rows: the node's rows are written once
        back = torch.zeros(2, 6, 4)
        theirs.copy_rows(back, src_idx, seen, dst_idx)  # a copy from the rows is the follower's own
        assert len(own.gates) == 1
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
        # a copy the leader will never make (the ranks' numbering has parted): it fails at once with
        # the same reason, rather than after the group's timeout for each row redone
        never = theirs.copy_rows(seen, torch.tensor([2]), src, torch.tensor([0]))
        with pytest.raises(HostPoolLost, match="out of step"):
            never.wait()
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


def test_a_pool_closed_by_a_failed_start_ends_the_leaders_publishers():
    """A start that fails after the memory was built closes the pool, not the coordinator's streams:
    the publishing threads end all the same (a thread left waiting would keep the rows mapped for
    the life of the process), and a follower's wait fails at once."""
    leader, follower = node(timeout_s=30)
    leader.allocate(SHAPE, torch.float32, pinned=False)
    seen = follower.allocate(SHAPE, torch.float32, pinned=False)
    streams = [leader.stream(name, GatedStream()) for name in ("staging", "backup")]
    theirs = follower.stream("backup", GatedStream())
    idx, src = torch.tensor([0]), torch.ones(2, 1, 4)
    waiting = theirs.copy_rows(seen, idx, src, idx)  # a copy the failed leader never makes
    leader.close()
    assert not any(stream._publisher.is_alive() for stream in streams)  # type: ignore[attr-defined]
    with pytest.raises(HostPoolLost, match="closed"):
        waiting.wait()  # not the 30 s of the timeout
    theirs.close()


class LateLeaderStore:
    """A store whose own timeout has run out while the node's leader still loads its shard: a ``get``
    of a key nobody set fails at once, a ``wait`` given its own bound blocks until the key is set."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self.waiting = threading.Event()  # a follower is waiting for a key

    def set(self, key: str, value: str | bytes) -> None:
        with self._changed:
            self._data[key] = value.encode() if isinstance(value, str) else value
            self._changed.notify_all()

    def get(self, key: str) -> bytes:
        with self._changed:
            if key not in self._data:
                self.waiting.set()
                raise RuntimeError(f"the store's timeout passed waiting for {key}")
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            return value

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        with self._changed:
            self.waiting.set()
            if not self._changed.wait_for(lambda: set(keys) <= self._data.keys(), timeout.total_seconds()):
                raise RuntimeError(f"wait timeout for {keys}")


def follow_in_thread(follower: SharedHostPool) -> tuple[threading.Thread, dict[str, object]]:
    """``follower.allocate`` in a thread; what it returned (``kv``) or raised (``error``)."""
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["kv"] = follower.allocate(SHAPE, torch.float32, pinned=False)
        except Exception as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_a_follower_waits_for_a_leader_slower_than_the_groups_timeout():
    store = LateLeaderStore()
    leader, follower = node(store=store)
    before = segments()
    thread, result = follow_in_thread(follower)
    assert store.waiting.wait(30), "the follower never asked for the segment's name"
    kv = leader.allocate(SHAPE, torch.float32, pinned=False)  # its shard took longer than the timeout
    thread.join(30)
    assert not thread.is_alive() and "error" not in result, result
    seen = result["kv"]
    assert isinstance(seen, torch.Tensor)
    kv[1, 2] = 5.0
    assert torch.equal(seen[1, 2], torch.full((4,), 5.0))
    assert segments() == before


def test_a_leader_that_cannot_start_tells_the_waiting_followers_why(monkeypatch):
    from pipeline.distributed import worker

    def no_shard(*args, **kwargs):
        raise OSError("the leader's shard did not load")

    monkeypatch.setattr(worker, "build_shard", no_shard)
    store = LateLeaderStore()
    leader, follower = node(store=store)
    thread, result = follow_in_thread(follower)
    assert store.waiting.wait(30), "the follower never asked for the segment's name"
    setup = worker.RankSetup(config(), 30.0, {}, types.SimpleNamespace(), None, {})
    with pytest.raises(OSError, match="did not load"):
        worker.build_rank_executor(setup, leader.group)  # rank 0, the node's leader, fails to start
    thread.join(30)
    assert not thread.is_alive()
    error = result.get("error")
    assert isinstance(error, ConfigError) and "the leader's shard did not load" in str(error), result


class WatchedRecord:
    """A stream's header record that runs ``on_write`` after each write to its issued copies' slots."""

    def __init__(self, record: torch.Tensor, on_write) -> None:
        self.record, self.on_write = record, on_write

    def __getitem__(self, index):
        return self.record[index]

    def __setitem__(self, index, value) -> None:
        self.record[index] = value
        if isinstance(index, int) and index >= _ISSUED:
            self.on_write()


def test_a_follower_checking_a_copy_while_the_leader_reuses_its_slot_is_not_out_of_step():
    from pipeline.distributed.shared_pool import LeaderCopy, LeaderStream, _fingerprint

    leader, _ = node()
    kv = leader.allocate(SHAPE, torch.float32, pinned=False)
    record = leader._header[0]
    src, first = torch.ones(2, 1, 4), torch.tensor([3])
    # copy 1 wrote row 3; the follower's handle on it is checked at every step of the leader's writes
    mine = LeaderCopy(record, 1, 30.0, "staging", _fingerprint(first))
    problems: list[str] = []

    def check() -> None:
        if int(record[_SETTLED]) >= 1:
            try:
                mine.query()
            except HostPoolLost as exc:
                problems.append(str(exc))

    stream = LeaderStream("staging", InlineStream(), kv, WatchedRecord(record, check), on_close=lambda: None)
    try:
        stream.copy_rows(kv, first, src, torch.tensor([0]))
        mine.settle()
        for n in range(2, _ISSUED_KEPT + 2):  # copy 257 takes copy 1's slot
            stream.copy_rows(kv, torch.tensor([n % SHAPE[1]]), src, torch.tensor([0]))
    finally:
        stream.close()
    assert not problems, problems[0]


class InlineStream:
    """Copies made as they are issued."""

    def copy_rows(self, dst, dst_idx, src, src_idx):
        dst.index_copy_(1, dst_idx, src.index_select(1, src_idx))
        return DoneHandle()

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


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
