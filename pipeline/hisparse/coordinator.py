"""The HiSparse coordinator: where every request's KV lives, and the moves between the tiers.

It owns the device KV pool (MLA rows by physical slot), the indexer key pool (by logical location,
always on the device), the host pool, the per-request device buffers, and two transfer streams
(staging copies and decode backups). Its verbs, in the order a request meets them:

    admit -> (prefill_targets -> forward -> commit_prefill)+ -> start_staging -> collect_ready
          -> (prepare_decode -> forward -> commit_decode)* -> release

* ``admit``: a row, locations and host pages for the whole prompt, the device buffer, and the
  device rows of one prefill chunk.
* ``prefill_targets`` / ``commit_prefill``: a prompt is prefilled in chunks (one chunk when it is
  short). Positions below HOT go to their identity columns, later ones to the chunk rows; a finished
  chunk is copied to host, and the next chunk reads it through swap-in, as decode does.
* ``start_staging``: the last chunk goes to host asynchronously; the request waits in a FIFO queue.
* ``collect_ready``: pops requests whose copy landed, in FIFO order; each gives back its chunk rows
  and decodes through its buffer.
* ``prepare_decode`` / ``commit_decode``: where the next token's KV is written (its identity column
  while short, the newest column once long), and the backup of every committed token to host (a
  FULL row's a few pages at a time: see Layouts below).
* ``release``: every resource the row owns goes back exactly once, in any state.

Faults. Admission is all or nothing: a row that fails on the way gives back what it got before the
error propagates. Release is driven by what the allocators say the row owns, so it can go on from
wherever a fault stopped it: it tries again at once, and a row that still holds memory is kept aside
and finished by every later ``admit``, ``release`` and ``close`` (``reclaim``). A failed copy fails
the request it was for, never another: a staging copy through its row's handle
(``take_staging_failures``); a backup, which carries a whole step's rows in one copy, is redone row
by row before anything overwrites its source, and a row whose own copy fails again has KV without
a host copy, so it cannot go on (``take_backup_failures``).

Layouts (``HiSparseConfig.residency``). In "always" every row is HOT: what is described above. In
"dynamic" a row is admitted FULL while the device pool holds its whole context: every position has
a device slot of its own (its pages in ``full_pages``, position order), so prefill chunks, decode
and verify read it without swap-in; it stages to host all the same, and backs up its decoded
positions ``BACKUP_PAGES`` filled pages at a time (its device rows stay until it is demoted, which
copies the rest before it drops anything, as a release to the prefix cache does before the cache
takes its pages: ``commit_runs``, ``flush_backup``). Under memory
pressure FULL rows are demoted to HOT at step boundaries, and promoted back by ``rebalance``
(``pipeline/hisparse/residency.py`` holds the rules and both moves).

Speculative verify binding and finalize (``pipeline/speculative``) use the same tables.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import structlog
import torch

from kernels import hisparse_attend_numba
from kernels.kv_copy import copy_rows
from kernels.kv_fp8 import KVCacheFormat
from kernels.swap_in import SwapInResult, swap_in
from kernels.swap_in_policy import near_margin
from pipeline.capacity import ARENA, MemoryPlan
from pipeline.hisparse.backend import HiSparseBackend, PrefetchedSwapIn
from pipeline.hisparse.buffers import DeviceBuffers
from pipeline.hisparse.counters import LayerCounters
from pipeline.hisparse.residency import BACKUP_PAGES, DynamicResidency, full_slots
from pipeline.hisparse.trace import TopKTrace
from pipeline.hisparse.transfer import (
    DoneHandle,
    FailedHandle,
    TransferHandle,
    TransferStream,
    make_transfer_stream,
)
from pipeline.hisparse.verify import VerifyBuffers
from pipeline.memory import HiSparseAllocator, HostPool, OutOfMemory, RequestRows, page_slot, page_slots
from pipeline.memory import release as resumable
from pipeline.memory.arena import PHYSICAL
from pipeline.memory.host_pool import HostRows, pins_for
from pipeline.memory.interface import Layout, Residency, ResidencyChange, TransferTotals
from pipeline.memory.prefix_cache import CachedPage, PrefixCache
from pipeline.memory.step_inputs import to_device
from pipeline.memory.targets import VerifyLayout, WriteTargets
from pipeline.speculative.draft_pool import DraftPool, ShiftedBackend

log = structlog.get_logger(__name__)


@attrs.define(eq=False)
class RowMemory:
    """What the coordinator knows of one live request row."""

    length: int  # committed positions (their KV exists)
    residency: Residency
    # FULL: ``full_pages`` holds every position (the buffer and chunk rows are empty); HOT: the
    # buffer and chunk rows, ``full_pages`` empty (``pipeline/hisparse/residency.py``)
    layout: Layout = Layout.HOT
    full_pages: list[int] = attrs.Factory(list)  # FULL: device pages in position order
    speculative: bool = False  # admitted for speculative rounds (its buffer has the draft zone)
    demoted_at: int | None = None  # the ``rebalance`` count at its last demotion
    chunk_pages: list[int] = attrs.Factory(list)  # device rows of a chunk's positions past HOT (prefill)
    staging: TransferHandle = attrs.Factory(DoneHandle)  # the newest copy of prompt positions to host
    shared: list[CachedPage] = attrs.Factory(list)  # prefix-cache entries it shares (its first pages)
    backup: int = 0  # the number of the newest backup issued for this row (``Backup.number``; 0: none)
    # positions ``[0, backed)`` have their host copies (recorded, their copies issued): all of them
    # for a HOT row; a FULL row's positions past them wait for BACKUP_PAGES filled pages, its
    # demotion or its release to the prefix cache (``commit_runs``, ``flush_backup``)
    backed: int = 0
    final: int = 0  # the most positions it can reach (``admit``'s hint; 0: unknown)


@attrs.frozen
class Backup:
    """One backup copy in flight: a step's newly committed positions, all its rows in one copy, with
    what redoing it row by row takes (its source rows stay as they are until it is settled)."""

    number: int  # issue order, from 1
    handle: TransferHandle
    rows: tuple[int, ...]
    counts: tuple[int, ...]  # positions of each row, in the copy's order
    host_slots: torch.Tensor  # [sum(counts)] int64 destinations in the host pool
    dev_slots: torch.Tensor  # [sum(counts)] int64 sources in the device pool (the copy's own tensor)


@attrs.define(eq=False)
class HiSparseCoordinator:
    """Implements ``KVMemory`` (``pipeline/memory/interface.py``) over the two-level map."""

    plan: MemoryPlan
    num_layers: int
    row_dim: int  # MLA row: latent + rope key (elements of ``dtype``)
    index_dim: int
    dtype: torch.dtype = torch.float32  # of the pools (uint8 for an FP8 cache)
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    kv_format: KVCacheFormat | None = None  # how rows and keys are stored (None: in ``dtype``)
    num_draft_layers: int = 0  # MTP layers: each gets its own resident pool (DraftPool)
    draft_rows_on_host: bool = False  # that pool's KV rows in host memory (hisparse.draft_rows_on_host)
    draft_keys_on_host: bool = False  # and its indexer keys (hisparse.draft_keys_on_host)
    # builds the transfer streams (tests inject streams with controlled latency)
    transfer: Callable[[str, torch.device], TransferStream] = make_transfer_stream
    host_rows: HostRows | None = None  # where the host pool's rows live (None: this process's memory)
    # the layers that reuse the previous full layer's top-k (GLM-5's "shared" indexer layers)
    shared_layers: tuple[int, ...] = ()
    # issue a shared layer's decode swap-in as soon as that top-k exists (``shared_after``): None =
    # on CUDA, where it runs on a load stream beside the full layer's attention and MLP
    prefetch_shared: bool | None = None
    rows: RequestRows = attrs.field(init=False)
    alloc: HiSparseAllocator = attrs.field(init=False)
    host: HostPool = attrs.field(init=False)
    buffers: DeviceBuffers = attrs.field(init=False)
    device_kv: torch.Tensor = attrs.field(init=False)  # [L, physical rows, row_dim]
    index_k: torch.Tensor = attrs.field(init=False)  # [L, logical rows, index_dim]
    counters: LayerCounters = attrs.field(init=False)
    draft: DraftPool | None = attrs.field(init=False)
    _mem: dict[int, RowMemory] = attrs.field(init=False, factory=dict)
    # staging FIFO; a row is here <=> its residency is STAGING
    _staging: collections.deque[int] = attrs.field(init=False, factory=collections.deque)
    verify: VerifyBuffers = attrs.field(init=False)  # verify binding and finalize (speculative rounds)
    layouts: DynamicResidency = attrs.field(init=False)  # the FULL / HOT rules and moves
    _staging_failures: dict[int, str] = attrs.field(init=False, factory=dict)  # row -> why its copy failed
    # backups not known to have landed, in issue order (``back_up``, ``settle_backups``)
    _backups: collections.deque[Backup] = attrs.field(init=False, factory=collections.deque)
    _backup_number: int = attrs.field(init=False, default=0)
    # the backups numbered up to this have had device work ordered after them (``order_backups``):
    # their source rows may be overwritten, so one found failed later cannot be redone
    _ordered: int = attrs.field(init=False, default=0)
    _backup_failures: dict[int, str] = attrs.field(init=False, factory=dict)  # not yet reported
    _lost: set[int] = attrs.field(init=False, factory=set)  # rows whose KV lacks a host copy (doomed)
    _leaving: set[int] = attrs.field(init=False, factory=set)  # rows whose release a fault interrupted
    _full: set[int] = attrs.field(init=False, factory=set)  # rows whose layout is FULL (``set_full``)
    # ``transfer_totals``' last answer, by the counters' sums it was made of
    _totals: tuple[object, TransferTotals] | None = attrs.field(init=False, default=None)
    # device pages lent to a prefill forward as swap-in workspace (``spare_chunk_rows``), by row; all
    # returned when the forward ends (``end_forward``)
    _lent: dict[int, list[int]] = attrs.field(init=False, factory=dict)
    cache: PrefixCache | None = attrs.field(init=False)  # pages of finished requests, by their tokens
    # ``compiled_pools``' last answer, by the identities of the tensors it views
    _pools: tuple[tuple[int, ...], hisparse_attend_numba.Pools] | None = attrs.field(init=False, default=None)
    _staging_stream: TransferStream = attrs.field(init=False)  # prompt copies to host
    _backup_stream: TransferStream = attrs.field(init=False)  # decode backups to host
    # full layer -> the shared layers right after it (where prefetching), and the CUDA load stream
    _shared_after: dict[int, tuple[int, ...]] = attrs.field(init=False, factory=dict)
    _load_stream: Any = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        plan = self.plan
        prefetch = self.prefetch_shared if self.prefetch_shared is not None else self.device.type == "cuda"
        shared = set(self.shared_layers)
        for layer in range(self.num_layers) if prefetch else ():
            run = tuple(itertools.takewhile(shared.__contains__, range(layer + 1, self.num_layers)))
            if layer not in shared and run:
                self._shared_after[layer] = run
        n_rows = plan.max_running_requests
        self.rows = RequestRows(n_rows)
        element = torch.empty(0, dtype=self.dtype).element_size()
        self.alloc = HiSparseAllocator(
            page_size=plan.page_size,
            logical_tokens=plan.logical_tokens,
            device_tokens=plan.device_tokens,
            num_rows=n_rows,
            max_len=plan.max_request_len,
            # dynamic residency: the keys and the rows share one device arena (pipeline/memory/arena.py)
            arena_bytes=(self.row_dim * element, self.index_dim * element)
            if plan.residency == "dynamic"
            else None,
        )
        self.host = HostPool(
            num_layers=self.num_layers,
            host_tokens=plan.host_tokens,
            row_dim=self.row_dim,
            page_size=plan.page_size,
            num_rows=n_rows,
            max_len=plan.max_request_len,
            dtype=self.dtype,
            pin_memory=pins_for(self.device),
            rows=self.host_rows,
        )
        self.buffers = DeviceBuffers(self.num_layers, n_rows, plan.hot, plan.page_size, device=self.device)
        self.device_kv = torch.zeros(
            self.num_layers, self.alloc.physical_rows, self.row_dim, dtype=self.dtype, device=self.device
        )
        if self.alloc.arena is not None:  # the keys are the first bytes of each layer's rows
            slab = self.alloc.physical_rows * self.row_dim
            # the whole slab when it is a whole number of keys: a contiguous tensor, which the compiled
            # CPU loops read fastest (only the first ``logical_rows`` locations are ever handed out)
            rows = slab // self.index_dim if slab % self.index_dim == 0 else self.alloc.logical_rows
            flat = self.device_kv.view(self.num_layers, -1)[:, : rows * self.index_dim]
            self.index_k = flat.view(self.num_layers, rows, self.index_dim)
            self.alloc.arena.frames.on_take = self._zero_frame
        else:
            self.index_k = torch.zeros(
                self.num_layers, self.alloc.logical_rows, self.index_dim, dtype=self.dtype, device=self.device
            )
        self.counters = LayerCounters(self.num_layers)
        self.mirror_tables()  # before the draft pool, which reads the token table's mirror
        self.draft = (
            DraftPool(
                self.alloc.logical_rows,
                self.row_dim,
                self.index_dim,
                self.num_layers,
                self.alloc.req_to_token.mirror_tensor,  # read live: ``mirror_tables`` may replace it
                self.dtype,
                self.device,
                rows_on_host=self.draft_rows_on_host,
                keys_on_host=self.draft_keys_on_host,
                kv_format=self.kv_format,
            )
            if self.num_draft_layers
            else None
        )
        # a cached page is a logical page (indexer keys, MTP rows) and the host page of its KV
        self.cache = (
            PrefixCache(plan.page_size, (self.alloc.logical, self.host.allocator), owner=n_rows)
            if plan.prefix_cache
            else None
        )
        self._staging_stream = self._host_stream("staging")
        self._backup_stream = self._host_stream("backup")
        # a proxy: the coordinator and its verify half hold no reference cycle, so that a dropped
        # coordinator's pools are freed at once, not by the cyclic collector (which an engine freezes)
        self.verify = VerifyBuffers(weakref.proxy(self))
        self.layouts = DynamicResidency(weakref.proxy(self), plan.residency)

    def _zero_frame(self, frame: int) -> None:
        """An arena frame changes hands: zero its bytes (rows and keys alike), so that neither side
        reads the other's as its own."""
        assert self.alloc.arena is not None
        rows = self.alloc.arena.pages_per_frame * self.plan.page_size
        self.device_kv[:, frame * rows : (frame + 1) * rows].zero_()

    def _host_stream(self, name: str) -> TransferStream:
        """A stream of copies to the host pool (through its rows' own stream when they are shared)."""
        stream = self.transfer(name, self.device)
        return stream if self.host_rows is None else self.host_rows.stream(name, stream)

    def mirror_tables(self, *, separate: bool = False) -> None:
        """Device copies of ``req_to_token`` and ``req_to_host`` for the kernels, updated row by row
        as the tables change (never copied whole per forward). On a CPU they are the tables
        themselves unless ``separate`` (tests: then a missed update shows)."""
        self.alloc.req_to_token.mirror_on(self.device, separate=separate)
        self.host.map.mirror_on(self.device, separate=separate)

    # --- admission and prefill ------------------------------------------------------------------

    @property
    def hot(self) -> int:
        return self.plan.hot

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.alloc.req_to_token.table

    @property
    def req_to_token_device(self) -> torch.Tensor:
        """``req_to_token`` on the device (its mirror)."""
        return self.alloc.req_to_token.mirror_tensor()

    @property
    def req_to_host_device(self) -> torch.Tensor:
        """``req_to_host`` on the device (its mirror)."""
        return self.host.map.mirror_tensor()

    def length(self, row: int) -> int:
        return self._mem[row].length

    def live_rows(self) -> list[int]:
        """Rows a request holds (not the ones whose release is still to be finished)."""
        return sorted(set(self._mem) - self._leaving)

    def _admission_pages(self, num_tokens: int, speculative: bool) -> tuple[int, int]:
        """(buffer pages, chunk pages) a prompt holds from admission on: its device buffer (whose identity
        columns receive the positions below HOT, and whose newest column and draft zone the first of a chunk's
        positions past HOT) and the rows of the rest of a chunk. Holding the buffer from admission means
        staging never waits for memory (the progress guarantee of ``docs/invariants.md``)."""
        page = self.plan.page_size
        buffer_pages = self.buffers.capacity_for(num_tokens, speculative=speculative) // page
        return buffer_pages, self.plan.chunk_area(num_tokens) // page

    def _needs(self, num_tokens: int, speculative: bool, cached: int) -> tuple[int, int, int]:
        """(physical, logical, host) pages admitting a prompt whose first ``cached`` pages are
        shared takes."""
        buffer_pages, chunk_pages = self._admission_pages(num_tokens, speculative)
        pages = -(-num_tokens // self.plan.page_size) - cached
        return buffer_pages + chunk_pages, pages, pages

    def _match(self, tokens: Sequence[int] | None) -> list[CachedPage]:
        return self.cache.match(tokens) if self.cache is not None and tokens is not None else []

    def _admission(
        self, num_tokens: int, speculative: bool, tokens: Sequence[int] | None
    ) -> tuple[list[CachedPage], tuple[int, int, int], Layout] | None:
        """(the cached chain it shares, its (physical, logical, host) page needs, its layout) when a
        prompt fits, counting the cached pages nobody else shares as free and, for a HOT admission,
        the pages demotions would free; None when it does not. (A FULL admission is optimistic: it
        needs room for the prompt and one page of growth, and growth past what the arena holds
        demotes; ``final`` is kept for promotions, which are not: ``DynamicResidency.rebalance``.)"""
        if not self.rows.can_allocate():
            return None
        chain = self._match(tokens)
        needs = physical, logical, host = self._needs(num_tokens, speculative, len(chain))
        spare = 0 if self.cache is None else self.cache.spare(chain)
        if self.host.allocator.num_free_pages + spare < host:
            return None
        # (in an arena the logical side grows into the frames demotions free: ``_fits`` answers)
        if self.alloc.arena is None and self.alloc.logical.num_free_pages + spare < logical:
            return None
        if self.layouts.dynamic:  # FULL while the arena holds the whole context
            full = self.layouts.full_pages(num_tokens)
            if self._fits(logical, full, chain=chain):
                return chain, (full, logical, host), Layout.FULL
            hot = self._fits(logical, physical, chain=chain, demote=True)
            return (chain, needs, Layout.HOT) if hot else None
        return (chain, needs, Layout.HOT) if self.layouts.can_free(physical) else None

    def _fits(
        self, logical: int, physical: int, *, chain: Sequence[CachedPage] = (), demote: bool = False
    ) -> bool:
        """Whether ``logical`` and ``physical`` more device pages fit together, counting the cached
        pages nobody (``chain`` aside) shares as free, and with ``demote`` the pages demotions would
        free (an arena's two sides compete for its free frames)."""
        cached = [] if self.cache is None else self.cache.evictable_pages(0, keep=chain)
        moves = self.layouts.demotion_moves() if demote else []
        return self.alloc.fits(logical, physical, freed_logical=cached, moves=moves)

    def _make_device_room(self, logical: int, physical: int) -> bool:
        """Evict cached pages nobody shares, then demote FULL rows (the largest context first), until
        ``logical`` and ``physical`` more device pages fit together; returns whether they do."""
        while not self.alloc.fits(logical, physical):
            if self.cache is not None and self.cache.evict(1):
                continue
            found = self.layouts.candidates()
            if not found:
                return False
            self.layouts.demote(found[0][0])
        return True

    def can_admit(
        self,
        num_tokens: int,
        *,
        speculative: bool = False,
        tokens: Sequence[int] | None = None,
        final: int | None = None,
    ) -> bool:
        """Room for a prompt (``tokens``, when given, may share cached pages): a row, its buffer and
        chunk rows, locations and its host copy; unreferenced cached pages count as free."""
        return self._admission(num_tokens, speculative, tokens) is not None

    def admit(
        self,
        num_tokens: int,
        *,
        speculative: bool = False,
        tokens: Sequence[int] | None = None,
        final: int | None = None,
    ) -> int:
        """A row holding everything its prompt needs to reach decode (locations and host pages for
        every position, the device buffer, one chunk's rows); raises ``OutOfMemory`` (nothing
        changed). With ``tokens`` and a prefix cache, the longest cached prefix is shared: its
        positions count as computed (``length``), and the first of them, up to HOT, are loaded from
        host into their identity columns (a short request decodes from them in place).

        All or nothing: when anything on the way raises, what the row got goes back (``release``)
        and the error propagates."""
        self.reclaim()
        admission = self._admission(num_tokens, speculative, tokens)
        if admission is None:
            raise OutOfMemory("hisparse admission", -(-num_tokens // self.plan.page_size), self.free_pages())
        chain, (physical, logical, host), layout = admission
        separate = self.alloc.arena is None
        if separate and not self.layouts.relieve(lambda: self.alloc.physical.can_allocate(physical)):
            raise OutOfMemory("hisparse admission", physical, self.alloc.physical.num_free_pages)
        if self.cache is not None:  # without tokens it matched nothing, and looked nothing up
            # (an arena's logical pages come next, with evictions and demotions: ``_make_device_room``)
            looked_up = num_tokens if tokens is not None else 0
            self.cache.share(chain, (logical if separate else 0, host), looked_up)
        if self.alloc.arena is not None and not self._make_device_room(logical, physical):
            if self.cache is not None:
                self.cache.unlock(chain)
            raise OutOfMemory("hisparse admission", physical, self.alloc.physical.num_free_pages)
        try:
            row = self.rows.allocate()
        except BaseException:
            if self.cache is not None:
                self.cache.unlock(chain)
            raise
        # from here on the row owns what it gets, and ``release`` gives back whatever that is
        mem = self._mem[row] = RowMemory(
            length=0, residency=Residency.PREFILL, shared=chain, speculative=speculative,
            final=min(final or 0, self.plan.max_request_len),
        )
        try:
            if chain:
                self.alloc.req_to_token.share(row, [e.pages[0] for e in chain])
                self.host.map.share(row, [e.pages[1] for e in chain])
            self.alloc.extend(row, num_tokens)
            self.host.reserve(row, num_tokens)
            mem.length = mem.backed = len(chain) * self.plan.page_size  # (the cache's host copies)
            if layout is Layout.FULL:
                self._admit_full(row, physical)
            else:
                self._admit_hot(row, num_tokens, speculative)
        except BaseException:
            self.release(row)
            raise
        return row

    def _admit_hot(self, row: int, num_tokens: int, speculative: bool) -> None:
        """A HOT row's device pages: its buffer and one chunk's rows; cached positions below HOT
        loaded into their identity columns."""
        mem = self._mem[row]
        buffer_pages, chunk_pages = self._admission_pages(num_tokens, speculative)
        self.buffers.assign(row, self.alloc.alloc_physical(row, buffer_pages))
        if chunk_pages:
            mem.chunk_pages = self.alloc.alloc_physical(row, chunk_pages)
        if mem.length:
            self._load_identity(row, min(mem.length, self.hot))

    def _admit_full(self, row: int, num_pages: int) -> None:
        """A FULL row's device pages, in position order; the positions shared with the prefix cache
        loaded from host (their locations are the cache's: they map to no slot)."""
        mem = self._mem[row]
        self.set_full(row, self.alloc.alloc_physical(row, num_pages))
        if not mem.length:
            return
        slots = full_slots(mem.full_pages, self.plan.page_size, 0, mem.length)
        host_slots = self.host.req_to_host[row, : mem.length]
        copy_rows(self.device_kv, slots.to(self.device), self.host.kv, host_slots, validate=False)
        for layer in range(self.num_layers):
            self.counters.add_prefill_loads(layer, 0, mem.length, mem.length * self.host.row_bytes)

    def _load_identity(self, row: int, count: int) -> None:
        """Copy positions ``[0, count)`` (below HOT, with host copies) into their identity columns."""
        positions = torch.arange(count)
        host_slots = self.host.req_to_host[row, positions]
        dev_slots = self.buffers.locs[row, positions.to(self.device)]
        copy_rows(self.device_kv, dev_slots, self.host.kv, host_slots, validate=False)  # every layer
        for layer in range(self.num_layers):
            self.counters.add_prefill_loads(layer, 0, count, count * self.host.row_bytes)

    def prefill_targets(self, row: int, start: int, end: int) -> WriteTargets:
        """Where positions ``[start, end)`` of a prefilling row write (idempotent until
        ``commit_prefill``): a position below HOT to its identity column, one past HOT to the chunk
        rows. Waits for the previous chunk's copy to host (it reads the chunk rows this chunk
        overwrites, and this chunk's swap-in reads it); an earlier position keeps no device mapping:
        the forward reads it through swap-in, as decode does. A FULL row's positions each go to
        their own slot, and the earlier ones stay mapped (no swap-in)."""
        mem = self._mem[row]
        assert mem.residency is Residency.PREFILL and start == mem.length, (row, start, mem.length)
        # a CPU wait: the chunk's swap-in gathers the host rows that copy writes on the CPU
        # (docs/cuda.md); raises if that copy failed: this row's forward fails alone
        mem.staging.wait()
        locs = self.req_to_token[row, :end]
        if mem.layout is Layout.FULL:  # every position at its own slot, the earlier ones stay mapped
            slots = full_slots(mem.full_pages, self.plan.page_size, start, end)
            self.alloc.bind(locs[start:], slots)
            return WriteTargets(*to_device(self.device, locs[start:], slots))
        self.alloc.clear(locs[:start])
        positions = torch.arange(start, end)
        hot = self.hot
        below = positions < hot
        area = self._chunk_area(row)  # past HOT: the newest column and draft zone, then the chunk rows
        slots = torch.empty(end - start, dtype=torch.int64)
        slots[below] = self.buffers.locs[row, positions[below].to(self.device)].cpu()
        slots[~below] = area[positions[~below] - max(start, hot)]
        self.alloc.bind(locs[start:], slots)
        return WriteTargets(*to_device(self.device, locs[start:], slots))

    def _chunk_area(self, row: int) -> torch.Tensor:
        """The device slots a prefilling row's positions past HOT go to, in order: the buffer's
        newest column and draft zone, then its chunk rows."""
        mem = self._mem[row]
        return torch.cat(
            [self.buffers.locs[row, self.hot :].cpu(), page_slots(mem.chunk_pages, self.plan.page_size)]
        )

    def spare_chunk_rows(self, row: int, start: int, end: int) -> torch.Tensor:
        """Device slots the chunk ``[start, end)``'s swap-in may use as workspace during the forward:
        the chunk area the chunk does not write (its positions past HOT take the first ones), then
        free device rows lent for the forward, as many as the earlier positions need (so their
        groups seldom have to take turns in the hot region), as far as the pool has them free.

        Lent rows hold no mapping and nothing outlives the forward in them; ``end_forward`` returns
        them, so between forwards a request holds no more than its buffer and one chunk."""
        used = max(0, end - max(start, self.hot))
        spare = self._chunk_area(row)[used:]
        page = self.plan.page_size
        lent = self._lent.setdefault(row, [])  # (asked again within one forward: nothing more)
        more = min(-(-max(0, start - spare.numel()) // page) - len(lent), self.alloc.physical.num_free_pages)
        if more > 0:
            lent.extend(self.alloc.alloc_physical(row, more))
        if not lent:
            return spare.to(self.device)
        return torch.cat([spare, page_slots(lent, page)]).to(self.device)

    def end_forward(self) -> None:
        """A forward has ended (however it ended): return every device row lent to it."""
        for row, pages in self._lent.items():
            if pages:
                self.alloc.free_physical(row, pages)
        self._lent.clear()

    def commit_prefill(self, row: int, start: int, end: int, *, final: bool) -> None:
        """The forward computed positions ``[start, end)``. A chunk that is not the prompt's last is
        copied to host now (the next chunk reads it from there); the last one is copied by
        ``start_staging``."""
        mem = self._mem[row]
        mem.length = end
        if not final:
            mem.staging = self._copy_prompt(row, start, end)

    def _copy_prompt(self, row: int, start: int, end: int) -> TransferHandle:
        """Issue the copy of prompt positions ``[start, end)`` (still mapped to their slots) to host."""
        positions = torch.arange(start, end)
        host_slots = self.host.record(row, positions)
        self._mem[row].backed = end
        dev_slots = self.alloc.lookup(self.req_to_token[row, start:end]).to(self.device)
        self.counters.add_backup((end - start) * self.host.row_bytes)
        try:
            return self._staging_stream.copy_rows(self.host.kv, host_slots, self.device_kv, dev_slots)
        except Exception as exc:  # not even issued: the row's handle says so, as for a copy that failed
            return FailedHandle(exc)

    def start_staging(self, row: int, length: int) -> None:
        """The prompt's KV is computed: copy what is not on host yet (the last chunk) and queue
        the row."""
        mem = self._mem[row]
        assert mem.length == length, (row, mem.length, length)
        copied = int((self.host.req_to_host[row, :length] >= 0).sum())
        mem.staging = self._copy_prompt(row, copied, length)
        mem.residency = Residency.STAGING
        self._staging.append(row)

    def staging_rows(self) -> list[int]:
        return list(self._staging)

    def staging_landed(self, row: int) -> bool:
        """Whether ``row``'s staging copy has landed; never blocks, changes nothing (raises the
        copy's error if it failed)."""
        return self._mem[row].staging.query()

    def wait_staging(self) -> None:
        """Block until every staging copy in flight has landed or failed; raises nothing (a failed
        copy is its row's failure, reported by ``take_staging_failures``)."""
        for row in self._staging:
            try:
                self._mem[row].staging.wait()
            except Exception as exc:
                self._staging_failures[row] = _copy_failure("staging", exc)

    def collect_ready(self, rows: list[int] | None = None, *, speculative: bool = False) -> list[int]:
        """Pop staged rows (of ``rows``; all when None) whose copy has landed, in FIFO order: each
        gives back its chunk rows and decodes through the buffer it holds since admission (a FULL
        row keeps its pages and mappings).

        Stops at the first row whose copy is still in flight (copies land in issue order). A row
        whose copy failed is skipped and reported by ``take_staging_failures`` (the caller releases
        it).
        """
        wanted = None if rows is None else set(rows)
        ready: list[int] = []
        for row in list(self._staging):
            if wanted is not None and row not in wanted:
                continue
            mem = self._mem[row]
            try:
                landed = mem.staging.query()
            except Exception as exc:  # this row's copy failed: this row fails alone
                self._staging_failures[row] = _copy_failure("staging", exc)
                continue
            if not landed:
                break
            if mem.layout is Layout.HOT:
                self.alloc.clear(self.req_to_token[row, : mem.length])  # decode reads through the buffer
            if mem.chunk_pages:
                self.alloc.free_physical(row, mem.chunk_pages)
            self._staging.remove(row)
            mem.residency, mem.staging, mem.chunk_pages = Residency.RESIDENT, DoneHandle(), []
            ready.append(row)
        return ready

    def residency(self, row: int) -> Residency:
        return self._mem[row].residency

    # --- dynamic residency (``pipeline/hisparse/residency.py``) ----------------------------------

    def layout(self, row: int) -> Layout:
        """``row``'s layout (from its admission on; HOT for every row unless residency is dynamic)."""
        return self._mem[row].layout

    def set_full(self, row: int, pages: list[int] | None) -> None:
        """Record ``row``'s layout: FULL over ``pages`` (position order), or HOT (None)."""
        mem = self._mem[row]
        mem.layout = Layout.HOT if pages is None else Layout.FULL
        mem.full_pages = [] if pages is None else list(pages)
        if pages is None:
            self._full.discard(row)
        else:
            self._full.add(row)
        self.layouts.forget_table()

    def full_rows(self) -> list[int]:
        """The rows whose layout is FULL (live or being released), in row order."""
        return sorted(self._full)

    def shared_len(self, row: int) -> int:
        """Positions of ``row`` in pages it shares with the prefix cache (they map to no slot)."""
        return len(self._mem[row].shared) * self.plan.page_size

    def full_flags(self, rows: torch.Tensor) -> list[bool]:
        """Whether each of ``rows`` (request rows, one a token) is FULL; empty when no row is."""
        full = self._full
        return [row in full for row in rows.tolist()] if full else []

    def full_page_table(self) -> torch.Tensor:
        """``[rows, pages]`` int64 each FULL row's device pages in position order, -1 beyond them and
        for HOT rows: a forward's way from a position to its slot (built for each forward that has
        FULL rows; a prefix shared with the cache has locations that map to no slot)."""
        return self.layouts.page_table(self.full_rows())

    def demote(self, row: int) -> int:
        """FULL -> HOT for a decoding row at a step boundary; returns the device bytes freed."""
        return self.layouts.demote(row)

    def promote(self, row: int) -> int:
        """HOT -> FULL for a decoding row at a step boundary; returns the bytes copied to device."""
        return self.layouts.promote(row)

    def rebalance(self) -> None:
        self.layouts.rebalance()

    def take_residency_changes(self) -> list[ResidencyChange]:
        return self.layouts.take_changes()

    def residency_stats(self) -> dict[str, object]:
        return self.layouts.stats()

    def take_staging_failures(self) -> dict[int, str]:
        """Rows whose staging copy failed since the last call, with the reason (once each)."""
        failed, self._staging_failures = self._staging_failures, {}
        return {row: why for row, why in failed.items() if row in self._mem}

    # --- plain decode ---------------------------------------------------------------------------

    def decode_needs(
        self, row: int, *, new_tokens: int = 1, speculative: bool = False
    ) -> tuple[int, int, int]:
        """(logical, physical, host) pages that committing ``new_tokens`` more positions needs."""
        mem = self._mem[row]
        end = mem.length + new_tokens
        logical = self.alloc.req_to_token.pages_needed(row, end)
        page = self.plan.page_size
        if mem.layout is Layout.FULL:  # a page per P positions, whatever the round
            physical = max(0, -(-end // page) - len(mem.full_pages))
        else:
            cap = self.buffers.capacity(row)
            physical = max(0, self.buffers.capacity_for(end, speculative=speculative) - cap) // page
        host = self.host.pages_needed(row, end)
        return logical, physical, host

    def _room(self, row: int, new_tokens: int, speculative: bool) -> tuple[int, int, int] | None:
        """``decode_needs`` when every pool can give them, else None (changes nothing)."""
        end = self._mem[row].length + new_tokens
        if end > self.plan.max_request_len:
            return None
        if (  # the usual step: the row already has the room (``decode_needs`` all 0, found cheaply)
            end <= self.alloc.req_to_token.covered_len(row)
            and end <= self.host.map.covered_len(row)
            and self._device_room(row, end, speculative)
        ):
            return (0, 0, 0)
        needs = self.decode_needs(row, new_tokens=new_tokens, speculative=speculative)
        if needs == (0, 0, 0):
            return needs
        logical, physical, host = needs
        if self.alloc.arena is not None:  # cached pages nobody shares give way to either side
            while self.cache is not None and not (
                self.alloc.fits(logical, physical) and self.host.allocator.can_allocate(host)
            ) and self.cache.evict(1):
                pass
            fits = self.alloc.fits(logical, physical) and self.host.allocator.can_allocate(host)
            return needs if fits else None
        if self.cache is not None and self.alloc.physical.can_allocate(physical):
            self.cache.make_room((logical, host))  # cached pages nobody shares give way
        fits = (
            self.alloc.logical.can_allocate(logical)
            and self.alloc.physical.can_allocate(physical)
            and self.host.allocator.can_allocate(host)
        )
        return needs if fits else None

    def _device_room(self, row: int, end: int, speculative: bool) -> bool:
        """Whether ``row``'s device pages hold positions up to ``end`` already."""
        mem = self._mem[row]
        if mem.layout is Layout.FULL:
            return end <= len(mem.full_pages) * self.plan.page_size
        cap = self.buffers.capacity(row)
        return self.buffers.capacity_for(end, speculative=speculative) - cap < self.plan.page_size

    def _short_of_device(self, row: int, new_tokens: int, speculative: bool) -> int:
        """The device pages ``row`` lacks for ``new_tokens`` more positions when device pages are
        all it lacks (what demotions can give), else 0."""
        end = self._mem[row].length + new_tokens
        if end > self.plan.max_request_len:
            return 0
        logical, physical, host = self.decode_needs(row, new_tokens=new_tokens, speculative=speculative)
        spare = 0 if self.cache is None else self.cache.evictable()
        if self.alloc.arena is not None:  # both levels are device pages: only the host is apart
            hosted = self.host.allocator.num_free_pages + spare >= host
            short = hosted and not self.alloc.fits(logical, physical)
            return max(1, physical) if short else 0
        others = (
            self.alloc.logical.num_free_pages + spare >= logical
            and self.host.allocator.num_free_pages + spare >= host
        )
        return physical if others and not self.alloc.physical.can_allocate(physical) else 0

    def can_decode(self, row: int, *, new_tokens: int = 1, speculative: bool = False) -> bool:
        """Room for ``new_tokens`` more positions, now or once demotions have freed device pages."""
        if self._room(row, new_tokens, speculative) is not None:
            return True
        short = self._short_of_device(row, new_tokens, speculative) if self.layouts.dynamic else 0
        if short and self.alloc.arena is not None:
            logical, physical, _host = self.decode_needs(row, new_tokens=new_tokens, speculative=speculative)
            return self._fits(logical, physical, demote=True)
        return bool(short) and self.layouts.can_free(short)

    def ensure_capacity(self, row: int, *, new_tokens: int, speculative: bool) -> None:
        """Locations for the next ``new_tokens`` positions, a buffer wide enough for them, and host
        pages for their copies.

        Raises ``OutOfMemory`` before changing anything when a pool is short. Computes the needs
        once; a row that already has the room (a second call in the same step) changes nothing.
        In dynamic residency, a row short of device pages alone first demotes FULL rows, the
        largest context first (this row too), until it has them.
        """
        needs = self._room(row, new_tokens, speculative)
        if needs is None and self.layouts.dynamic and self._short_of_device(row, new_tokens, speculative):
            self.layouts.relieve(lambda: self._room(row, new_tokens, speculative) is not None)
            needs = self._room(row, new_tokens, speculative)
        if needs is None:
            raise OutOfMemory("hisparse decode", new_tokens, self.free_pages())
        logical, physical, host = needs
        mem = self._mem[row]
        end = mem.length + new_tokens
        if logical:
            self.alloc.extend(row, end)
        if physical and mem.layout is Layout.FULL:
            self.set_full(row, mem.full_pages + self.alloc.alloc_physical(row, physical))
        elif physical:
            self.buffers.grow(row, self.alloc.alloc_physical(row, physical))
        if host:  # taken now, so that rows checked one after another cannot count the same pages
            self.host.reserve(row, end)

    def prepare_decode(self, rows: list[int]) -> WriteTargets:
        """Where each row's next token (position = its length) writes; raises ``OutOfMemory``.

        While short the token goes to its identity column; once long it replaces the newest column,
        after the backup that reads the previous newest token has completed. A FULL row's token
        (dynamic residency) goes to its position's slot in its own pages.
        """
        for row in rows:  # (all first: a row's room may demote another row of the batch)
            self.ensure_capacity(row, new_tokens=1, speculative=False)
        page, logical = self.plan.page_size, self.alloc.req_to_token
        locs, slots, long_rows, long_positions = [], [], [], []
        for row in rows:
            mem = self._mem[row]
            pos = mem.length
            locs.append(logical.slot(row, pos))
            if mem.layout is Layout.FULL:  # (dynamic residency) its position's slot in its own pages
                slots.append(page_slot(mem.full_pages, page, pos))
                continue
            col = self.buffers.column_of(pos)
            if col == self.buffers.newest:
                self.order_backups(mem.backup)  # the previous newest token's copy reads this column
                long_rows.append(row)
                long_positions.append(pos)
            slots.append(self.buffers.slot_of(row, col))
        if long_rows:  # their newest columns change hands, all at once
            self._replace_newest(long_rows, long_positions)
        # one bind for the whole step (the rows' locations are disjoint); locations and slots are
        # found on the host, from the rows' pages, so nothing is read back from the device
        table = torch.tensor([locs, slots], dtype=torch.int64)
        loc_t, host_slots = table[0], table[1]  # (cheaper than unpacking: unbind)
        self.alloc.bind(loc_t, host_slots)
        return WriteTargets(*to_device(self.device, loc_t, host_slots))  # (one asynchronous copy on CUDA)

    def _replace_newest(self, rows: list[int], positions: list[int]) -> None:
        """The newest columns of ``rows`` (distinct) are about to be overwritten: the tokens they
        hold keep only their host copies, and each column holds its row's next position in every
        layer (the held tokens from the buffers' host copy, one clear, one write)."""
        buffers = self.buffers
        kept = [(row, pos) for row, pos in zip(rows, buffers.newest_of(rows)) if pos >= 0]  # (host copy)
        if kept:
            held_rows, held = zip(*kept)
            self.alloc.clear(self.req_to_token[torch.tensor(held_rows), torch.tensor(held)])
        row_d, new = to_device(self.device, rows, positions)
        buffers.tokens[:, row_d, buffers.newest] = new.to(torch.int32)
        buffers.record_newest(rows, positions)

    def commit_decode(self, rows: list[int], slots: torch.Tensor, num_new: list[int] | None = None) -> None:
        """The forward wrote ``num_new[i]`` new positions of ``rows[i]`` at ``slots``: commit them and
        back them up (``commit_runs``). The host pages were taken with the step's room
        (``ensure_capacity``, via ``prepare_decode``). A row whose backup failed is reported by
        ``take_backup_failures``."""
        if rows:
            self.layouts.step()  # a decode step (the promotion's hysteresis counts them)
        self.commit_runs(rows, num_new or [1] * len(rows), slots)

    def commit_runs(self, rows: list[int], counts: list[int], slots: torch.Tensor) -> None:
        """Commit ``counts[i]`` new positions of ``rows[i]``, written at ``slots`` (the rows in order),
        and issue the backups the backup rule asks for, in one copy: a HOT row's new positions (the
        hot buffer keeps few of them); a FULL row's positions since its last backup up to its last
        full page once ``BACKUP_PAGES`` filled pages wait (its device rows stay until it is demoted,
        so what is left is copied later, or by its demotion or its release to the prefix cache:
        ``flush_backup``)."""
        if not any(self._mem[row].layout is Layout.FULL for row in rows):  # every row HOT
            starts = [self._mem[row].length for row in rows]
            host_slots = self.host.record_runs(rows, starts, counts)
            for row, count in zip(rows, counts):
                mem = self._mem[row]
                mem.length = mem.backed = mem.length + count
            # a copy of its own: the backup may run after the caller has reused ``slots``
            self.back_up(rows, counts, host_slots, slots[: sum(counts)].to(self.device, copy=True))
            return
        page = self.plan.page_size
        runs: list[tuple[int, int, int]] = []  # (row, first position, count) backed up now
        parts: list[torch.Tensor] = []  # their device slots
        at = 0
        for row, count in zip(rows, counts):
            mem = self._mem[row]
            start, at = mem.length, at + count
            mem.length += count
            if mem.layout is Layout.HOT:
                runs.append((row, start, count))
                parts.append(slots[at - count : at].to(self.device, copy=True))
                mem.backed = mem.length
                continue
            upto = mem.length // page * page  # up to its last full page, once BACKUP_PAGES wait
            if upto - mem.backed >= BACKUP_PAGES * page:
                runs.append((row, mem.backed, upto - mem.backed))
                parts.append(full_slots(mem.full_pages, page, mem.backed, upto).to(self.device))
                mem.backed = upto
        self._back_up_runs(runs, parts)

    def flush_backup(self, row: int) -> None:
        """Issue the backup of ``row``'s committed positions that have no host copy yet (a FULL row's:
        fewer than ``BACKUP_PAGES`` filled pages and its newest partial page); nothing for a row
        backed up whole."""
        mem = self._mem[row]
        if mem.backed >= mem.length:
            return
        assert mem.layout is Layout.FULL, (row, mem.backed, mem.length)
        run = (row, mem.backed, mem.length - mem.backed)
        slots = full_slots(mem.full_pages, self.plan.page_size, mem.backed, mem.length).to(self.device)
        mem.backed = mem.length
        self._back_up_runs([run], [slots])

    def _back_up_runs(self, runs: list[tuple[int, int, int]], parts: list[torch.Tensor]) -> None:
        """Record the host slots of the (row, first position, count) ``runs`` and back them up from
        the device slots ``parts`` (one tensor a run), all in one copy."""
        if not runs:
            return
        rows, starts, counts = (list(col) for col in zip(*runs))
        host_slots = self.host.record_runs(rows, starts, counts)
        self.back_up(rows, counts, host_slots, torch.cat(parts))

    # --- backups ----------------------------------------------------------------------------------

    def back_up(
        self, rows: list[int], counts: list[int], host_slots: torch.Tensor, dev_slots: torch.Tensor
    ) -> None:
        """Copy newly committed positions to host: ``counts[i]`` positions of ``rows[i]``, from
        ``dev_slots`` to ``host_slots`` (the rows in order), one copy (all layers) for all of them;
        each row remembers it as its newest backup. The source rows must stay as they are until the
        backup is settled (``settle_backups``, which every overwrite of a backed-up column waits
        for). A copy that fails, as it is issued or later, is redone row by row; a row whose own
        copy fails again goes to ``take_backup_failures``."""
        self._settle_landed()
        self._backup_number += 1
        backup = Backup(self._backup_number, DoneHandle(), tuple(rows), tuple(counts), host_slots, dev_slots)
        try:
            handle = self._backup_stream.copy_rows(self.host.kv, host_slots, self.device_kv, dev_slots)
        except Exception as exc:  # not even issued
            self._redo_backup(backup, exc)
        else:
            if not isinstance(handle, DoneHandle):  # (a copy run inline has landed already)
                self._backups.append(attrs.evolve(backup, handle=handle))
        self.counters.add_backup(len(host_slots) * self.host.row_bytes)
        for row in rows:
            self._mem[row].backup = backup.number

    def settle_backups(self, upto: int | None = None) -> None:
        """Wait on the CPU for the backups numbered up to ``upto`` (every one when None), in issue
        order; a failed one is redone row by row (lost, when device work was ordered after it).
        For the CPU's own decisions (slots freed, host rows compared); before device work that
        overwrites a backup's source, ``order_backups``. Raises nothing."""
        while self._backups and (upto is None or self._backups[0].number <= upto):
            backup = self._backups.popleft()
            try:
                backup.handle.wait()
            except Exception as exc:
                self._backup_failed(backup, exc)

    def order_backups(self, upto: int) -> None:
        """Order the device work queued next after the backups numbered up to ``upto``: it overwrites
        their source rows (a newest column, a draft zone). No CPU wait on CUDA
        (``TransferHandle.order_after``); on CPU it waits as ``settle_backups`` does. A backup known
        to have failed now is redone row by row first; one found failed later loses its rows (their
        source rows may have been overwritten by then). Raises nothing."""
        for backup in list(self._backups):
            if backup.number > upto:
                break
            if backup.number <= self._ordered:
                continue  # ordered already
            try:
                backup.handle.order_after()
            except Exception as exc:
                self._backups.remove(backup)
                self._redo_backup(backup, exc)
        self._ordered = max(self._ordered, upto)

    def _settle_landed(self) -> None:
        """Forget the backups at the head of the queue that have landed (never blocks); a failed
        one is redone."""
        while self._backups:
            backup = self._backups[0]
            try:
                if not backup.handle.query():
                    return
            except Exception as exc:
                self._backups.popleft()
                self._backup_failed(backup, exc)
                continue
            self._backups.popleft()

    def _backup_failed(self, backup: Backup, error: BaseException) -> None:
        """A backup found failed: redone while its source rows are intact, else its rows are lost."""
        if backup.number > self._ordered:
            self._redo_backup(backup, error)
            return
        why = _copy_failure("backup", error)
        lost = [row for row in backup.rows if row in self._mem and row not in self._lost]
        for row in lost:
            log.error("hisparse.backup_failed", row=row, error=why)
            self._lost.add(row)
            self._backup_failures[row] = why
        if not lost:  # its rows had failed already, or ended: nothing is lost that was not before
            log.warning("hisparse.backup_dropped", rows=list(backup.rows), error=why)

    def _redo_backup(self, backup: Backup, error: BaseException) -> None:
        """A backup failed: copy each row's part again, on its own, and wait for it (its source rows
        are still there: nothing overwrites a backed-up column before its backup is settled)."""
        log.warning("hisparse.backup_retried", rows=list(backup.rows), error=_copy_failure("backup", error))
        at = 0
        for row, count in zip(backup.rows, backup.counts):
            part = slice(at, at + count)
            at += count
            if row not in self._mem or row in self._lost:
                continue
            try:
                self._backup_stream.copy_rows(
                    self.host.kv, backup.host_slots[part], self.device_kv, backup.dev_slots[part]
                ).wait()
            except Exception as exc:  # this row's own copy fails: its KV has no host copy
                why = _copy_failure("backup", exc)
                log.error("hisparse.backup_failed", row=row, error=why)
                self._lost.add(row)
                self._backup_failures[row] = why

    def take_backup_failures(self, rows: list[int]) -> dict[int, str]:
        """Rows of ``rows`` whose backup failed, with the reason (each once): some of their committed
        KV has no host copy, so they cannot go on; the caller fails and releases them."""
        return {row: self._backup_failures.pop(row) for row in rows if row in self._backup_failures}

    def wait_backups(self) -> None:
        """Block until every backup issued has landed (or, failed, was redone)."""
        self.settle_backups()

    def backend(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        locs: torch.Tensor,
        slots: torch.Tensor,
        *,
        steps: int = 0,
        chunk_starts: torch.Tensor | None = None,
        trace: TopKTrace | None = None,
        labels: dict[int, str] | None = None,
    ) -> HiSparseBackend:
        """The attention backend of one forward: ``steps`` = 0 for a prefill (``chunk_starts``: the
        first position of each token's chunk), else tokens per row."""
        # decode / verify only: what the near-policies and the trace read (a prefill's swap-in does not)
        margin = near_margin(
            self.plan.near_margin, self.plan.policy, self.plan.top_k, tracing=trace is not None
        )
        margin = margin if steps else 0
        return HiSparseBackend(
            self,
            rows,
            positions,
            locs,
            slots,
            steps=steps,
            chunk_starts=chunk_starts,
            trace=trace,
            labels=labels,
            near_margin=margin,
        )

    def draft_backend(
        self, rows: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor
    ) -> ShiftedBackend:
        """The MTP layer's backend: its own resident pool, addressed by logical location."""
        assert self.draft is not None, "the coordinator was built without a draft pool"
        return self.draft.backend(rows, positions, locs)

    # --- speculative verify (``VerifyBuffers``) --------------------------------------------------

    def prepare_verify(self, rows: list[int], draft_tokens: int) -> VerifyLayout:
        return self.verify.prepare(rows, draft_tokens)

    def finalize_verify(self, rows: list[int], accepted: list[int], layout: VerifyLayout) -> list[int]:
        return self.verify.finalize(rows, accepted, layout)

    def take_failure(self, row: int) -> Exception | None:
        return self.verify.take_failure(row)

    # --- swap-in --------------------------------------------------------------------------------

    def swap_in(
        self,
        layer: int,
        top_k_pos: torch.Tensor,
        seq_lens: torch.Tensor,
        rows: torch.Tensor,
        *,
        near: torch.Tensor | None = None,
    ) -> SwapInResult:
        """Resolve ``top_k_pos [B, S, K]`` of ``layer`` to device slots, loading misses from host;
        ``near [B, S, M]``: the positions the indexer ranked next (what the near-policies read)."""
        result = swap_in(
            top_k_pos,
            seq_lens,
            rows,
            self.buffers.tokens[layer],
            self.buffers.locs,
            self.buffers.lru[layer],
            self.req_to_host_device,
            self.host.kv[layer],
            self.device_kv[layer],
            hot=self.hot,
            policy=self.plan.policy,
            near=near,
            check=False,  # the coordinator built every argument
        )
        self.record_swap_in(layer, result, top_k_pos, seq_lens, rows)
        return result

    def shared_after(self, layer: int) -> tuple[int, ...]:
        """The shared layers right after the full ``layer``, whose swap-ins a decode or verify issues
        once this layer's top-k exists (none where ``prefetch_shared`` is off)."""
        return self._shared_after.get(layer, ())

    def prefetch_swap_in(
        self,
        layer: int,
        top_k_pos: torch.Tensor,
        seq_lens: torch.Tensor,
        rows: torch.Tensor,
        near: torch.Tensor | None,
    ) -> PrefetchedSwapIn:
        """``swap_in`` of ``layer`` issued ahead of its attention. On CUDA it runs on the load stream,
        after the work queued so far (the top-k it reads; this step's backups, which the current
        stream was ordered after); ``PrefetchedSwapIn.take`` orders the reader after it. While a
        CUDA graph records, and elsewhere, it runs in order."""
        if self.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return PrefetchedSwapIn(self.swap_in(layer, top_k_pos, seq_lens, rows, near=near))
        if self._load_stream is None:
            self._load_stream = torch.cuda.Stream(self.device)
        load = self._load_stream
        load.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(load):
            result = self.swap_in(layer, top_k_pos, seq_lens, rows, near=near)
        for tensor in (top_k_pos, seq_lens, rows, near):  # (made on the current stream, read here)
            if tensor is not None:
                tensor.record_stream(load)
        done = torch.cuda.Event()
        done.record(load)
        return PrefetchedSwapIn(result, done)

    def record_swap_in(
        self,
        layer: int,
        result: SwapInResult,
        top_k_pos: torch.Tensor,
        seq_lens: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        """Count one swap-in call of ``layer`` (this method's or the compiled attention's, which
        runs the same loop) and report any unrecoverable miss: at once, or, where the counts stay on
        the device until read (``LayerCounters``), when they are read (the call's own tensors,
        which no later call writes, say where)."""

        def report() -> None:
            self._log_unrecoverable(layer, top_k_pos, seq_lens, rows, result)

        self.counters.add_swap_in(layer, result, report)

    def compiled_pools(self) -> hisparse_attend_numba.Pools | None:
        """The views ``kernels.hisparse_attend_numba`` reads, when every pool and table is in CPU
        memory (None otherwise: the step-by-step path serves the layer)."""
        tensors = (
            self.device_kv,
            self.index_k,
            self.buffers.tokens,
            self.host.kv,
            self.req_to_token_device,
            self.req_to_host_device,
        )
        key = tuple(map(id, tensors))  # (the views keep their tensors alive: an id is not reused)
        if self._pools is not None and self._pools[0] == key:
            return self._pools[1]
        if any(t.device.type != "cpu" for t in tensors):
            return None
        if self.device_kv.dtype not in hisparse_attend_numba.DTYPES:  # (numpy has no bfloat16)
            return None
        pools = hisparse_attend_numba.Pools(
            self.device_kv,
            self.index_k,
            self.buffers.tokens,
            self.buffers.locs,
            self.buffers.lru,
            self.host.kv,
            self.req_to_token_device,
            self.req_to_host_device,
        )
        self._pools = (key, pools)
        return pools

    @property
    def policy(self) -> str:
        """The swap-in's replacement policy (``HiSparseConfig.policy``)."""
        return self.plan.policy

    def _log_unrecoverable(
        self,
        layer: int,
        top_k_pos: torch.Tensor,
        seq_lens: torch.Tensor,
        rows: torch.Tensor,
        result: SwapInResult,
    ) -> None:
        """A valid position with no copy anywhere is an invariant violation: say where (warning)."""
        lost = (result.slots < 0) & (top_k_pos >= 0) & (top_k_pos.long() < seq_lens[..., None])
        for b, s, k in torch.nonzero(lost).tolist():
            log.warning(
                "hisparse.unrecoverable_miss",
                row=int(rows[b]),
                layer=layer,
                position=int(top_k_pos[b, s, k]),
            )

    # --- ending ---------------------------------------------------------------------------------

    def release(self, row: int, *, tokens: Sequence[int] | None = None) -> None:
        """Return everything ``row`` owns, in any phase (halfway through its admission too); waits
        for copies that touch its slots.

        With ``tokens`` (the request's known tokens) and a prefix cache, a decoding row's full pages
        whose KV and host copies exist are left to the cache instead of being freed.

        Raises only for a row that is not live. A step that fails is logged and the release goes on
        again from where it stopped (without the cache); a row that still holds memory then is
        finished by every later ``admit``, ``release`` and ``close`` (``reclaim``), and no longer
        counts as live."""
        if row not in self._mem or row in self._leaving:
            raise ValueError(f"request row {row} is not live")
        resumable.release(row, tokens, self._leaving, self._give_back, "hisparse")

    def reclaim(self) -> int:
        """Finish the releases a fault interrupted; returns how many rows still hold memory."""
        return resumable.reclaim(self._leaving, self._give_back, "hisparse")

    def _give_back(self, row: int, tokens: Sequence[int] | None) -> None:
        """``release``'s steps, each one done once however often they are run: what the row still
        owns is what the allocators say it owns."""
        mem = self._mem[row]
        if row in self._staging:
            self._staging.remove(row)
        _wait_logged(mem.staging, row, "staging")
        handing = self.cache is not None and tokens is not None and row not in self._lost
        if handing and mem.layout is Layout.FULL and mem.residency is Residency.RESIDENT:
            self.flush_backup(row)  # the cache keeps the host copies of the pages it takes
        self.settle_backups(mem.backup)
        covered = self.alloc.req_to_token.covered_len(row)
        self.alloc.clear(self.req_to_token[row, :covered])
        # its buffer, its chunk rows and any rows lent to a forward: every device page it owns
        self._lent.pop(row, None)
        mem.chunk_pages = []
        self.set_full(row, None)
        self.buffers.reset(row)
        owned = self.alloc.physical.pages_of(row)
        if owned:
            self.alloc.free_physical(row, sorted(owned))
        if self.cache is not None:
            cacheable = mem.residency is Residency.RESIDENT and row not in self._lost
            if tokens is not None and cacheable:
                self._leave_to_cache(row, mem, tokens)
            if mem.shared:
                self.cache.unlock(mem.shared)
                mem.shared = []
        # (pages the cache took stay its own: however far an earlier try got, the tables say which)
        self.alloc.release_locations(row, handed=self.alloc.req_to_token.handed_pages(row))
        self.host.release(row, handed=self.host.map.handed_pages(row))
        if row in self.rows.in_use():
            self.rows.free(row)
        for failures in (self._staging_failures, self._backup_failures):
            failures.pop(row, None)
        self._lost.discard(row)
        del self._mem[row]
        self._full.discard(row)
        self._leaving.discard(row)

    def _leave_to_cache(self, row: int, mem: RowMemory, tokens: Sequence[int]) -> int:
        """Hand the row's own full pages (KV committed, next token known) to the cache; returns how
        many were handed (its first own pages)."""
        cache = self.cache
        if cache is None:
            return 0
        full = cache.full_pages(mem.length, tokens)
        first = len(mem.shared)
        if full <= first:
            return 0
        logical = self.alloc.req_to_token.pages(row)[first:full]
        host = self.host.map.pages(row)[first:full]
        if len(host) < len(logical):  # a host page not reserved: nothing to cache past it
            logical = logical[: len(host)]
        return cache.insert(tokens, mem.shared, list(zip(logical, host)), row)

    def flush_cache(self) -> int:
        """Evict every cached page no request shares; returns how many."""
        return 0 if self.cache is None else self.cache.flush()

    def close(self) -> None:
        """Finish any interrupted release, wait for every copy in flight and stop the transfer
        workers."""
        self.reclaim()
        self._staging_stream.close()
        self._backup_stream.close()

    # --- figures and checks ---------------------------------------------------------------------

    def device_tensors(self) -> dict[str, torch.Tensor]:
        """Every device tensor, by its name in the memory plan (``pipeline.capacity``)."""
        b = self.buffers
        pools = (
            {ARENA: self.device_kv}
            if self.alloc.arena is not None
            else {"device KV rows": self.device_kv, "indexer keys (every logical location)": self.index_k}
        )
        out = {
            **pools,
            "device buffer slots": b.locs,
            "device buffer positions": b.tokens,
            "device buffer LRU": b.lru,
            "token table": self.req_to_token_device,
            "host map": self.req_to_host_device,
        }
        if self.draft is not None:
            store = self.draft.store  # its token table is the target's
            if not self.draft.rows_on_host:
                out["draft layer KV rows"] = store.kv
            if not self.draft.keys_on_host:
                out["draft layer indexer keys"] = store.index_k
        return out

    def free_counts(self) -> dict[str, int]:
        """Free count of every pool (back at its initial value once nothing is live): pages the
        prefix cache holds for nobody count as free (admission takes them when it needs them)."""
        spare = 0 if self.cache is None else self.cache.evictable()
        return {
            "rows": self.rows.num_free,
            "logical_pages": self.alloc.logical.num_free_pages + spare,
            "physical_pages": self._free_physical(),
            "host_pages": self.host.allocator.num_free_pages + spare,
        }

    def _free_physical(self) -> int:
        """Free physical pages, counting in an arena the frames that evicting the cached pages nobody
        shares would give back."""
        arena = self.alloc.arena
        cached = [] if arena is None or self.cache is None else self.cache.evictable_pages(0)
        if arena is None or not cached:
            return self.alloc.physical.num_free_pages
        return arena.free_pages_after(PHYSICAL, freed_logical=cached)

    def cache_stats(self) -> dict[str, float] | None:
        return None if self.cache is None else self.cache.stats()

    def free_pages(self) -> int:
        return min(self.alloc.physical.num_free_pages, self.host.allocator.num_free_pages)

    def pools(self) -> dict[str, dict[str, int]]:
        """Every pool's free count and capacity (tokens; rows for request rows). ``free`` counts the
        tokens the prefix cache holds for nobody; ``cached`` is everything it holds."""
        spare = 0 if self.cache is None else self.cache.evictable()
        held = 0 if self.cache is None else self.cache.held_pages()
        return {
            "request_rows": {"free": self.rows.num_free, "capacity": self.rows.num_rows},
            "device": _pool(self.alloc.physical, self._free_physical() - self.alloc.physical.num_free_pages),
            "logical": _pool(self.alloc.logical, spare, held),
            "host": _pool(self.host.allocator, spare, held),
        }

    def counters_dict(self) -> dict[str, object]:
        return self.counters.as_dict()

    def transfer_totals(self) -> TransferTotals:
        """The running totals: the same object until a figure changes (a caller may compare by identity)."""
        sums = self.counters.totals()
        if self._totals is None or self._totals[0] is not sums:
            self._totals = (sums, TransferTotals(swap_in=sums[0], prefill=sums[1]))
        return self._totals[1]

    def device_kv_bytes(self, row: int) -> int:
        """Device bytes of MLA KV that ``row`` holds (its buffer and a prefill's chunk rows), all layers."""
        mem = self._mem[row]
        pages = len(mem.chunk_pages) + len(self.buffers.pages(row)) + len(mem.full_pages)
        return pages * self.plan.page_size * self.num_layers * self.row_dim * self.device_kv.element_size()

    def check_integrity(self, *, data: bool = True) -> None:
        """Invariants I1-I8 and I14 of docs/invariants.md (I6 against the host copies when ``data``)."""
        self.rows.check_integrity()
        self.alloc.check_integrity()
        self.host.check_integrity()
        for name, table in (("req_to_token", self.alloc.req_to_token), ("req_to_host", self.host.map)):
            assert table.mirror is not None and torch.equal(table.mirror.tensor.cpu(), table.table), (
                f"{name}: the device mirror disagrees with the table"
            )
        assert set(self._mem) == set(self.rows.in_use()), "coordinator rows disagree with the row pool"
        assert self._full == {row for row, mem in self._mem.items() if mem.layout is Layout.FULL}, (
            "the FULL rows' set disagrees with their layouts"
        )
        if self.cache is not None:
            self.cache.check_integrity(mem.shared for mem in self._mem.values())
        # a row whose release was interrupted is checked by its pools only (it is halfway out)
        live = {row: mem for row, mem in self._mem.items() if row not in self._leaving}
        staged = [r for r, m in live.items() if m.residency is Residency.STAGING]
        assert sorted(staged) == sorted(self._staging), "staging queue disagrees with the rows' residency"
        for row, mem in live.items():
            owned = self.alloc.physical.pages_of(row)
            expect = set(mem.chunk_pages) | set(self.buffers.pages(row)) | set(mem.full_pages)
            assert owned == expect, f"row {row}: owns pages {sorted(owned)}, accounts for {sorted(expect)}"
            assert not (mem.chunk_pages and mem.residency is Residency.RESIDENT), (
                f"row {row}: decodes and still holds chunk rows"
            )
            if mem.layout is Layout.FULL:
                self.layouts.check_full(row, data=data)
                continue
            if mem.residency is not Residency.RESIDENT:
                continue
            self.buffers.check_integrity(row, mem.length)
            copies = self.host.req_to_host[row, : mem.length]
            assert bool((copies >= 0).all()), f"row {row}: a committed position has no host copy"
            if data and row not in self._lost:  # (a row whose backup failed is failed and released)
                self._check_rows(row, mem.length)

    def _check_rows(self, row: int, length: int) -> None:
        """Every column holding a committed position holds that position's KV (its host copy).

        Compares against host copies, so it first waits for the copies in flight.
        """
        self.wait_backups()
        cap = self.buffers.capacity(row)
        for layer in range(self.num_layers):
            held = self.buffers.tokens[layer, row, :cap].long()
            cols = torch.nonzero((held >= 0) & (held < length)).reshape(-1)
            if cols.numel() == 0:
                continue
            dev = self.device_kv[layer, self.buffers.locs[row, cols]].cpu()
            host = self.host.kv[layer, self.host.req_to_host[row, held[cols].cpu()]]
            assert torch.equal(dev, host), f"row {row} layer {layer}: a device row differs from its host copy"


def _copy_failure(what: str, exc: BaseException) -> str:
    return f"{what} copy failed: {type(exc).__name__}: {exc}"


def _wait_logged(handle: TransferHandle, row: int, what: str) -> None:
    """Wait for a copy that touches ``row``'s slots; a failed copy is logged, not raised: the row is
    being released either way, and its slots must be freed all the same."""
    try:
        handle.wait()
    except Exception as exc:  # release never fails; the copy's error is reported here
        log.error("hisparse.copy_failed", row=row, copy=what, error=f"{type(exc).__name__}: {exc}")


def _pool(allocator, spare: int = 0, cached: int = 0) -> dict[str, int]:
    p = allocator.page_size
    return {
        "free": (allocator.num_free_pages + spare) * p,
        "capacity": allocator.capacity_pages * p,
        "cached": cached * p,
    }
