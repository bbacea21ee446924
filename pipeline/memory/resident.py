"""All-resident KV memory: what the engine uses when HiSparse is off.

Every token's KV stays in one device pool addressed by location; a location is its own "slot", there
is nothing to stage and nothing to swap. It implements ``KVMemory`` (``pipeline/memory/interface.py``)
like the HiSparse coordinator, so the executor drives both the same way.

Admission is all or nothing and release goes on from wherever a fault stopped it, as in the
coordinator (``pipeline/hisparse/coordinator.py``, "Faults").
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import attrs
import structlog
import torch

from kernels.kv_fp8 import KVCacheFormat
from pipeline.capacity import MemoryPlan
from pipeline.memory import release as resumable
from pipeline.memory.interface import Residency, ResidencyChange, TransferTotals
from pipeline.memory.paged import OutOfMemory, PagedAllocator, PagedTable
from pipeline.memory.prefix_cache import CachedPage, PrefixCache
from pipeline.memory.req_to_token import RequestRows, token_table
from pipeline.memory.step_inputs import to_device
from pipeline.memory.targets import VerifyLayout, WriteTargets
from pipeline.model.resident import ForwardLayout, ResidentBackend, ResidentKV

log = structlog.get_logger(__name__)
NOTHING_MOVED = TransferTotals()


@attrs.define(eq=False)
class ResidentMemory:
    plan: MemoryPlan
    num_layers: int  # target layers
    num_mtp_layers: int  # the MTP layer's rows live in the same store, after the target's
    row_dim: int
    index_dim: int
    dtype: torch.dtype = torch.float32  # of the pools (uint8 for an FP8 cache)
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    kv_format: KVCacheFormat | None = None  # how rows and keys are stored (None: in ``dtype``)
    rows: RequestRows = attrs.field(init=False)
    allocator: PagedAllocator = attrs.field(init=False)
    store: ResidentKV = attrs.field(init=False)
    _table: PagedTable = attrs.field(init=False)  # req_to_token over the allocator's pages
    _length: dict[int, int] = attrs.field(init=False, factory=dict)
    _ready: collections.deque[int] = attrs.field(init=False, factory=collections.deque)
    _residency: dict[int, Residency] = attrs.field(init=False, factory=dict)
    _shared: dict[int, list[CachedPage]] = attrs.field(init=False, factory=dict)  # row -> cached entries
    _leaving: set[int] = attrs.field(init=False, factory=set)  # rows whose release a fault interrupted
    cache: PrefixCache | None = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        plan = self.plan
        p = plan.page_size
        self.rows = RequestRows(plan.max_running_requests)
        self.allocator = PagedAllocator("kv", plan.device_tokens // p + 1, p, reserve_first_page=True)
        self._table = token_table(self.allocator, plan.max_running_requests, plan.max_request_len)
        # a cached page is a device page: the target's KV, indexer keys and the MTP layer's rows
        self.cache = (
            PrefixCache(p, (self.allocator,), owner=plan.max_running_requests) if plan.prefix_cache else None
        )
        rows = self.allocator.num_pages * p
        layers = self.num_layers + self.num_mtp_layers
        self.store = ResidentKV(
            kv=torch.zeros(layers, rows, self.row_dim, dtype=self.dtype, device=self.device),
            index_k=torch.zeros(layers, rows, self.index_dim, dtype=self.dtype, device=self.device),
            req_to_token=self._table.table.to(self.device),
            format=self.kv_format,
        )

    @property
    def req_to_token(self) -> torch.Tensor:
        return self._table.table

    def length(self, row: int) -> int:
        return self._length[row]

    def live_rows(self) -> list[int]:
        """Rows a request holds (not the ones whose release is still to be finished)."""
        return sorted(set(self._length) - self._leaving)

    def _match(self, tokens: Sequence[int] | None) -> list[CachedPage]:
        return self.cache.match(tokens) if self.cache is not None and tokens is not None else []

    def _admission(
        self, num_tokens: int, tokens: Sequence[int] | None
    ) -> tuple[list[CachedPage], int] | None:
        """(the cached chain it shares, the pages it needs) when a prompt fits, counting the cached
        pages nobody else shares as free; None when it does not."""
        if not self.rows.can_allocate():
            return None
        chain = self._match(tokens)
        need = -(-num_tokens // self.plan.page_size) - len(chain)
        spare = 0 if self.cache is None else self.cache.spare(chain)
        return (chain, need) if self.allocator.num_free_pages + spare >= need else None

    def can_admit(
        self,
        num_tokens: int,
        *,
        speculative: bool = False,
        tokens: Sequence[int] | None = None,
        final: int | None = None,
    ) -> bool:
        """A row and pages for the prompt (``tokens``, when given, may share cached pages, and
        cached pages nobody shares count as free)."""
        return self._admission(num_tokens, tokens) is not None

    def admit(
        self,
        num_tokens: int,
        *,
        speculative: bool = False,
        tokens: Sequence[int] | None = None,
        final: int | None = None,
    ) -> int:
        """A row and locations for the prompt; the longest cached prefix of ``tokens`` is shared
        (its positions count as computed). All or nothing: when anything on the way raises, what
        the row got goes back (``release``) and the error propagates."""
        self.reclaim()
        admission = self._admission(num_tokens, tokens)
        if admission is None:
            raise OutOfMemory(
                "kv admission", -(-num_tokens // self.plan.page_size), self.allocator.num_free_pages
            )
        chain, need = admission
        if self.cache is not None:  # without tokens it matched nothing, and looked nothing up
            self.cache.share(chain, (need,), num_tokens if tokens is not None else 0)
        try:
            row = self.rows.allocate()
        except BaseException:
            if self.cache is not None:
                self.cache.unlock(chain)
            raise
        # from here on the row owns what it gets, and ``release`` gives back whatever that is
        self._length[row], self._shared[row], self._residency[row] = 0, chain, Residency.PREFILL
        try:
            self._table.share(row, [e.pages[0] for e in chain])
            self._table.cover(row, num_tokens)
            self.store.req_to_token[row] = to_device(self.device, self._table.table[row])[0]
        except BaseException:
            self.release(row)
            raise
        self._length[row] = len(chain) * self.plan.page_size
        return row

    def prefill_targets(self, row: int, start: int, end: int) -> WriteTargets:
        """The locations of positions ``[start, end)``: every position is resident, so a later chunk
        reads the earlier ones in place."""
        (locs,) = to_device(self.device, self._table.table[row, start:end])
        return WriteTargets(locs, locs)

    def commit_prefill(self, row: int, start: int, end: int, *, final: bool) -> None:
        self._length[row] = end

    def start_staging(self, row: int, length: int) -> None:
        """Nothing to copy: the request is ready at once (still in FIFO order)."""
        assert self._length[row] == length, (row, self._length[row], length)
        self._residency[row] = Residency.STAGING
        self._ready.append(row)

    def staging_rows(self) -> list[int]:
        return []

    def wait_staging(self) -> None:
        return None

    def collect_ready(self, rows: list[int] | None = None, *, speculative: bool = False) -> list[int]:
        wanted = None if rows is None else set(rows)
        ready = [r for r in self._ready if wanted is None or r in wanted]
        for row in ready:
            self._ready.remove(row)
            self._residency[row] = Residency.RESIDENT
        return ready

    def residency(self, row: int) -> Residency:
        return self._residency[row]

    def take_staging_failures(self) -> dict[int, str]:
        return {}

    def take_backup_failures(self, rows: list[int]) -> dict[int, str]:
        """Nothing is backed up: nothing fails."""
        return {}

    def can_decode(self, row: int, *, new_tokens: int = 1, speculative: bool = False) -> bool:
        end = self._length[row] + new_tokens
        if self.cache is not None and end <= self.plan.max_request_len:
            self.cache.make_room((self._table.pages_needed(row, end),))  # unshared cached pages give way
        return self._table.can_cover(row, end)

    def ensure_capacity(self, row: int, *, new_tokens: int, speculative: bool) -> None:
        end = self._length[row] + new_tokens
        if not self.can_decode(row, new_tokens=new_tokens):
            raise OutOfMemory("kv decode", self._table.pages_needed(row, end), self.allocator.num_free_pages)
        if self._table.cover(row, end):  # (one asynchronous copy on CUDA: ``step_inputs``)
            self.store.req_to_token[row] = to_device(self.device, self._table.table[row])[0]

    def prepare_decode(self, rows: list[int]) -> WriteTargets:
        locs = []
        for row in rows:
            self.ensure_capacity(row, new_tokens=1, speculative=False)
            locs.append(self._table.table[row, self._length[row]])
        (out,) = to_device(self.device, torch.stack(locs))
        return WriteTargets(out, out)

    def commit_decode(self, rows: list[int], slots: torch.Tensor, num_new: list[int] | None = None) -> None:
        for row, count in zip(rows, num_new or [1] * len(rows)):
            self._length[row] += count

    def backend(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        locs: torch.Tensor,
        slots: torch.Tensor,
        *,
        steps: int = 0,
        chunk_starts: torch.Tensor | None = None,
        trace: object = None,
        labels: dict[int, str] | None = None,
    ) -> ResidentBackend:
        """The attention backend of one forward (the same call for prefill, decode and verify)."""
        backend = ResidentBackend(self.store)
        backend.begin(ForwardLayout(rows, positions, locs))
        return backend

    def prepare_verify(self, rows: list[int], draft_tokens: int) -> VerifyLayout:
        """Locations for the D verify tokens of each row (their KV lands there directly)."""
        locs = []
        for row in rows:
            self.ensure_capacity(row, new_tokens=draft_tokens, speculative=True)
            n = self._length[row]
            locs.append(self._table.table[row, n : n + draft_tokens])
        (out,) = to_device(self.device, torch.cat(locs))
        return VerifyLayout(WriteTargets(out, out), draft_tokens, tuple(rows))

    def finalize_verify(self, rows: list[int], accepted: list[int], layout: VerifyLayout) -> list[int]:
        """Nothing moves: the accepted rows are already where they belong; rejected ones are
        overwritten next round (their locations stay with the request)."""
        for row, count in zip(rows, accepted):
            self._length[row] += count
        return []

    def take_failure(self, row: int) -> None:
        return None

    def draft_backend(
        self, rows: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor
    ) -> ResidentBackend:
        """The MTP layer's rows live in the same store, after the target's layers."""
        return self.backend(rows, positions, locs, locs)

    def release(self, row: int, *, tokens: Sequence[int] | None = None) -> None:
        """Free the row (halfway through its admission too); with ``tokens`` (its known tokens) and
        a prefix cache, a decoding row's full pages whose KV and next token exist are left to the
        cache. Raises only for a row that is not live: a step that fails is logged and the release
        goes on again from where it stopped (without the cache); a row that still holds memory then
        is finished by every later ``admit``, ``release`` and ``close`` (``reclaim``), and no longer
        counts as live."""
        if row not in self._length or row in self._leaving:
            raise ValueError(f"request row {row} is not live")
        resumable.release(row, tokens, self._leaving, self._give_back, "memory")

    def reclaim(self) -> int:
        """Finish the releases a fault interrupted; returns how many rows still hold memory."""
        return resumable.reclaim(self._leaving, self._give_back, "memory")

    def _give_back(self, row: int, tokens: Sequence[int] | None) -> None:
        """``release``'s steps, each one done once however often they are run."""
        if row in self._ready:
            self._ready.remove(row)
        shared = self._shared[row]
        if self.cache is not None:
            if tokens is not None and self._residency[row] is Residency.RESIDENT:
                full = self.cache.full_pages(self._length[row], tokens)
                own = [(page,) for page in self._table.pages(row)[len(shared) : full]]
                self.cache.insert(tokens, shared, own, row)
            if shared:
                self.cache.unlock(shared)
                self._shared[row] = []
        # (pages the cache took stay its own: however far an earlier try got, the table says which)
        self._table.release(row, handed=self._table.handed_pages(row))
        self.store.req_to_token[row] = 0
        if row in self.rows.in_use():
            self.rows.free(row)
        del self._length[row], self._residency[row], self._shared[row]
        self._leaving.discard(row)

    def end_forward(self) -> None:
        """Nothing is lent to a resident forward."""

    def close(self) -> None:
        """Finish any interrupted release."""
        self.reclaim()

    def free_counts(self) -> dict[str, int]:
        """Free count of every pool (back at its initial value once nothing is live): pages the
        prefix cache holds for nobody count as free."""
        spare = 0 if self.cache is None else self.cache.evictable()
        return {"rows": self.rows.num_free, "kv_pages": self.allocator.num_free_pages + spare}

    def flush_cache(self) -> int:
        return 0 if self.cache is None else self.cache.flush()

    def cache_stats(self) -> dict[str, float] | None:
        return None if self.cache is None else self.cache.stats()

    def free_pages(self) -> int:
        return self.allocator.num_free_pages

    def pools(self) -> dict[str, dict[str, int]]:
        """Every pool's free count and capacity (tokens; rows for request rows)."""
        p = self.plan.page_size
        spare = 0 if self.cache is None else self.cache.evictable()
        held = 0 if self.cache is None else self.cache.held_pages()
        return {
            "request_rows": {"free": self.rows.num_free, "capacity": self.rows.num_rows},
            "device": {
                "free": (self.allocator.num_free_pages + spare) * p,
                "capacity": self.allocator.capacity_pages * p,
                "cached": held * p,
            },
        }

    def counters_dict(self) -> None:
        return None

    def transfer_totals(self) -> TransferTotals:
        return NOTHING_MOVED  # every row is resident: nothing is ever swapped in

    def device_tensors(self) -> dict[str, torch.Tensor]:
        """Every device tensor, by its name in the memory plan (``pipeline.capacity``)."""
        store = self.store
        return {"KV rows (target and draft layers)": store.kv, "indexer keys": store.index_k,
                "token table": store.req_to_token}

    def device_kv_bytes(self, row: int) -> int:
        """Device bytes of the target's MLA KV that ``row`` holds, all target layers."""
        pages = len(self._table.pages(row))
        return pages * self.plan.page_size * self.num_layers * self.row_dim * self.store.kv.element_size()

    def rebalance(self) -> None:
        """Nothing to move: every row is on the device (dynamic residency is HiSparse's)."""

    def take_residency_changes(self) -> list[ResidencyChange]:
        return []

    def residency_stats(self) -> None:
        return None

    def check_integrity(self, *, data: bool = True) -> None:
        self.rows.check_integrity()
        self.allocator.check_integrity()
        self._table.check_integrity()
        assert set(self._length) == set(self.rows.in_use()), "resident rows disagree with the row pool"
        assert set(self._residency) == set(self._length), "resident rows without a residency"
        if self.cache is not None:
            self.cache.check_integrity(self._shared.values())
        # (a row whose release was interrupted is checked by its pools only: it is halfway out)
        staged = [
            r for r, phase in self._residency.items() if phase is Residency.STAGING and r not in self._leaving
        ]
        assert sorted(staged) == sorted(self._ready), "the ready queue disagrees with the rows' residency"
