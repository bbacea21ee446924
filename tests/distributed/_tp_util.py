"""Helpers of the tensor-parallel tests: functions the spawned ranks run (importable by name)."""

from __future__ import annotations

import os

import torch

from pipeline.distributed.group import TensorGroup, open_store
from pipeline.distributed.loading import StateDictSource, build_shard
from pipeline.distributed.shared_pool import SEGMENT_DIR, SEGMENT_PREFIX
from pipeline.model import ForwardLayout


def rank_checks(rank: int, size: int, port: int, cfg, tensors: dict, ids: list[int], out_path: str) -> None:
    """One rank of the two-rank checks (one spawn serves both): the object exchange, then a
    sharded forward; rank 0 saves what it saw."""
    torch.set_num_threads(1)
    store = open_store(port, size + 1, host=False, timeout_s=60)
    group = TensorGroup(store, rank, size, timeout_s=60, device=torch.device("cpu"))
    objects = exchange_objects(group)
    forward = sharded_forward(group, cfg, tensors, ids)
    if rank == 0:
        torch.save({"objects": objects, "forward": forward}, out_path)


def exchange_objects(group: TensorGroup) -> dict:
    """Payloads below, at and past a frame, both ways: whether each arrived whole, and how many
    collectives they took."""
    from pipeline.distributed.group import FRAME_BYTES

    before = group.num_collectives
    received = []
    for n in (0, FRAME_BYTES - 64, FRAME_BYTES, 3 * FRAME_BYTES):
        sent = {"from": 0, "data": bytes(range(256)) * (n // 256)}
        received.append(group.broadcast_object(sent if group.rank == 0 else None) == sent)
        mine = {"from": group.rank, "data": b"r" * (n * group.rank)}
        gathered = group.all_gather_object(mine)
        received.append(gathered == [{"from": r, "data": b"r" * (n * r)} for r in range(group.size)])
    return {"received": received, "collectives": group.num_collectives - before}


def sharded_forward(group: TensorGroup, cfg, tensors: dict, ids: list[int]) -> dict:
    """A sharded forward over one prompt (a resident backend): the target and MTP logits of the
    prefill, and the parameters this rank holds."""
    from _model_util import new_backend, run

    model = build_shard(cfg, torch.float64, torch.device("cpu"), group, StateDictSource(tensors))
    n = len(ids)
    logits = run(model, new_backend(model, num_rows=n, num_requests=1, max_ctx=n), ids, torch.arange(n))
    backend = new_backend(model, num_rows=n, num_requests=1, max_ctx=n)
    pos = torch.arange(n)
    backend.begin(ForwardLayout(req_rows=torch.zeros_like(pos), positions=pos, write_locs=pos))
    with torch.no_grad():
        hidden = model(torch.tensor(ids), pos, backend)
        mtp = model.mtp_forward(torch.tensor(ids), pos, hidden, backend).logits
    return {"logits": logits, "mtp": mtp, "params": sum(p.numel() for p in model.parameters())}


class SlowStaging:
    """A transfer stream factory whose staging copies report landed only on their ``polls``-th
    query, or once waited for (a rank whose prompt copies lag behind the others'); deterministic."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def __call__(self, name: str, device: torch.device):
        from pipeline.hisparse.transfer import make_transfer_stream

        inner = make_transfer_stream(name, device)
        return _SlowStream(inner, self.polls) if name == "staging" else inner


class _SlowHandle:
    def __init__(self, inner, polls: int) -> None:
        self.inner = inner
        self.polls_left = polls
        self.waited = False

    def query(self) -> bool:
        if self.waited or self.polls_left <= 0:
            return self.inner.query()
        self.polls_left -= 1
        return False

    def wait(self) -> None:
        self.inner.wait()
        self.waited = True

    def order_after(self) -> None:
        self.inner.order_after()


class _SlowStream:
    def __init__(self, inner, polls: int) -> None:
        self.inner = inner
        self.polls = polls
        self.handles: list[_SlowHandle] = []

    def copy_rows(self, dst, dst_idx, src, src_idx):
        handle = _SlowHandle(self.inner.copy_rows(dst, dst_idx, src, src_idx), self.polls)
        self.handles.append(handle)
        return handle

    def synchronize(self) -> None:
        self.inner.synchronize()
        for handle in self.handles:
            handle.waited = True
        self.handles.clear()

    def close(self) -> None:
        self.inner.close()


class Busy:
    """An executor seen as a busy engine sees it: ``CollectReady`` never waits for the copies in
    flight and the driver's ``wait_staging`` is skipped, so readiness depends on each rank's copies."""

    def __init__(self, executor) -> None:
        self.executor = executor

    def run(self, command, *, idle: bool = True):
        return self.executor.run(command, idle=False)

    def wait_staging(self) -> None:
        return None

    def __getattr__(self, name: str):
        return getattr(self.executor, name)


def segments() -> set[str]:
    """The shared host-pool segments this process leads (rank 0 is the test's process; other tests
    may run beside)."""
    mine = f"{SEGMENT_PREFIX}{os.getpid()}-"
    return {name for name in os.listdir(SEGMENT_DIR) if name.startswith(mine)}
