"""Page allocators and paged per-request tables.

A ``PagedAllocator`` hands out whole pages of ``page_size`` consecutive slots and remembers the owner
of every page (a request row), so that a double free or a free of someone else's page is caught
before anything changes. A ``PagedTable`` maps (request row, position) to a slot through the pages a
row owns: position p lives at ``pages[p // P] * P + p % P``.

Location 0 of page 0 doubles as the "nothing here" value in the HiSparse map, so allocators that need
it keep page 0 reserved: it is never handed out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import torch

from pipeline.memory.step_inputs import to_device

FREE = -1  # owner of a free page
RESERVED = -2  # owner of the reserved page 0


class PoolError(Exception):
    """Base of the page pools' errors."""


class OutOfMemory(PoolError):
    """An allocation asked for more than the pool has free; nothing was allocated."""

    def __init__(self, pool: str, requested: int, free: int) -> None:
        self.pool = pool
        self.requested = requested
        self.free = free
        super().__init__(f"{pool}: asked for {requested} pages, {free} free")


class OwnershipError(PoolError):
    """A free named a page that is free, reserved, out of range or owned by another request."""

    def __init__(self, pool: str, page: int, owner: int, actual: int) -> None:
        self.pool = pool
        self.page = page
        self.owner = owner
        self.actual = actual
        what = {FREE: "already free", RESERVED: "reserved"}.get(actual, f"owned by request {actual}")
        super().__init__(f"{pool}: request {owner} cannot free page {page}: it is {what}")


@attrs.frozen
class AllocatorSnapshot:
    free: tuple[int, ...]
    owner: tuple[int, ...]


@attrs.define(eq=False)
class PagedAllocator:
    """Whole pages of ``page_size`` slots, each owned by at most one request row.

    Invariants: every page is in exactly one of {free list, owned by one row, reserved}; the free
    list has no duplicates; ``_owned[row]`` is exactly the set of pages whose owner is ``row``.
    """

    name: str
    num_pages: int  # pages in the pool, the reserved one included
    page_size: int
    reserve_first_page: bool = False
    _free: list[int] = attrs.field(init=False)  # a stack: the next page handed out is the last
    _owner: list[int] = attrs.field(init=False)
    _owned: dict[int, set[int]] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        first = 1 if self.reserve_first_page else 0
        if self.num_pages <= first:
            raise ValueError(f"{self.name}: needs more than {first} pages, got {self.num_pages}")
        self._free = list(range(self.num_pages - 1, first - 1, -1))  # page `first` is handed out first
        self._owner = [FREE] * self.num_pages
        if self.reserve_first_page:
            self._owner[0] = RESERVED

    @property
    def capacity_pages(self) -> int:
        """Pages that can ever be handed out."""
        return self.num_pages - (1 if self.reserve_first_page else 0)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def can_allocate(self, num_pages: int) -> bool:
        return 0 <= num_pages <= len(self._free)

    def allocate(self, num_pages: int, owner: int) -> list[int]:
        """Hand ``num_pages`` pages to ``owner``; raises ``OutOfMemory`` and changes nothing if short."""
        if owner < 0:
            raise ValueError(f"{self.name}: owner must be a request row >= 0, got {owner}")
        if not self.can_allocate(num_pages):
            raise OutOfMemory(self.name, num_pages, len(self._free))
        pages = [self._free.pop() for _ in range(num_pages)]
        mine = self._owned.setdefault(owner, set())
        for page in pages:
            self._owner[page] = owner
            mine.add(page)
        return pages

    def check_owned(self, pages: Iterable[int], owner: int) -> None:
        """Raise ``OwnershipError`` unless every page is distinct and owned by ``owner``."""
        seen: set[int] = set()
        for page in pages:
            actual = self._owner[page] if 0 <= page < self.num_pages else RESERVED
            if actual != owner or page in seen:
                raise OwnershipError(self.name, page, owner, FREE if page in seen else actual)
            seen.add(page)

    def free(self, pages: Iterable[int], owner: int) -> None:
        """Return ``owner``'s pages; raises ``OwnershipError`` and changes nothing on any bad page."""
        pages = list(pages)
        self.check_owned(pages, owner)
        mine = self._owned.get(owner, set())
        for page in pages:
            self._owner[page] = FREE
            mine.discard(page)
            self._free.append(page)
        if not mine:
            self._owned.pop(owner, None)

    def take(self, pages: Iterable[int], owner: int) -> None:
        """Hand ``owner`` these free pages: undoes a ``free`` (a transaction that freed pages in one
        pool and then failed in another puts them back). Raises ``OwnershipError`` and changes
        nothing unless every page is free."""
        pages = list(pages)
        if owner < 0:
            raise ValueError(f"{self.name}: owner must be >= 0, got {owner}")
        for page in pages:
            actual = self._owner[page] if 0 <= page < self.num_pages else RESERVED
            if actual != FREE or pages.count(page) > 1:
                raise OwnershipError(self.name, page, owner, actual)
        taken = set(pages)
        self._free = [page for page in self._free if page not in taken]
        mine = self._owned.setdefault(owner, set())
        for page in pages:
            self._owner[page] = owner
            mine.add(page)
        if not mine:
            self._owned.pop(owner, None)

    def transfer(self, pages: Iterable[int], owner: int, new_owner: int) -> None:
        """Hand ``owner``'s pages to ``new_owner`` (the prefix cache takes a finished request's pages,
        and gives them back to the free list on eviction); raises ``OwnershipError`` (nothing
        changed) on any page ``owner`` does not own."""
        pages = list(pages)
        if new_owner < 0:
            raise ValueError(f"{self.name}: owner must be >= 0, got {new_owner}")
        self.check_owned(pages, owner)
        mine, theirs = self._owned.get(owner, set()), self._owned.setdefault(new_owner, set())
        for page in pages:
            self._owner[page] = new_owner
            mine.discard(page)
            theirs.add(page)
        if not mine:
            self._owned.pop(owner, None)
        if not theirs:
            self._owned.pop(new_owner, None)

    def owner_of(self, page: int) -> int:
        return self._owner[page]

    def pages_of(self, owner: int) -> frozenset[int]:
        return frozenset(self._owned.get(owner, ()))

    def owners(self) -> list[int]:
        return sorted(self._owned)

    def owner_tensor(self) -> torch.Tensor:
        """``[num_pages]`` int64 owner of each page (FREE / RESERVED / request row)."""
        return torch.tensor(self._owner, dtype=torch.int64)

    def snapshot(self) -> AllocatorSnapshot:
        return AllocatorSnapshot(free=tuple(self._free), owner=tuple(self._owner))

    def restore(self, snap: AllocatorSnapshot) -> None:
        """Put the allocator back exactly as it was when ``snap`` was taken."""
        self._free = list(snap.free)
        self._owner = list(snap.owner)
        self._owned = {}
        for page, owner in enumerate(self._owner):
            if owner >= 0:
                self._owned.setdefault(owner, set()).add(page)

    def check_integrity(self) -> None:
        """Conservation and disjointness of the pages (invariant I1, docs/invariants.md)."""
        name = self.name
        assert len(set(self._free)) == len(self._free), f"{name}: duplicate pages in the free list"
        for page in self._free:
            assert self._owner[page] == FREE, f"{name}: free-listed page {page} has owner {self._owner[page]}"
        num_free_owner = sum(1 for o in self._owner if o == FREE)
        assert num_free_owner == len(self._free), f"{name}: a page marked free is missing from the free list"
        if self.reserve_first_page:
            assert self._owner[0] == RESERVED, f"{name}: page 0 must stay reserved"
            assert 0 not in self._free, f"{name}: page 0 is in the free list"
        owned = 0
        for owner, pages in self._owned.items():
            assert pages, f"{name}: empty ownership record for {owner}"
            for page in pages:
                assert self._owner[page] == owner, f"{name}: page {page} listed for {owner}"
            owned += len(pages)
        total = len(self._free) + owned + (1 if self.reserve_first_page else 0)
        assert total == self.num_pages, f"{name}: {total} pages accounted for, {self.num_pages} exist"


def page_slots(pages: Iterable[int], page_size: int) -> torch.Tensor:
    """``[len(pages) * page_size]`` int64: every slot of ``pages``, in order."""
    base = torch.tensor(list(pages), dtype=torch.int64)
    return (base[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def page_slot(pages: Sequence[int], page_size: int, index: int) -> int:
    """The slot of entry ``index`` of ``pages`` laid end to end (``page_slots(pages)[index]``, as a
    number: a step's few slots found without a tensor)."""
    return pages[index // page_size] * page_size + index % page_size


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@attrs.define(eq=False)
class TableMirror:
    """A copy of a ``PagedTable``'s table where the kernels read it (the compute device).

    The table changes row by row (a row covers more pages, records positions, is released), and so
    does the mirror: the owner applies each change to both, so no step copies the whole table. On a
    CPU the mirror is the table itself unless ``separate`` (tests: a distinct tensor shows a missed
    update).
    """

    host: torch.Tensor  # the table of record
    device: torch.device
    separate: bool = False
    tensor: torch.Tensor = attrs.field(init=False)  # what the kernels read

    def __attrs_post_init__(self) -> None:
        self.refresh()

    @property
    def shared(self) -> bool:
        """True when the mirror is the table itself (nothing to update)."""
        return self.tensor is self.host

    def refresh(self) -> None:
        """Rebuild the whole mirror from the table (at creation and after a restore)."""
        if self.device.type == "cpu" and not self.separate:
            self.tensor = self.host
        else:
            self.tensor = self.host.to(self.device, copy=True)

    def write(self, row: int, index: slice | torch.Tensor, values: torch.Tensor) -> None:
        """Entries ``index`` of ``row`` changed to ``values`` (1-D); host indices and values go to the
        device in one asynchronous copy (``step_inputs.to_device``)."""
        if not self.shared:
            if isinstance(index, torch.Tensor):
                index, values = to_device(self.device, index, values.reshape(-1))
            else:
                (values,) = to_device(self.device, values.reshape(-1))
            self.tensor[row, index] = values.to(self.tensor.dtype)

    def write_many(self, rows: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Entries ``(rows[i], positions[i])`` of the table changed to ``values[i]``."""
        if not self.shared:
            rows, positions, values = to_device(self.device, rows, positions, values)
            self.tensor[rows, positions] = values.to(self.tensor.dtype)

    def fill_row(self, row: int, value: int) -> None:
        if not self.shared:
            self.tensor[row].fill_(value)


@attrs.define(eq=False)
class PagedTable:
    """(request row, position) -> slot, through pages of ``allocator`` owned by that row.

    ``table[row, pos]`` holds the slot, or ``empty`` where none is recorded. With ``fill_on_cover``
    every covered position is recorded at once (the token table); without it the owner records
    positions one by one with ``record`` (the host map: a slot means "a copy is there").
    """

    name: str
    allocator: PagedAllocator
    num_rows: int
    max_len: int  # positions per row
    empty: int  # value of an unrecorded position
    fill_on_cover: bool
    table: torch.Tensor = attrs.field(init=False)  # [num_rows, max_len] int64
    _pages: list[list[int]] = attrs.field(init=False)  # per row, in position order
    # per row: how many of its first pages it shares (owned by the prefix cache, not by the row)
    _shared: list[int] = attrs.field(init=False)
    mirror: TableMirror | None = attrs.field(init=False, default=None)  # kept equal to ``table``

    def __attrs_post_init__(self) -> None:
        self.table = torch.full((self.num_rows, self.max_len), self.empty, dtype=torch.int64)
        self._pages = [[] for _ in range(self.num_rows)]
        self._shared = [0] * self.num_rows

    def mirror_tensor(self) -> torch.Tensor:
        """The table's device mirror as it is now (``mirror_on`` may replace it)."""
        assert self.mirror is not None
        return self.mirror.tensor

    def mirror_on(self, device: torch.device, *, separate: bool = False) -> TableMirror:
        """Keep a copy of the table on ``device`` from now on, updated with every change."""
        self.mirror = TableMirror(self.table, device, separate=separate)
        return self.mirror

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    def pages(self, row: int) -> list[int]:
        return list(self._pages[row])

    def handed_pages(self, row: int) -> int:
        """How many of ``row``'s own pages, from its first, another owner holds now (handed to the
        prefix cache with ``PagedAllocator.transfer``): what ``release`` must not free."""
        handed = 0
        for page in self._pages[row][self._shared[row] :]:
            if self.allocator.owner_of(page) == row:
                break
            handed += 1
        return handed

    def share(self, row: int, pages: list[int]) -> None:
        """Give an empty row ``pages`` (owned by someone else: the prefix cache) as its first pages,
        every position of them recorded; ``cover`` adds the row's own pages after them."""
        if self._pages[row]:
            raise ValueError(f"{self.name}: row {row} already holds pages")
        if not pages:
            return
        self._pages[row] = list(pages)
        self._shared[row] = len(pages)
        slots = page_slots(pages, self.page_size)
        n = min(slots.numel(), self.max_len)
        self.table[row, :n] = slots[:n]
        if self.mirror is not None:
            self.mirror.write(row, slice(0, n), slots[:n])

    def covered_len(self, row: int) -> int:
        """Positions of ``row`` that have a slot."""
        return len(self._pages[row]) * self.page_size

    def pages_needed(self, row: int, length: int) -> int:
        return max(0, round_up(length, self.page_size) // self.page_size - len(self._pages[row]))

    def can_cover(self, row: int, length: int) -> bool:
        return length <= self.max_len and self.allocator.can_allocate(self.pages_needed(row, length))

    def cover(self, row: int, length: int) -> list[int]:
        """Give positions ``[0, length)`` of ``row`` slots; returns the new pages (maybe none).

        Raises ``OutOfMemory`` (nothing changed) if the allocator is short, ``ValueError`` if
        ``length`` exceeds the row.
        """
        if length > self.max_len:
            raise ValueError(f"{self.name}: row {row} cannot hold {length} positions (max {self.max_len})")
        start = self.covered_len(row)
        new = self.allocator.allocate(self.pages_needed(row, length), owner=row)
        self._pages[row].extend(new)
        if self.fill_on_cover and new:
            slots = page_slots(new, self.page_size)
            end = min(start + slots.numel(), self.max_len)
            self.table[row, start:end] = slots[: end - start]
            if self.mirror is not None:
                self.mirror.write(row, slice(start, end), slots[: end - start])
        return new

    def slots(self, row: int, positions: torch.Tensor) -> torch.Tensor:
        """Slots of covered ``positions`` of ``row`` (computed from the pages, not the table)."""
        p, pages = self.page_size, self._pages[row]
        if positions.numel() <= 16:  # a decode step's few positions: plain Python is cheaper
            return torch.tensor(self._slot_list(row, positions.tolist()), dtype=torch.int64)
        table = torch.tensor(pages, dtype=torch.int64)
        return table[positions // p] * p + positions % p

    def slot(self, row: int, position: int) -> int:
        """The slot of covered ``position`` of ``row`` (a number, from the pages)."""
        return page_slot(self._pages[row], self.page_size, position)

    def _slot_list(self, row: int, positions) -> list[int]:
        """Slots of covered ``positions`` (ints) of ``row``, in plain Python."""
        p, pages = self.page_size, self._pages[row]
        return [pages[t // p] * p + t % p for t in positions]

    def record_runs(self, rows: list[int], starts: list[int], counts: list[int]) -> torch.Tensor:
        """``record`` of positions ``[start, start + count)`` of each row, all in one table write
        (a decode step's few new positions per request); returns the slots, row after row."""
        if len(rows) == 1:  # one row's run (one request stepping): a slice of its row
            row, start, count = rows[0], starts[0], counts[0]
            values = torch.tensor(self._slot_list(row, range(start, start + count)), dtype=torch.int64)
            self.table[row, start : start + count] = values
            if self.mirror is not None:
                self.mirror.write(row, slice(start, start + count), values)
            return values
        row_ids, positions, slots = [], [], []
        for row, start, count in zip(rows, starts, counts):
            if count == 1:  # a decode step's one position: no lists or ranges to build
                row_ids.append(row)
                positions.append(start)
                slots.append(self.slot(row, start))
                continue
            row_ids += [row] * count
            positions += range(start, start + count)
            slots += self._slot_list(row, range(start, start + count))
        table = torch.tensor([row_ids, positions, slots], dtype=torch.int64)  # (one tensor: cheaper)
        index, values = (table[0], table[1]), table[2]
        self.table[index] = values
        if self.mirror is not None:
            self.mirror.write_many(*index, values)
        return values

    def record(self, row: int, positions: torch.Tensor) -> torch.Tensor:
        """Record the slots of covered ``positions`` in the table; returns them."""
        slots = self.slots(row, positions)
        self.table[row, positions] = slots
        if self.mirror is not None:
            self.mirror.write(row, positions, slots)
        return slots

    def release(self, row: int, *, handed: int = 0) -> list[int]:
        """Free every page ``row`` owns and clear its table row; returns the freed pages. Its shared
        pages are not its own, and its first ``handed`` pages past them the caller has just handed
        to their new owner (``PagedAllocator.transfer``): neither is freed."""
        pages = self._pages[row][self._shared[row] + handed :]
        self.allocator.free(pages, owner=row)
        self._pages[row] = []
        self._shared[row] = 0
        self.table[row].fill_(self.empty)
        if self.mirror is not None:
            self.mirror.fill_row(row, self.empty)
        return pages

    def restore(self, table: torch.Tensor, pages: tuple[tuple[int, ...], ...]) -> None:
        """Put back a table and page lists saved earlier (the allocator is restored by its owner;
        no row shares pages in a transaction that is restored)."""
        self.table.copy_(table)
        self._pages = [list(row_pages) for row_pages in pages]
        self._shared = [0] * self.num_rows
        if self.mirror is not None:
            self.mirror.refresh()

    def check_integrity(self) -> None:
        """Each row's pages are owned by that row; recorded slots lie in the row's pages."""
        p = self.page_size
        for row, pages in enumerate(self._pages):
            owned = self.allocator.pages_of(row)
            # (pages handed to the prefix cache are listed until the release they belong to is done)
            others = self._shared[row] + self.handed_pages(row)
            mine = pages[others:]
            assert set(mine) == set(owned), f"{self.name}: row {row} pages {mine} vs owned {sorted(owned)}"
            for page in pages[:others]:
                assert self.allocator.owner_of(page) >= self.num_rows, (
                    f"{self.name}: row {row} shares page {page}, owned by {self.allocator.owner_of(page)}"
                )
            assert len(set(pages)) == len(pages), f"{self.name}: row {row} lists a page twice"
            recorded = self.table[row]
            mask = recorded != self.empty
            covered = len(pages) * p
            assert not bool(mask[covered:].any()), f"{self.name}: row {row} records beyond its pages"
            if bool(mask.any()):
                positions = torch.nonzero(mask).reshape(-1)
                expect = self.slots(row, positions)
                assert torch.equal(recorded[positions], expect), f"{self.name}: row {row} table disagrees"
            if self.fill_on_cover:
                assert bool(mask[: min(covered, self.max_len)].all()), f"{self.name}: row {row} has gaps"
