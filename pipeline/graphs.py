"""Decode steps a CUDA graph replays: fixed-size inputs, the capture, and an audit of what blocks it.

A graph replays the kernels it recorded, on the buffers it recorded them with: a step may change
what those buffers hold, never their size or place, and the CPU may not read anything back while it
records. So a decode step over a padded batch size (a *bucket*) reads its inputs from one set of
buffers per bucket, written with ``copy_`` before each replay::

    bucket of 4, a batch of 3:   [ request a | request b | request c | pad ]
    rows       the requests' table rows          pad: request a's row
    positions  their lengths                     pad: request a's position
    locs       where their rows are written      pad: 0, the sink slot (never read)
    table_locs what req_to_token records         pad: request a's own location again

A padding token attends over request a's context and writes its rows to the sink; its outputs are
discarded. It records request a's own location in the token table once more (a duplicate index
with one value), so no other request's table row changes.

HiSparse memory is not padded: a padding token of request a would run a second swap-in of a's row
in the same call (the kernel takes each row once), so its buckets are the exact batch sizes up to
the largest bucket, and its buffers hold one more column, ``slots`` (the device slot of each
token's MLA row, which ``prepare_decode`` chose: an identity or newest column of the row's hot
buffer). Dynamic residency: a batch whose rows are all FULL has buckets of its own, whose buffers
hold one more, ``pages`` (the rows' device pages in position order, copied from the coordinator's
page table before each step: every token reads its top-k through them, no swap-in); a batch of both
layouts runs eagerly. Inside a HOT batch's forward the step's swap-in makes one call a layer
(``HOT >= top_k``: one call resolves a decode step) and adds its counts on the device
(``LayerCounters``); a replay runs no Python, so after it the counters are told (``replayed``), and
the warm-up steps' counts are taken back (``snapshot`` / ``restore``).

``CaptureAudit`` lists every op in a call that a graph cannot record (a read back to the host, an
output whose size depends on values, a copy between host and device), with where it was called;
``DecodeGraphs`` captures a bucket only when the audit of its first warm-up step is clean, and runs
every other step eagerly: a traced step, a batch above the largest bucket, a HiSparse batch of both
layouts. On a CPU nothing is captured, but the fixed-size inputs run the same way,
so their results are checked there.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import structlog
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.indexer_topk import indexer_topk
from pipeline.hisparse.coordinator import HiSparseCoordinator
from pipeline.hisparse.residency import pages_for
from pipeline.memory.interface import Layout
from pipeline.memory.resident import ResidentMemory
from pipeline.model import DeepseekV32
from pipeline.model.attention_api import AttentionInputs
from pipeline.model.resident import ForwardLayout, ResidentBackend

log = structlog.get_logger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32)  # padded batch sizes a decode step is captured at
WARM_UP_STEPS = 2  # eager steps on a side stream after the audited one, before the capture
ROOT = Path(__file__).resolve().parents[1]

HOST_READ = "host read"  # the CPU waits for a value (.item(), .tolist(), bool(tensor))
DYNAMIC_SHAPE = "data-dependent shape"  # an output's size depends on values
HOST_COPY = "host copy"  # a copy between host and device memory, or a tensor from Python values

_aten = torch.ops.aten
_HOST_READS = {
    _aten._local_scalar_dense.default,
    _aten.item.default,
    _aten.is_nonzero.default,
    _aten.equal.default,
    _aten.resolve_neg.default,  # what a CPU tensor's ``.tolist()`` and ``.numpy()`` dispatch
}
_DYNAMIC = {
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.bincount.default,
    _aten._unique.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
    _aten.unique_dim_consecutive.default,
}
_REPEAT_INTERLEAVE = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}
_INDEXING = {
    _aten.index.Tensor,
    _aten.index_put.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
}
_COPIES = {_aten._to_copy.default, _aten.copy_.default, _aten._pin_memory.default}


def bucket_for(num_rows: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket holding ``num_rows`` rows (None above the largest)."""
    return next((b for b in sorted(buckets) if b >= num_rows), None)


# --- the audit ----------------------------------------------------------------------------------------


@attrs.frozen
class Finding:
    """One op a graph cannot record, at one place in the code."""

    op: str  # the aten overload, e.g. "aten.nonzero.default"
    kind: str  # HOST_READ, DYNAMIC_SHAPE or HOST_COPY
    site: str  # the innermost repository frame that called it: "kernels/indexer_topk.py:_no_nan"
    stack: tuple[str, ...]  # repository frames of its first occurrence, outermost first
    count: int  # occurrences in the audited call


def _bool_index(indices: Any) -> bool:
    return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in indices or ())


def _devices(*tensors: Any) -> set[str]:
    return {t.device.type for t in tensors if isinstance(t, Tensor)}


def classify(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why ``func`` over these arguments cannot be recorded in a graph (None: it can)."""
    if func in _HOST_READS:
        return HOST_READ
    if func in _DYNAMIC:
        return DYNAMIC_SHAPE
    if func in _REPEAT_INTERLEAVE and kwargs.get("output_size") is None:
        return DYNAMIC_SHAPE
    if func in _INDEXING and _bool_index(args[1] if len(args) > 1 else kwargs.get("indices")):
        return DYNAMIC_SHAPE
    if func is _aten.lift_fresh.default and args[0].dim() > 0:
        return HOST_COPY  # ``torch.tensor`` of Python values: a copy from pageable memory on CUDA
    if func in _COPIES:
        if func is _aten._pin_memory.default:
            return HOST_COPY
        if func is _aten._to_copy.default:
            target = kwargs.get("device")
            if target is not None and torch.device(target).type != args[0].device.type:
                return HOST_COPY
            return None
        if len(_devices(args[0], args[1])) > 1:
            return HOST_COPY
    return None


def _repo_stack() -> tuple[str, ...]:
    """The caller's stack, repository files only (no virtual environment, not the audit itself)."""
    out = []
    for frame in traceback.extract_stack()[:-1]:
        path = Path(frame.filename)
        if not path.is_relative_to(ROOT) or ".venv" in path.parts or frame.name in _AUDIT_FRAMES:
            continue
        out.append(f"{path.relative_to(ROOT)}:{frame.lineno} in {frame.name}")
    return tuple(out)


_AUDIT_FRAMES = {"__torch_dispatch__", "_record", "_repo_stack"}


class CaptureAudit(TorchDispatchMode):
    """Records, while active, every aten op a CUDA graph could not capture (``classify``), each
    (op, call site) once with its count and the stack of its first occurrence."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: dict[tuple[str, str], Finding] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = classify(func, args, kwargs)
        if kind is not None:
            self._record(str(func), kind)
        return func(*args, **kwargs)

    def _record(self, op: str, kind: str) -> None:
        stack = _repo_stack()
        site = stack[-1].split(":")[0] + ":" + stack[-1].rsplit(" in ", 1)[1] if stack else "?"
        key = (op, site)
        seen = self._seen.get(key)
        self._seen[key] = (
            Finding(op, kind, site, stack, 1) if seen is None else attrs.evolve(seen, count=seen.count + 1)
        )

    def findings(self) -> list[Finding]:
        """In the order first met."""
        return list(self._seen.values())


def audit(fn: Callable[[], object]) -> list[Finding]:
    """What in ``fn()`` a CUDA graph could not capture (``fn`` runs once, for real)."""
    mode = CaptureAudit()
    with mode:
        fn()
    return mode.findings()


# --- the fixed-size inputs ------------------------------------------------------------------------------


@attrs.define(eq=False)
class StaticDecodeInputs:
    """The inputs of a decode step of one bucket, in buffers that never move (see the module's
    picture). The host values go through one host block (pinned on CUDA) and one copy."""

    size: int  # the bucket: tokens of the padded batch
    block: Tensor  # [3, size] int64 device: rows, positions, ids
    locs: Tensor  # [size] int64 device: where each token's rows are written (pad: the sink, 0)
    table_locs: Tensor  # [size] int64 device: what req_to_token records (pad: the first token's)
    slots: Tensor  # [size] int64 device: the device slot of each token's MLA row (HiSparse; unpadded)
    _host: Tensor  # [3, size] int64 host, the block's source
    _host_values: np.ndarray = attrs.field(init=False)  # its numpy view (made once)
    _copied: Any = None  # the CUDA event of the last copy out of ``_host`` (None: nothing in flight)

    def __attrs_post_init__(self) -> None:
        self._host_values = self._host.numpy()

    @classmethod
    def allocate(cls, size: int, device: torch.device) -> StaticDecodeInputs:
        pinned = device.type == "cuda"
        host = torch.zeros(3, size, dtype=torch.int64, pin_memory=pinned)
        block = torch.zeros(3, size, dtype=torch.int64, device=device)
        locs, table_locs, slots = (torch.zeros(size, dtype=torch.int64, device=device) for _ in range(3))
        return cls(size, block, locs, table_locs, slots, host)

    @property
    def rows(self) -> Tensor:
        return self.block[0]

    @property
    def positions(self) -> Tensor:
        return self.block[1]

    @property
    def ids(self) -> Tensor:
        return self.block[2]

    def fill(
        self, rows: list[int], positions: list[int], ids: list[int], locs: Tensor, slots: Tensor | None = None
    ) -> None:
        """Write a batch of ``len(rows)`` (1 to ``size``) tokens; ``locs [n]``: their write locations
        on the device, ``slots [n]`` their MLA rows' device slots (HiSparse: ``n == size``). Padding
        repeats the first token's row and position, with token id 0."""
        n = len(rows)
        if not 0 < n <= self.size or len(positions) != n or len(ids) != n or locs.shape != (n,):
            raise ValueError(f"a batch of {n} tokens does not fit a bucket of {self.size}")
        if slots is not None and (slots.shape != (n,) or n != self.size):
            raise ValueError(f"slots of {tuple(slots.shape)} for a batch of {n} in a bucket of {self.size}")
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has read the host block
        pad = self.size - n
        host = self._host_values
        host[0, :n], host[1, :n], host[2, :n] = rows, positions, ids
        host[0, n:], host[1, n:], host[2, n:] = rows[0], positions[0], 0
        self.block.copy_(self._host, non_blocking=True)
        if self.block.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.locs[:n].copy_(locs)
        self.table_locs[:n].copy_(locs)
        if slots is not None:
            self.slots.copy_(slots)
        if pad:
            self.locs[n:].zero_()
            self.table_locs[n:].copy_(locs[:1].expand(pad))


@attrs.define(eq=False)
class PaddedResidentBackend(ResidentBackend):
    """The all-resident backend over a padded batch: padding tokens write their rows to the sink
    (``layout.write_locs``) while the token table records ``table_locs``; the indexer scores up to
    ``max_seq_len`` positions (a size fixed at capture, not read from the batch)."""

    table_locs: Tensor | None = None  # [T] int64
    max_seq_len: int | None = None

    def begin(self, layout: ForwardLayout) -> None:
        assert self.table_locs is not None
        self.store.req_to_token[layout.req_rows, layout.positions] = self.table_locs
        self.layout = layout
        self.last_topk = None
        self._compiled = False  # (the compiled CPU loop reads the layout's locations as the table's)

    def indexer_positions(self, inputs: AttentionInputs, keys: Tensor) -> Tensor:
        layout = self.layout
        assert layout is not None
        if inputs.index_q is None or inputs.index_w is None:
            raise ValueError(f"layer {inputs.layer} has no indexer queries (reuse_topk={inputs.reuse_topk})")
        return indexer_topk(
            inputs.index_q,
            inputs.index_w,
            keys,
            self.store.req_to_token,
            layout.req_rows,
            layout.positions + 1,
            inputs.top_k,
            inputs.index_scale,
            max_seq_len=self.max_seq_len,
            check=False,
        )


# --- the graphs ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def static_moe(model: DeepseekV32) -> Iterator[None]:
    """While capturing: the routed experts' fixed-shape path, where the model has one (a
    ``RoutedExperts`` with a ``static_shapes`` switch); the eager steps keep their own. Without the
    switch the expert loops' data-dependent shapes stay, and the audit refuses the capture."""
    switched = [m for m in model.modules() if hasattr(m, "static_shapes") and not m.static_shapes]
    for module in switched:
        setattr(module, "static_shapes", True)  # noqa: B010 (a switch another module defines)
    try:
        yield
    finally:
        for module in switched:
            setattr(module, "static_shapes", False)  # noqa: B010


@attrs.define(eq=False)
class _Bucket:
    inputs: StaticDecodeInputs
    backend: PaddedResidentBackend | None  # all-resident (HiSparse: one backend per step)
    # HiSparse, every row FULL: ``[rows, pages]`` int64 device, each FULL row's pages in position
    # order, -1 beyond them (``fill_pages``); None for a bucket of HOT rows
    pages: Tensor | None = None
    _table: Tensor | None = None  # the coordinator's table the buffer holds now
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    hidden: Tensor | None = None  # [size, D] the graph's output buffer
    # HiSparse: the unrecoverable-miss checks the recorded swap-ins registered, over the graph's own
    # tensors (``LayerCounters.replayed`` takes them after each replay)
    checks: list[tuple[int, Callable[[], None]]] = attrs.field(factory=list)

    def fill_pages(self, memory: HiSparseCoordinator) -> None:
        """Copy the coordinator's page table of the FULL rows into ``pages`` (on the device, with no
        CPU wait; only when the table changed: it is the same tensor until a FULL row's pages do)."""
        assert self.pages is not None
        table = memory.full_page_table()
        if table is self._table:
            return
        width = table.shape[1]
        if table.shape[0] != self.pages.shape[0] or width > self.pages.shape[1]:
            raise ValueError(f"a page table of {tuple(table.shape)} does not fit {tuple(self.pages.shape)}")
        self.pages[:, :width].copy_(table)
        self.pages[:, width:].fill_(-1)
        self._table = table


@attrs.define(eq=False)
class DecodeGraphs:
    """Decode forwards over fixed-size inputs, one bucket per padded batch size (all-resident) or
    per batch size (HiSparse), replayed from CUDA graphs where ``capture`` (CUDA) and the bucket's
    audit allow.

    A HiSparse batch whose rows are all FULL (dynamic residency) has buckets of its own (one per
    batch size, labelled ``"<size> FULL"``), reading its slots through a fixed-size copy of the page
    table. Not covered, so run eagerly by the caller: a batch above the largest bucket, a traced step
    (``TopKTrace`` reads the top-k per layer), a HiSparse batch of both layouts."""

    model: DeepseekV32
    memory: ResidentMemory | HiSparseCoordinator
    buckets: tuple[int, ...] = BUCKETS
    capture: bool = attrs.field(default=None)  # None: on CUDA
    refused: dict[str, str] = attrs.field(factory=dict)  # bucket (``label``) -> why it runs eagerly
    _buckets: dict[tuple[int, bool], _Bucket] = attrs.field(factory=dict, init=False)  # (size, FULL)
    _pool: Any = attrs.field(default=None, init=False)  # the graphs' private memory pool

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.memory, ResidentMemory | HiSparseCoordinator):
            raise TypeError(f"decode graphs cover the all-resident and HiSparse memories, not {self.memory}")
        if self.capture is None:
            self.capture = self.memory.device.type == "cuda"

    @property
    def padded(self) -> bool:
        """Whether a batch is padded to its bucket (all-resident) or has a bucket of its size (HiSparse)."""
        return isinstance(self.memory, ResidentMemory)

    def covers(self, rows: list[int]) -> bool:
        """Whether a decode batch of these request rows goes through the fixed-size inputs."""
        if not rows or bucket_for(len(rows), self.buckets) is None:
            return False
        memory = self.memory
        return isinstance(memory, ResidentMemory) or len({memory.layout(r) for r in rows}) == 1

    def captured(self) -> list[str]:
        """The labels of the buckets replayed from a graph, smallest first."""
        return [label(*key) for key in sorted(self._buckets) if self._buckets[key].graph is not None]

    def _full(self, rows: list[int]) -> bool:
        """Whether a covered batch is one of FULL rows (HiSparse with dynamic residency)."""
        memory = self.memory
        return isinstance(memory, HiSparseCoordinator) and memory.layout(rows[0]) is Layout.FULL

    def forward(
        self, rows: list[int], positions: list[int], ids: list[int], locs: Tensor, slots: Tensor
    ) -> Tensor:
        """The final-normed hidden states ``[n, D]`` of one decode token per row (a tensor of its
        own: the graph's output buffer is overwritten by the next replay); ``locs``, ``slots``: the
        step's ``WriteTargets``."""
        if not self.covers(rows):
            raise ValueError(f"a batch of {len(rows)} rows is not covered (buckets {self.buckets})")
        size = bucket_for(len(rows), self.buckets) if self.padded else len(rows)
        assert size is not None
        full = self._full(rows)
        step = self._bucket(size, full)
        step.inputs.fill(rows, positions, ids, locs, None if self.padded else slots)
        if full:
            assert isinstance(self.memory, HiSparseCoordinator)
            step.fill_pages(self.memory)
        if self.capture and step.graph is None and label(size, full) not in self.refused:
            return self._capture(label(size, full), step)[: len(rows)]
        if step.graph is not None:
            step.graph.replay()
            if isinstance(self.memory, HiSparseCoordinator):
                self.memory.counters.replayed(step.checks)
            assert step.hidden is not None
            return step.hidden[: len(rows)].clone()
        return self._body(step)[: len(rows)]

    def _bucket(self, size: int, full: bool) -> _Bucket:
        step = self._buckets.get((size, full))
        if step is None:
            memory = self.memory
            inputs = StaticDecodeInputs.allocate(size, memory.device)
            backend, pages = None, None
            if isinstance(memory, ResidentMemory):
                table = memory.store.req_to_token
                backend = PaddedResidentBackend(
                    memory.store, table_locs=inputs.table_locs, max_seq_len=table.shape[1]
                )
            elif full:  # as wide as the longest request's pages
                plan = memory.plan
                width = pages_for(plan.max_request_len, plan.page_size)
                rows = plan.max_running_requests
                pages = torch.full((rows, width), -1, dtype=torch.int64, device=memory.device)
            step = self._buckets[(size, full)] = _Bucket(inputs, backend, pages)
        return step

    def _body(self, step: _Bucket) -> Tensor:
        """The step a graph records: the table write (all-resident), every layer, the final norm."""
        inputs, memory = step.inputs, self.memory
        if isinstance(memory, ResidentMemory):
            assert step.backend is not None
            step.backend.begin(ForwardLayout(inputs.rows, inputs.positions, inputs.locs))
            return self.model(inputs.ids, inputs.positions, step.backend)
        backend = memory.backend(inputs.rows, inputs.positions, inputs.locs, inputs.slots, steps=1)
        backend.max_seq_len = memory.req_to_token_device.shape[1]
        if step.pages is None:
            backend.all_hot = True  # (``covers``)
        else:  # every row FULL: its slots through the bucket's copy of the page table
            backend.all_full, backend.page_table = True, step.pages
        return self.model(inputs.ids, inputs.positions, backend)

    def _capture(self, name: str, step: _Bucket) -> Tensor:
        """Run the step on a side stream (audited), warm up, then record it, as ``torch.cuda.graphs``
        asks; returns the step's hidden states (the first run's: this step is not replayed). Each
        warm-up writes what the step itself writes. A bucket whose audit finds anything, or whose
        capture fails, is refused (logged once) and runs eagerly from then on. HiSparse: the swap-in
        counts of the warm-ups are taken back, so that the step is counted once, as an eager one."""
        counters = self.memory.counters if isinstance(self.memory, HiSparseCoordinator) else None
        out: list[Tensor] = []
        with static_moe(self.model):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                findings = audit(lambda: out.append(self._body(step)))
                counted = None if counters is None else counters.snapshot()
                try:
                    for _ in range(WARM_UP_STEPS if not findings else 0):
                        self._body(step)
                finally:
                    if counters is not None and counted is not None:
                        counters.restore(counted)
            torch.cuda.current_stream().wait_stream(side)
            hidden = out[0]  # (made on the side stream, read on this one: not reused before that read)
            hidden.record_stream(torch.cuda.current_stream())
            if findings:
                first = findings[0]
                self._refuse(name, f"{len(findings)} uncapturable ops, first {first.op} at {first.site}")
                return hidden
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            recording = None if counters is None else counters.snapshot()
            try:
                with torch.cuda.graph(graph, pool=self._pool):
                    recorded = self._body(step)
            except Exception as exc:  # the capture is abandoned; eager steps still run
                self._refuse(name, f"{type(exc).__name__}: {exc}")
                return hidden
            finally:
                if counters is not None and recording is not None:
                    # recorded, not run: each replay counts its own (``replayed``), with these checks
                    step.checks = counters.restore(recording)
        step.graph, step.hidden = graph, recorded
        log.info("graphs.captured", bucket=name)
        return hidden

    def _refuse(self, name: str, why: str) -> None:
        self.refused[name] = why
        log.warning("graphs.eager", bucket=name, reason=why)


def label(size: int, full: bool = False) -> str:
    """A bucket's name: its size, and ``FULL`` for a batch of FULL rows."""
    return f"{size} FULL" if full else str(size)
