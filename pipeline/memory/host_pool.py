"""The paged host pool: a full copy of every committed token's KV, all layers.

``req_to_host[r, pos]`` is the host slot holding position ``pos`` of request row ``r``, or -1 when no
copy has been made. Host pages belong to one request each; a slot is recorded only once its copy
has been issued, so "recorded" means "a copy is there (or landing)".

On a CUDA machine the pool is pinned host memory; on a CPU machine it is an ordinary tensor and the
"device" pool beside it is another one, so every transfer is still a real, counted copy.

Every host tensor a copy to or from a CUDA device reads or writes is pinned (page-locked), so that
the copy is asynchronous and a side stream can run it: the host pool, the draft pool's rows kept on
host, and the staging blocks rows are gathered into on their way to the device (``to_device``).
The prefix cache keeps its pages in the host pool. ``pins_for`` (``pipeline/memory/step_inputs.py``,
which sends a step's small inputs the same way) is the one decision, ``host_zeros`` and
``host_empty`` the allocations that follow it. Pinned, the host pool is also addressed by the
row-copy kernel directly (``kernels.kv_copy.host_addressable``): the backups and staging copies
write it, and the swap-in reads it, as device work. So a CPU read of the pool (``to_device``, the
integrity checks) must come after a wait for the copies that write the rows it reads.

Shared rows. Under tensor parallelism the ranks of a node may hold one pool's rows between them
(``HostRows``, ``pipeline/distributed/shared_pool.py``): the rows come from shared memory and the
copies that write them are made once per node; the allocator and the map stay each rank's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import attrs
import torch

from pipeline.memory.paged import PagedAllocator, PagedTable
from pipeline.memory.step_inputs import pins_for

if TYPE_CHECKING:
    from pipeline.hisparse.transfer import TransferStream


class HostRows(Protocol):
    """Where a host pool's rows live when this process does not allocate them itself."""

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        """Zeros of ``shape`` (page-locked when ``pinned``): the pool's ``kv``."""
        ...

    def stream(self, name: str, inner: TransferStream) -> TransferStream:
        """The stream the pool's copies named ``name`` go through, over ``inner``."""
        ...


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
    """Zeros in host memory, page-locked when ``pinned``."""
    return torch.zeros(shape, dtype=dtype, pin_memory=pinned)


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
    """An uninitialised host tensor, page-locked when ``pinned`` (torch caches pinned blocks, and
    keeps one that an asynchronous copy reads until that copy has run)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pinned)


def to_device(host: torch.Tensor, index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host[index]`` (rows of a host tensor, along its first dim) on ``device``. Towards CUDA the
    rows are gathered into a pinned staging block first, so that the copy to the device is
    asynchronous (from pageable memory the CPU would wait for it).

    The gather reads ``host`` on the CPU at once: every device copy writing those rows must have
    been waited for (a prefill chunk's host rows: ``prefill_targets`` waits for the previous
    chunk's copy; the draft pool's host rows are written on the CPU, by blocking copies)."""
    index = index.to(host.device)
    if not pins_for(device):
        return host.index_select(0, index).to(device)
    block = host_empty((index.numel(), *host.shape[1:]), host.dtype, pinned=True)
    torch.index_select(host, 0, index, out=block)
    return block.to(device, non_blocking=True)


@attrs.define(eq=False)
class HostPool:
    """Host KV rows ``[num_layers, host_tokens, row_dim]`` and the per-request host map."""

    num_layers: int
    host_tokens: int
    row_dim: int
    page_size: int
    num_rows: int  # request rows
    max_len: int  # positions per request
    dtype: torch.dtype = torch.float32
    pin_memory: bool = False  # ``pins_for(device)`` of the device the pool's copies go to and from
    rows: HostRows | None = None  # where ``kv`` lives (None: this process's own memory)
    allocator: PagedAllocator = attrs.field(init=False)
    map: PagedTable = attrs.field(init=False)
    kv: torch.Tensor = attrs.field(init=False)  # [num_layers, host_tokens, row_dim]

    def __attrs_post_init__(self) -> None:
        self.allocator = PagedAllocator("host", self.host_tokens // self.page_size, self.page_size)
        self.map = PagedTable(
            "req_to_host", self.allocator, self.num_rows, self.max_len, empty=-1, fill_on_cover=False
        )
        shape = (self.num_layers, self.host_tokens, self.row_dim)
        if self.rows is None:
            self.kv = host_zeros(shape, self.dtype, pinned=self.pin_memory)
        else:
            self.kv = self.rows.allocate(shape, self.dtype, pinned=self.pin_memory)

    @property
    def req_to_host(self) -> torch.Tensor:
        """``[num_rows, max_len]`` int64 host slot of each position, -1 = no copy."""
        return self.map.table

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's row in one layer."""
        return self.row_dim * self.kv.element_size()

    def can_reserve(self, row: int, length: int) -> bool:
        return self.map.can_cover(row, length)

    def pages_needed(self, row: int, length: int) -> int:
        return self.map.pages_needed(row, length)

    def reserve(self, row: int, length: int) -> list[int]:
        """Host pages for positions ``[0, length)`` of ``row`` (nothing recorded yet).

        Raises ``OutOfMemory`` and changes nothing if the pool is short.
        """
        return self.map.cover(row, length)

    def record(self, row: int, positions: torch.Tensor) -> torch.Tensor:
        """Record that ``positions`` (already reserved) are being copied; returns their host slots."""
        return self.map.record(row, positions)

    def record_runs(self, rows: list[int], starts: list[int], counts: list[int]) -> torch.Tensor:
        """``record`` of ``[start, start + count)`` of each row in one write; their host slots."""
        return self.map.record_runs(rows, starts, counts)

    def slots(self, row: int, positions: torch.Tensor) -> torch.Tensor:
        return self.map.slots(row, positions)

    def release(self, row: int, *, handed: int = 0) -> None:
        """Free every host page ``row`` owns and forget its copies (its first ``handed`` own pages
        were just handed to the prefix cache)."""
        self.map.release(row, handed=handed)

    def check_integrity(self) -> None:
        """Host half of invariant I7 (docs/invariants.md): slots unique across requests, disjoint from
        the free list."""
        self.allocator.check_integrity()
        self.map.check_integrity()
