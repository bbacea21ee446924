"""Dynamic residency (``HiSparseConfig.residency="dynamic"``): which decoding rows keep their whole
context on the device (``Layout.FULL``) and which decode through the hot buffer (``Layout.HOT``), and
the moves between the two, at step boundaries only.

A FULL row's device pages are in position order: position ``p`` sits at slot
``pages[p // P] * P + p % P`` and its logical location maps there (``logical_to_physical``), so
decode and verify read their top-k through the map, as a prefill chunk reads its own positions. Its
committed tokens are backed up to host all the same (the backup rule), ``BACKUP_PAGES`` pages at a
time: its device rows stay until it is demoted, so a decode step backs up its positions only once
that many pages have filled since its last backup, and the rest (fewer filled pages, and the newest
partial page) are copied by the demotion, or before a release hands its pages to the prefix cache. A
demotion copies nothing from host::

    FULL row           | positions [0, HOT) | ... | newest | ...       (its pages, wherever they lie)
    after demotion     | identity hot columns     | newest + draft zone (the buffer's pages: the
                                                                        physical side's highest)

* **Demotion** (FULL -> HOT, ``demote``): backs up the positions past its last backup
  (``flush_backup``) and waits for the row's backups (its host copy is complete before any device
  row is dropped), clears the row's map, frees its pages and takes the buffer's pages back, the
  physical side's highest free pages (``ArenaSide.allocate``: out of the frames the indexer keys
  use, where it can); the rows of positions ``[0, HOT)`` (identity hot columns) and the newest
  token (the newest column, so that it is never evicted, as in every long HOT row) move there
  through one device copy. A buffer left in place would hold frames low in the arena that the keys
  of every HOT row need at high load. A row no longer than HOT keeps as many pages as its buffer
  needs (identity columns), so only longer rows free anything.
* **Promotion** (HOT -> FULL, ``promote``): the buffer freed (the host copy is complete), then pages
  for the whole context plus the growth room (the buffer's own among them when the pool is short),
  every committed position copied from host into them and mapped.

The physical pool (KV rows) and the logical pool (indexer keys) are the two sides of one device
arena (``pipeline/memory/arena.py``): the frames FULL rows do not use hold the keys HOT rows need,
and the other way round, so "fits" below always means both sides together
(``HiSparseAllocator.fits``).

The rules:

* admission: FULL when the arena can give pages for the prompt plus ``GROWTH_PAGES`` (its first
  decode steps without a new page) beside its locations; otherwise HOT, and when even a HOT
  admission does not fit, cached pages nobody shares are evicted, then decoding FULL rows are
  demoted, the largest context first, until it does;
* growth: a row that cannot grow for want of device pages (rows or keys) demotes decoding FULL
  rows, the largest context first (the row itself included), until it can (``relieve``);
* promotion (``rebalance``, once per command that changed memory): at most one row per call, the
  smallest context first, only when the arena, its buffer's pages counted as given back, holds its
  pages and, beside them, every request's growth to its final length (``reserved``: the prompt,
  ``max_new_tokens`` and a round's drafts, ``admit``'s hint) and the headroom, so that growth does
  not demote again what was just promoted (admission, by contrast, is optimistic: a request that
  stops early never needed its reserve) (``headroom_pages``: an eighth of the pool,
  and at least what a HOT admission of one prefill chunk holds, but never more than a quarter of the
  pool: with whole prompts as chunks one admission can be the whole pool, and nothing would ever be
  promoted), and never a row demoted less than ``PROMOTE_AFTER`` decode steps ago (hysteresis;
  ``step`` counts the decode and verify forwards).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
import structlog
import torch

from kernels.kv_copy import copy_rows
from pipeline.memory import OutOfMemory, page_slots
from pipeline.memory.interface import Layout, Residency, ResidencyChange
from pipeline.memory.step_inputs import to_device

log = structlog.get_logger(__name__)

GROWTH_PAGES = 1  # device pages a FULL row holds past its prompt (admission, promotion)
PROMOTE_AFTER = 16  # decode steps a demoted row waits before it may be promoted
# a FULL row's filled pages are backed up once this many wait (one copy for them all: a backup's
# cost is mostly its own, not its rows'); the rest go with a demotion or a release to the cache
BACKUP_PAGES = 4
HEADROOM_FRACTION = 8  # promotion leaves at least 1/8 of the physical pool free
HEADROOM_CAP = 4  # and need not leave more than 1/4 of it


class LayoutTables(Protocol):
    """What the layout moves use of the coordinator (its tables, pools and rows)."""

    plan: Any  # MemoryPlan
    num_layers: int
    buffers: Any  # DeviceBuffers
    alloc: Any  # HiSparseAllocator
    host: Any  # HostPool
    counters: Any  # LayerCounters
    device: torch.device
    device_kv: torch.Tensor
    _mem: dict[int, Any]  # row -> RowMemory
    _full: set[int]  # the FULL rows
    _lost: set[int]
    _backup_failures: dict[int, str]
    _leaving: set[int]

    @property
    def hot(self) -> int: ...

    @property
    def req_to_token(self) -> torch.Tensor: ...

    def settle_backups(self, upto: int | None = None) -> None: ...

    def flush_backup(self, row: int) -> None: ...

    def set_full(self, row: int, pages: list[int] | None) -> None: ...

    def shared_len(self, row: int) -> int: ...


def full_slots(pages: list[int], page_size: int, start: int, end: int) -> torch.Tensor:
    """``[end - start]`` int64 device slots of positions ``[start, end)`` of a FULL row."""
    first = start // page_size  # (only the pages the positions fall in)
    base = first * page_size
    return page_slots(pages[first : pages_for(end, page_size)], page_size)[start - base : end - base]


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@attrs.define(eq=False)
class DynamicResidency:
    """The layout rules and moves over one coordinator (which delegates its residency verbs here)."""

    coord: LayoutTables
    mode: str = "always"  # ``HiSparseConfig.residency``
    tick: int = 0  # decode steps so far (``step``)
    demotions: int = 0
    promotions: int = 0
    demoted_bytes: int = 0
    promoted_bytes: int = 0
    _changes: list[ResidencyChange] = attrs.Factory(list)  # not yet taken
    # ``page_table``'s last answer, kept while no FULL row's pages change (``set_full`` forgets it)
    _table: torch.Tensor | None = None
    _headroom: int | None = None  # ``headroom_pages``, once found

    @property
    def dynamic(self) -> bool:
        return self.mode == "dynamic"

    def full_pages(self, num_tokens: int) -> int:
        """Device pages a FULL row of ``num_tokens`` positions holds (its growth room included)."""
        return pages_for(num_tokens, self.coord.plan.page_size) + GROWTH_PAGES

    def page_bytes(self) -> int:
        """Device bytes of one page of MLA rows, all layers."""
        c = self.coord
        return c.plan.page_size * c.num_layers * c.device_kv.shape[-1] * c.device_kv.element_size()

    def step(self) -> None:
        """A decode step (a decode or verify forward's tokens committed): the hysteresis's clock."""
        self.tick += 1

    # --- demotion -------------------------------------------------------------------------------

    def _buffer_pages(self, row: int) -> int:
        """Pages of the buffer ``row`` decodes through once demoted (room for every position it
        has locations for: what it reserved stays reserved)."""
        c = self.coord
        mem = c._mem[row]
        covered = max(c.alloc.req_to_token.covered_len(row), mem.length)
        return c.buffers.capacity_for(covered, speculative=mem.speculative) // c.plan.page_size

    def candidates(self) -> list[tuple[int, int]]:
        """(row, pages its demotion frees) of every decoding FULL row whose demotion frees pages,
        the largest context first (ties: the lower row)."""
        c = self.coord
        found = []
        for row, mem in c._mem.items():
            if mem.layout is not Layout.FULL or mem.residency is not Residency.RESIDENT:
                continue
            if row in c._lost or row in c._leaving:
                continue
            freed = len(mem.full_pages) - self._buffer_pages(row)
            if freed > 0:
                found.append((row, freed))
        found.sort(key=lambda rf: (-c._mem[rf[0]].length, rf[0]))
        return found

    def reserved(self, exclude: int | None = None) -> tuple[int, int]:
        """(logical, physical) pages the live requests still need to grow to their final lengths
        (``admit``'s hint; rows without one count nothing): every row's locations, and a FULL row's
        device pages. A FULL admission or a promotion leaves room for them, so that growth does not
        demote what it just made FULL."""
        c = self.coord
        page = c.plan.page_size
        logical = physical = 0
        for row, mem in c._mem.items():
            if row == exclude or not mem.final or row in c._leaving:
                continue
            need = pages_for(mem.final, page)
            logical += max(0, need - c.alloc.req_to_token.covered_len(row) // page)
            if mem.layout is Layout.FULL:
                physical += max(0, need - len(mem.full_pages))
        return logical, physical

    def demotion_moves(self) -> list[tuple[list[int], int]]:
        """Each candidate's (device pages, how many its buffer keeps), in the order ``relieve``
        demotes them: what ``HiSparseAllocator.fits`` needs to foresee the arena after every
        demotion (``demote`` frees a row's pages and takes its buffer's back, the highest first)."""
        c = self.coord
        return [(c._mem[row].full_pages, self._kept_pages(row)) for row, _ in self.candidates()]

    def _kept_pages(self, row: int) -> int:
        """Pages a FULL row keeps as its buffer when demoted (a short row's buffer grows later, as a
        HOT row's does)."""
        return min(self._buffer_pages(row), len(self.coord._mem[row].full_pages))

    def demotable_pages(self) -> int:
        """Device pages demoting every candidate would free."""
        return sum(freed for _, freed in self.candidates())

    def can_free(self, pages: int) -> bool:
        """Whether the free physical pages, with every demotion, reach ``pages``."""
        free = self.coord.alloc.physical.num_free_pages
        return free >= pages or (self.dynamic and free + self.demotable_pages() >= pages)

    def relieve(self, fits: Callable[[], bool]) -> bool:
        """Demote candidates, the largest context first, until ``fits()``; returns ``fits()``."""
        if not self.dynamic:
            return fits()
        while not fits():
            found = self.candidates()
            if not found:
                return False
            self.demote(found[0][0])
        return True

    def demote(self, row: int) -> int:
        """FULL -> HOT for a decoding row (module docstring); returns the device bytes freed."""
        c = self.coord
        mem = c._mem[row]
        assert mem.layout is Layout.FULL and mem.residency is Residency.RESIDENT, (row, mem.layout)
        c.flush_backup(row)  # the positions since its last backup (a few pages at most)
        c.settle_backups(mem.backup)  # the host copy is complete before any device row is dropped
        assert bool((c.host.req_to_host[row, : mem.length] >= 0).all()), f"row {row}: host copy incomplete"
        page = c.plan.page_size
        pages = mem.full_pages
        keep_n = self._kept_pages(row)
        newest = mem.length - 1
        # what the buffer keeps: positions [0, HOT) in their identity columns, and a long row's newest
        # token in the newest column
        kept = min(mem.length, c.hot)
        src = full_slots(pages, page, 0, kept)
        if mem.length > c.hot:
            src = torch.cat([src, full_slots(pages, page, newest, newest + 1)])
        c.alloc.clear(c.req_to_token[row, : c.alloc.req_to_token.covered_len(row)])
        c.set_full(row, None)
        # The buffer's pages are the physical side's highest free pages once the row's are free (its
        # own, mostly): a buffer left where the row's first pages happened to lie would pin frames
        # the keys of every HOT row need. Their rows move through a copy (advanced indexing makes
        # one), so that a page that is both a source and a destination is read before it is written.
        rows = c.device_kv[:, src.to(c.device)]
        c.alloc.free_physical(row, pages)
        keep = c.alloc.alloc_physical(row, keep_n)
        dst = page_slots(keep, page)[:kept]
        if mem.length > c.hot:
            dst = torch.cat([dst, torch.tensor([keep[c.hot // page] * page], dtype=torch.int64)])
        if not torch.equal(src, dst):
            c.device_kv[:, dst.to(c.device)] = rows
        c.buffers.assign(row, keep)
        if mem.length > c.hot:
            c.buffers.tokens[:, row, c.buffers.newest] = newest
            c.buffers.record_newest([row], [newest])
        mem.demoted_at = self.tick
        freed = (len(pages) - keep_n) * self.page_bytes()
        self.demotions += 1
        self.demoted_bytes += freed
        self._changes.append(ResidencyChange(row, "demoted", freed))
        return freed

    # --- promotion ------------------------------------------------------------------------------

    def headroom_pages(self) -> int:
        """Free physical pages a promotion must leave (module docstring); the same all the engine's
        life (found once)."""
        if self._headroom is None:
            self._headroom = self._find_headroom()
        return self._headroom

    def _find_headroom(self) -> int:
        c = self.coord
        page = c.plan.page_size
        chunk = c.plan.prefill_chunk or c.plan.max_request_len
        one_admission = c.buffers.columns // page + c.plan.chunk_area(chunk) // page
        pool = c.alloc.physical.capacity_pages
        return max(pool // HEADROOM_FRACTION, min(one_admission, pool // HEADROOM_CAP))

    def promote(self, row: int) -> int:
        """HOT -> FULL for a decoding row (module docstring); returns the bytes copied host ->
        device. Raises ``OutOfMemory`` (nothing changed) when the pool cannot give the pages."""
        c = self.coord
        mem = c._mem[row]
        assert mem.layout is Layout.HOT and mem.residency is Residency.RESIDENT, (row, mem.layout)
        page = c.plan.page_size
        covered = c.alloc.req_to_token.covered_len(row)
        need = self.promotion_pages(row)
        held = len(c.buffers.pages(row))
        if not c.alloc.fits(0, need, freed_physical=c.buffers.pages(row)):
            raise OutOfMemory("promotion", need, c.alloc.physical.num_free_pages + held)
        c.settle_backups(mem.backup)  # the newest column's backup reads the buffer about to go
        c.alloc.clear(c.req_to_token[row, :covered])  # (the mapped ones are the buffer's columns)
        old = c.buffers.reset(row)
        if old:  # the host copy is complete: the buffer's rows are not needed, its pages may return
            c.alloc.free_physical(row, old)
        pages = c.alloc.alloc_physical(row, need)
        slots = full_slots(pages, page, 0, mem.length)
        try:
            copy_rows(c.device_kv, slots.to(c.device), c.host.kv, c.host.req_to_host[row, : mem.length],
                      validate=False)  # every layer
        except Exception as exc:  # its rows did not reach the device: this request fails, no other
            why = f"promotion copy failed: {type(exc).__name__}: {exc}"
            log.error("hisparse.promotion_failed", row=row, error=why)
            c._lost.add(row)  # (reported with the backup failures: its next step fails it)
            c._backup_failures[row] = why
        own = c.shared_len(row)  # (a shared prefix's locations map to no slot)
        c.alloc.bind(c.req_to_token[row, own : mem.length], slots[own:])
        c.set_full(row, pages)  # (a failed row too: its tables account for every page it holds)
        mem.backed = mem.length  # (a HOT row is backed up whole)
        if row in c._lost:
            return 0
        copied = mem.length * c.host.row_bytes * c.num_layers
        self.promotions += 1
        self.promoted_bytes += copied
        self._changes.append(ResidencyChange(row, "promoted", copied))
        return copied

    def promotion_pages(self, row: int) -> int:
        """Device pages ``row`` holds once promoted (its context, the growth room, and every
        position it has a location for)."""
        c = self.coord
        covered = c.alloc.req_to_token.covered_len(row)
        return max(self.full_pages(c._mem[row].length), pages_for(covered, c.plan.page_size))

    def rebalance(self) -> None:
        """One step boundary: promote the smallest demoted row when the rules allow (module
        docstring)."""
        c = self.coord
        if not self.dynamic or len(c._full) == len(c._mem):  # (every row FULL: none to promote)
            return
        waiting = [
            row
            for row, mem in c._mem.items()
            if mem.layout is Layout.HOT
            and mem.residency is Residency.RESIDENT
            and row not in c._lost
            and row not in c._leaving
            and (mem.demoted_at is None or self.tick - mem.demoted_at >= PROMOTE_AFTER)
        ]
        if not waiting:
            return
        row = min(waiting, key=lambda r: (c._mem[r].length, r))
        if c.alloc.arena is None:
            free = c.alloc.physical.num_free_pages + len(c.buffers.pages(row))  # its buffer given back
            if free - self.promotion_pages(row) >= self.headroom_pages():
                self.promote(row)
            return
        # the arena: its pages and its growth to its final length, every other request's growth,
        # and the headroom, its buffer given back (the free frames count for either side)
        page, final = c.plan.page_size, c._mem[row].final
        need = max(self.promotion_pages(row), pages_for(final, page)) + self.headroom_pages()
        buffer = c.buffers.pages(row)
        if c.alloc.physical.num_free_pages + len(buffer) < need:  # short before the keys count (cheap)
            return
        grow_l, grow_p = self.reserved(exclude=row)
        own_l = max(0, pages_for(final, page) - c.alloc.req_to_token.covered_len(row) // page)
        if c.alloc.fits(grow_l + own_l, need + grow_p, freed_physical=buffer):
            self.promote(row)

    # --- tables and checks ----------------------------------------------------------------------

    def forget_table(self) -> None:
        self._table = None

    def page_table(self, rows: list[int]) -> torch.Tensor:
        """``[all rows, pages]`` int64: the pages of ``rows`` (FULL) in position order, -1 elsewhere
        (the same tensor until a FULL row's pages change)."""
        if self._table is None:
            self._table = self._build_table(rows)
        return self._table

    def _build_table(self, rows: list[int]) -> torch.Tensor:
        c = self.coord
        width = max((len(c._mem[row].full_pages) for row in rows), default=1)
        table = torch.full((c.plan.max_running_requests, width), -1, dtype=torch.int64)
        for row in rows:
            pages = c._mem[row].full_pages
            table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
        return to_device(c.device, table.reshape(-1))[0].view(table.shape)  # (no CPU wait on CUDA)

    def check_full(self, row: int, *, data: bool) -> None:
        """Invariant I14 for a FULL row: no buffer, no chunk rows, every committed position of its own
        mapped to its slot (a slot of its pages, so none aliased); decoding, every position up to
        ``backed`` has a host copy equal to its device row (``data``), and fewer than ``BACKUP_PAGES``
        filled pages wait past it."""
        c = self.coord
        mem = c._mem[row]
        assert self.dynamic, f"row {row}: FULL outside dynamic residency"
        assert not mem.chunk_pages and not c.buffers.pages(row), f"row {row}: FULL with a buffer"
        assert len(mem.full_pages) * c.plan.page_size >= mem.length, f"row {row}: positions without pages"
        slots = full_slots(mem.full_pages, c.plan.page_size, 0, mem.length)
        own = c.shared_len(row)
        mapped = c.alloc.lookup(c.req_to_token[row, own : mem.length])
        assert torch.equal(mapped, slots[own:]), f"row {row}: a committed position is not mapped to its slot"
        if mem.residency is not Residency.RESIDENT:
            return
        page = c.plan.page_size
        assert mem.length // page * page - BACKUP_PAGES * page < mem.backed <= mem.length, (
            f"row {row}: {mem.backed} of {mem.length} positions backed up, {BACKUP_PAGES} filled pages not"
        )
        copies = c.host.req_to_host[row, : mem.length]
        assert bool((copies[: mem.backed] >= 0).all()), f"row {row}: a backed-up position has no host copy"
        assert bool((copies[mem.backed :] < 0).all()), f"row {row}: a host copy past the backed-up positions"
        if data and row not in c._lost and mem.backed:
            c.settle_backups()
            for layer in range(c.num_layers):
                dev = c.device_kv[layer, slots[: mem.backed].to(c.device)].cpu()
                assert torch.equal(dev, c.host.kv[layer, copies[: mem.backed]]), (
                    f"row {row} layer {layer}: a device row differs from its host copy"
                )

    # --- reports --------------------------------------------------------------------------------

    def take_changes(self) -> list[ResidencyChange]:
        changes, self._changes = self._changes, []
        return [ch for ch in changes if ch.row in self.coord._mem]

    def stats(self) -> dict[str, object]:
        c = self.coord
        decoding = [m for r, m in c._mem.items() if m.residency is Residency.RESIDENT and r not in c._leaving]
        return {
            "mode": self.mode,
            "resident": sum(m.layout is Layout.FULL for m in decoding),
            "demoted": sum(m.layout is Layout.HOT for m in decoding),
            "demotions": self.demotions,
            "promotions": self.promotions,
            "demoted_bytes": self.demoted_bytes,
            "promoted_bytes": self.promoted_bytes,
        }
