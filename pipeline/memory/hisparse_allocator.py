"""The two-level map of HiSparse: logical location -> physical device slot.

::

    req_to_token[r, pos] --> logical location --logical_to_physical--> physical slot (0 = no device copy)
                                   |
                                   +--> indexer keys (always on the device, indexed by location)

The logical allocator is ``host_to_device_ratio`` times larger than the physical one, or, under
dynamic residency, both are the two sides of one device arena (``pipeline/memory/arena.py``: the
indexer keys are a view of the KV rows' memory, handed out in frames). Page 0 of
both is reserved: physical slot 0 is the sink that "no device copy" points at, and logical location 0
is never a real token. ``logical_to_physical`` has one extra trailing entry fixed at -1, so that
indexing it with -1 (an invalid location) yields -1.

Ownership: every page of either level belongs to one request row (``PagedAllocator`` records it);
``logical_to_physical[loc]`` is 0 or a slot owned by the row that owns ``loc`` (invariant I2,
docs/invariants.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import torch

from pipeline.memory.arena import DeviceArena
from pipeline.memory.paged import AllocatorSnapshot, OutOfMemory, PagedAllocator, PagedTable, page_slots
from pipeline.memory.req_to_token import token_table


@attrs.frozen
class HiSparseSnapshot:
    """Everything ``restore`` needs to undo a transaction."""

    logical: Any  # AllocatorSnapshot (the arena's snapshot, both sides, under ``arena``)
    physical: AllocatorSnapshot | None
    mapping: torch.Tensor
    table: torch.Tensor
    table_pages: tuple[tuple[int, ...], ...]


@attrs.frozen
class PrefillAllocation:
    """What a dense-in-device prefill got: both levels, bound to each other."""

    logical_pages: list[int]
    physical_pages: list[int]
    locs: torch.Tensor  # [n] int64 logical location of each prompt position
    slots: torch.Tensor  # [n] int64 physical slot of each prompt position


@attrs.define(eq=False)
class HiSparseAllocator:
    """Logical and physical paged allocators, the token table, and the map between the levels."""

    page_size: int
    logical_tokens: int  # usable logical locations (page 0 extra)
    device_tokens: int  # usable physical slots (page 0 extra)
    num_rows: int  # request rows
    max_len: int  # positions per request
    # (bytes of a KV row, bytes of an indexer key), one layer: both levels share one device arena
    arena_bytes: tuple[int, int] | None = None
    arena: DeviceArena | None = attrs.field(init=False, default=None)
    logical: Any = attrs.field(init=False)  # PagedAllocator, or the arena's ArenaSide
    physical: Any = attrs.field(init=False)
    req_to_token: PagedTable = attrs.field(init=False)  # logical pages per request row
    # [logical rows + 1] int64; the last entry is -1 so that mapping[-1] == -1
    logical_to_physical: torch.Tensor = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        p = self.page_size
        if self.arena_bytes is not None:
            row_bytes, key_bytes = self.arena_bytes
            device_pages, logical_pages = self.device_tokens // p + 1, self.logical_tokens // p
            self.arena = DeviceArena(p, row_bytes, key_bytes, device_pages, logical_pages)
            self.logical, self.physical = self.arena.logical, self.arena.physical
        else:
            self.logical = PagedAllocator("logical", self.logical_tokens // p + 1, p, reserve_first_page=True)
            device_pages = self.device_tokens // p + 1
            self.physical = PagedAllocator("physical", device_pages, p, reserve_first_page=True)
        self.req_to_token = token_table(self.logical, self.num_rows, self.max_len)
        self.logical_to_physical = torch.zeros(self.logical.num_pages * p + 1, dtype=torch.int64)
        self.logical_to_physical[-1] = -1

    @property
    def logical_rows(self) -> int:
        return self.logical.num_pages * self.page_size

    @property
    def physical_rows(self) -> int:
        return self.physical.num_pages * self.page_size

    # --- allocation -----------------------------------------------------------------------------

    def fits(
        self,
        logical: int,
        physical: int,
        *,
        freed_physical: Iterable[int] = (),
        freed_logical: Iterable[int] = (),
        moves: Iterable[tuple[Iterable[int], int]] = (),
    ) -> bool:
        """Whether ``logical`` and ``physical`` more pages can be allocated together, once the pages
        ``freed_*`` (allocated now) are freed and each of ``moves`` (physical pages, how many of them
        are allocated again: a demotion) made. Separate pools answer each on its own; the two sides
        of an arena compete for its free frames."""
        if self.arena is not None:
            return self.arena.fits(
                logical, physical, freed_physical=freed_physical, freed_logical=freed_logical, moves=moves
            )
        moved = sum(len(list(pages)) - keep for pages, keep in moves)
        return (
            self.logical.num_free_pages + len(list(freed_logical)) >= logical
            and self.physical.num_free_pages + len(list(freed_physical)) + moved >= physical
        )

    def can_alloc_prefill(self, row: int, num_tokens: int) -> bool:
        pages = -(-num_tokens // self.page_size)
        if num_tokens > self.max_len:
            return False
        return self.fits(self.req_to_token.pages_needed(row, num_tokens), pages)

    def alloc_prefill(self, row: int, num_tokens: int, extra_pages: int = 0) -> PrefillAllocation:
        """Logical locations and physical slots for the prompt of an empty ``row``, bound 1:1, plus
        ``extra_pages`` physical pages after them (held for the device buffer the row gets later).

        Mutates both allocators, ``req_to_token`` and ``logical_to_physical``; raises
        ``OutOfMemory`` and changes nothing when either level is short. The slots stay valid until
        ``alloc_device_buffer`` or ``free_physical`` takes them back.
        """
        if self.req_to_token.covered_len(row):
            raise ValueError(f"request row {row} already holds locations")
        pages = -(-num_tokens // self.page_size)
        if not self.fits(self.req_to_token.pages_needed(row, num_tokens), pages + extra_pages):
            raise OutOfMemory(self.physical.name, pages + extra_pages, self.physical.num_free_pages)
        logical_pages = self.req_to_token.cover(row, num_tokens)
        physical_pages = self.physical.allocate(pages + extra_pages, row)
        locs = page_slots(logical_pages, self.page_size)[:num_tokens]
        slots = page_slots(physical_pages[:pages], self.page_size)[:num_tokens]
        self.logical_to_physical[locs] = slots
        return PrefillAllocation(logical_pages, physical_pages, locs, slots)

    def alloc_device_buffer(
        self, owner: int, prefill_pages: list[int], prefill_locs: torch.Tensor, need_tokens: int
    ) -> list[int]:
        """The device buffer of a request leaving staging: reuse its prefill slots.

        Keeps the first ``need_tokens / P`` prefill pages (so buffer column c holds position c),
        allocates the shortfall, frees the surplus, and zeroes the mapping of every prefill location:
        from now on decode reads through the buffer. Raises ``OutOfMemory`` (nothing changed) if the
        shortfall cannot be allocated. Returns the buffer's pages in column order.
        """
        if need_tokens % self.page_size:
            raise ValueError(f"device buffer size {need_tokens} is not a multiple of {self.page_size}")
        need = need_tokens // self.page_size
        self.physical.check_owned(prefill_pages, owner)
        keep, surplus = prefill_pages[:need], prefill_pages[need:]
        extra = self.physical.allocate(need - len(keep), owner) if need > len(keep) else []
        self.physical.free(surplus, owner)
        self.logical_to_physical[prefill_locs] = 0
        return keep + extra

    def can_extend(self, row: int, length: int) -> bool:
        return self.req_to_token.can_cover(row, length)

    def extend(self, row: int, length: int) -> list[int]:
        """Logical-only locations for positions ``[0, length)`` of ``row`` (decode and verify).

        Their mapping stays 0 until bound. Raises ``OutOfMemory`` (nothing changed) when short.
        """
        return self.req_to_token.cover(row, length)

    def alloc_physical(self, owner: int, num_pages: int) -> list[int]:
        """Physical pages for a growing device buffer."""
        return self.physical.allocate(num_pages, owner)

    # --- mapping --------------------------------------------------------------------------------

    def bind(self, locs: torch.Tensor, slots: torch.Tensor) -> None:
        """Point ``locs`` at ``slots`` (both owned by the same request; checked by check_integrity)."""
        self.logical_to_physical[locs] = slots

    def clear(self, locs: torch.Tensor) -> None:
        """Forget the device copies of ``locs`` (mapping 0)."""
        self.logical_to_physical[locs] = 0

    def lookup(self, locs: torch.Tensor) -> torch.Tensor:
        return self.logical_to_physical[locs]

    # --- freeing --------------------------------------------------------------------------------

    def release_locations(self, row: int, *, handed: int = 0) -> None:
        """Clear the mapping of every location of ``row``, then free them (free locations map to 0);
        its shared pages, and its first ``handed`` own pages (just handed to the prefix cache), are
        not freed."""
        pages = self.req_to_token.release(row, handed=handed)  # validates ownership before any change
        if pages:
            self.logical_to_physical[page_slots(pages, self.page_size)] = 0

    def free_physical(self, owner: int, pages: list[int]) -> None:
        """Free device pages; the caller has cleared every mapping that pointed into them."""
        self.physical.free(pages, owner)

    # --- transactions ---------------------------------------------------------------------------

    def snapshot(self) -> HiSparseSnapshot:
        table = self.req_to_token
        return HiSparseSnapshot(
            self.arena.snapshot() if self.arena is not None else self.logical.snapshot(),
            None if self.arena is not None else self.physical.snapshot(),
            self.logical_to_physical.clone(),
            table.table.clone(),
            tuple(tuple(table.pages(r)) for r in range(self.num_rows)),
        )

    def restore(self, snap: HiSparseSnapshot) -> None:
        """Undo everything since ``snap``: both allocators, the token table and the map."""
        if self.arena is not None:
            self.arena.restore(snap.logical)
        else:
            self.logical.restore(snap.logical)
            self.physical.restore(snap.physical)
        self.logical_to_physical.copy_(snap.mapping)
        self.req_to_token.restore(snap.table, snap.table_pages)

    # --- checks ---------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Invariants I1 and I2 (docs/invariants.md) for both levels and the map between them, and
        I15 for an arena."""
        if self.arena is not None:
            self.arena.check_integrity()
        else:
            self.logical.check_integrity()
            self.physical.check_integrity()
        self.req_to_token.check_integrity()
        mapping = self.logical_to_physical
        p = self.page_size
        assert int(mapping[-1]) == -1, "logical_to_physical[-1] must stay -1"
        body = mapping[:-1]
        assert bool((body >= 0).all()), "logical_to_physical holds a negative slot"
        assert bool((body < self.physical_rows).all()), "logical_to_physical points past the device pool"
        bound = torch.nonzero(body).reshape(-1)
        if bound.numel() == 0:
            return
        loc_owner = self.logical.owner_tensor()[bound // p]
        slot_owner = self.physical.owner_tensor()[body[bound] // p]
        assert bool((loc_owner >= 0).all()), "a free or reserved logical location maps to a device slot"
        bad = torch.nonzero(loc_owner != slot_owner).reshape(-1)
        assert bad.numel() == 0, (
            f"location {int(bound[bad[0]])} (request {int(loc_owner[bad[0]])}) maps to slot "
            f"{int(body[bound[bad[0]]])} owned by {int(slot_owner[bad[0]])}"
        )
