"""The tensor-parallel group: the collectives the sharded model and the executors use, timed.

One :class:`TensorGroup` per process wraps a ``torch.distributed`` process group built directly
(``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA) over a store: the ``TCPStore`` rank 0
hosts for the ranks it spawns (``open_store``), or a launched group's (``launch.py``). No default
process group is created: an engine owns its group, so several engines (one after
another in a test, or side by side) never share global state.

Every collective has the group's timeout: a peer that died or hangs makes the call raise within it
(gloo notices a closed connection at once; the timeout bounds the rest). Objects travel pickled in a
uint8 tensor (length first), which is how the executors exchange commands and outcomes.
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Callable
from typing import Protocol, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import AllgatherOptions  # (torch.distributed does not export it)

from pipeline.errors import EngineError

_T = TypeVar("_T")

DEFAULT_TIMEOUT_S = 60.0  # the bound on a collective, hence on noticing a lost rank
# the bound on the ranks' first exchange, which waits for the slowest to load its shard (a rank that
# dies meanwhile is noticed at once: its connection closes)
START_TIMEOUT_S = 1800.0


class GroupLost(EngineError):
    """A following rank has nobody left to follow: rank 0 could not start, died, or stopped
    answering for longer than the group's timeout (or another rank broke the group)."""


class _Collectives(Protocol):
    """The collectives a process-group backend (``dist.Backend``: gloo, NCCL) binds and this group
    calls; torch's type stubs leave them out of ``Backend``."""

    def broadcast(self, tensors: list[Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def allreduce(self, tensors: list[Tensor], opts: dist.AllreduceOptions) -> dist.Work: ...

    def allgather(
        self, outputs: list[list[Tensor]], inputs: list[Tensor], opts: AllgatherOptions
    ) -> dist.Work: ...


class TensorGroup:
    """``size`` ranks; this process is ``rank``. ``collective_s`` sums the wall time spent inside
    collectives (waiting for peers included), ``num_collectives`` counts them."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        *,
        timeout_s: float,
        device: torch.device,
        node: int = 0,
        local_rank: int | None = None,
        local_size: int | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        # where this rank runs: ``node`` numbers the machines of the group, ``local_rank`` is the
        # rank's index among the ``local_size`` ranks of its node (every rank on one node: the
        # engine spawned them). Ranks of one node share what a node holds once (the host KV pool).
        self.node = node
        self.local_rank = rank if local_rank is None else local_rank
        self.local_size = size if local_size is None else local_size
        self.store = store  # the rendezvous, for what the ranks agree on outside collectives
        self.device = device
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        # objects and CPU tensors (commands, outcomes, the ready-set mask) always go over gloo;
        # the model's activations over NCCL when they live on CUDA devices
        # cast: the backends bind these collectives, their stubs do not declare them (_Collectives)
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, size, timeout)
        self._cpu = cast(_Collectives, gloo)
        self._dev = self._cpu
        if device.type == "cuda":  # pragma: no cover - needs several GPUs
            # a rank drives the device of its index on its node ("cuda" is the current device)
            torch.cuda.set_device(self.local_rank)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            nccl = dist.ProcessGroupNCCL(dist.PrefixStore("cuda", store), rank, size, options)
            self._dev = cast(_Collectives, nccl)
        self.collective_s = 0.0
        self.num_collectives = 0
        # set by the first collective that fails: every later one raises at once (a lost peer is
        # noticed once, not once per retry)
        self.broken: str | None = None

    # --- tensors ------------------------------------------------------------------------------------

    def all_reduce(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """In place: every rank ends with the same reduction (``"sum"``, ``"min"`` or ``"max"``)."""
        if self.size == 1:
            return tensor
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(
            {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
        )
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        self._timed(lambda: self._pg_for(tensor).allreduce([tensor], opts))
        return tensor

    def all_gather(
        self, tensor: Tensor, sizes: list[int], dim: int = -1, *, timeout_s: float | None = None
    ) -> Tensor:
        """Concatenate every rank's ``tensor`` along ``dim``; rank ``r``'s holds ``sizes[r]`` entries
        there (uneven shards are padded to the largest for the exchange, then trimmed). ``timeout_s``:
        this exchange's bound, if not the group's."""
        if self.size == 1:
            return tensor
        dim = dim % tensor.ndim
        width = max(sizes)
        if tensor.shape[dim] < width:
            pad = list(tensor.shape)
            pad[dim] = width - tensor.shape[dim]
            tensor = torch.cat([tensor, tensor.new_zeros(pad)], dim=dim)
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        opts = AllgatherOptions()
        opts.timeout = datetime.timedelta(seconds=self.timeout_s if timeout_s is None else timeout_s)
        self._timed(lambda: self._pg_for(tensor).allgather([parts], [tensor], opts))
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)

    # --- objects ------------------------------------------------------------------------------------

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's ``obj`` on every rank (the others pass nothing). One broadcast of a fixed-size
        frame (length + the first ``FRAME_BYTES``), a second only for a longer payload."""
        if self.size == 1:
            return obj
        payload = _encode(obj) if self.rank == 0 else None  # None: a receiving rank
        frame = torch.empty(_HEADER + FRAME_BYTES, dtype=torch.uint8) if payload is None else _frame(payload)
        self._broadcast(frame)
        length = _length(frame)
        if length > FRAME_BYTES:
            size = length - FRAME_BYTES
            rest = torch.empty(size, dtype=torch.uint8) if payload is None else payload[FRAME_BYTES:].clone()
            self._broadcast(rest)
        else:
            rest = torch.empty(0, dtype=torch.uint8)
        return obj if payload is not None else _decode(frame, rest, length)

    def all_gather_object(self, obj: _T, *, timeout_s: float | None = None) -> list[_T]:
        """Every rank's ``obj``, in rank order, on every rank: one all-gather of fixed-size frames,
        a second only when some payload is longer than a frame. Every rank gathers at the same point
        of the same code, so the others' objects have the type of this rank's. ``timeout_s``: this
        exchange's bound, if not the group's."""
        if self.size == 1:
            return [obj]
        payload = _encode(obj)
        frames = self.all_gather(
            _frame(payload), [_HEADER + FRAME_BYTES] * self.size, dim=0, timeout_s=timeout_s
        )
        frames = frames.view(self.size, _HEADER + FRAME_BYTES)
        lengths = [_length(f) for f in frames]
        extra = [max(n - FRAME_BYTES, 0) for n in lengths]
        rests = [torch.empty(0, dtype=torch.uint8)] * self.size
        if any(extra):
            joined = self.all_gather(payload[FRAME_BYTES:], extra, dim=0, timeout_s=timeout_s)
            rests = list(joined.split(extra))
        # cast: unpickled, each is an object of this rank's type (the same code sent it)
        return [cast(_T, _decode(f, r, n)) for f, r, n in zip(frames, rests, lengths)]

    # --- helpers ------------------------------------------------------------------------------------

    def _broadcast(self, tensor: Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        self._timed(lambda: self._cpu.broadcast([tensor], opts))

    def _pg_for(self, tensor: Tensor) -> _Collectives:
        return self._dev if tensor.is_cuda else self._cpu

    def _timed(self, issue: Callable[[], dist.Work]) -> None:
        if self.broken is not None:
            raise RuntimeError(f"the tensor-parallel group is broken: {self.broken}")
        start = time.perf_counter()
        try:
            issue().wait()
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            raise
        self.collective_s += time.perf_counter() - start
        self.num_collectives += 1

    def figures(self) -> dict[str, float | int]:
        return {"collective_s": self.collective_s, "num_collectives": self.num_collectives}


FRAME_BYTES = 8192  # a command, or an outcome with its rank's statistics, fits one frame
_HEADER = 8  # the payload's length, int64


def _encode(obj: object) -> Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def _frame(payload: Tensor) -> Tensor:
    """``[length (8 bytes) | the first FRAME_BYTES of the payload, zero-padded]``"""
    frame = torch.zeros(_HEADER + FRAME_BYTES, dtype=torch.uint8)
    frame[:_HEADER].view(torch.int64)[0] = payload.numel()
    head = payload[:FRAME_BYTES]
    frame[_HEADER : _HEADER + head.numel()] = head
    return frame


def _length(frame: Tensor) -> int:
    return int(frame[:_HEADER].view(torch.int64)[0])


def _decode(frame: Tensor, rest: Tensor, length: int) -> object:
    head = frame[_HEADER : _HEADER + min(length, FRAME_BYTES)]
    return pickle.loads(head.numpy().tobytes() + rest.numpy().tobytes())


def open_store(port: int, size: int, *, host: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous of a group on this machine: the host (the engine's process) listens on
    ``port`` (0: any free port, read back from ``store.port``), the others connect to it."""
    return dist.TCPStore(
        "127.0.0.1", port, size, host, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )
