"""The paged host pool: a full copy of every committed token's KV, all layers.

``req_to_host[r, pos]`` is the host slot holding position ``pos`` of request row ``r``, or -1 when no
copy has been made. Host pages belong to one request each; a slot is recorded only once its copy
has been issued, so "recorded" means "a copy is there (or landing)".

On a CUDA machine the pool is pinned host memory; on a CPU machine it is an ordinary tensor and the
"device" pool beside it is another one, so every transfer is still a real, counted copy.
"""

from __future__ import annotations

import attrs
import torch

from pipeline.memory.paged import PagedAllocator, PagedTable


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
    pin_memory: bool = False
    allocator: PagedAllocator = attrs.field(init=False)
    map: PagedTable = attrs.field(init=False)
    kv: torch.Tensor = attrs.field(init=False)  # [num_layers, host_tokens, row_dim]

    def __attrs_post_init__(self) -> None:
        self.allocator = PagedAllocator("host", self.host_tokens // self.page_size, self.page_size)
        self.map = PagedTable(
            "req_to_host", self.allocator, self.num_rows, self.max_len, empty=-1, fill_on_cover=False
        )
        self.kv = torch.zeros(
            self.num_layers, self.host_tokens, self.row_dim, dtype=self.dtype, pin_memory=self.pin_memory
        )

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
