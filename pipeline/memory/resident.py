"""All-resident KV memory: what the engine uses when HiSparse is off.

Every token's KV stays in one device pool addressed by location; a location is its own "slot", there
is nothing to stage and nothing to swap. It implements ``KVMemory`` (``pipeline/memory/interface.py``)
like the HiSparse coordinator, so the executor drives both the same way.
"""

from __future__ import annotations

import collections

import attrs
import torch

from pipeline.config import MemoryPlan
from pipeline.memory.interface import Residency
from pipeline.memory.paged import OutOfMemory, PagedAllocator, PagedTable
from pipeline.memory.req_to_token import RequestRows, token_table
from pipeline.memory.targets import VerifyLayout, WriteTargets
from pipeline.model.resident import ForwardLayout, ResidentBackend, ResidentKV


@attrs.define(eq=False)
class ResidentMemory:
    plan: MemoryPlan
    num_layers: int  # target layers
    num_mtp_layers: int  # the MTP layer's rows live in the same store, after the target's
    row_dim: int
    index_dim: int
    dtype: torch.dtype = torch.float32
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    rows: RequestRows = attrs.field(init=False)
    allocator: PagedAllocator = attrs.field(init=False)
    store: ResidentKV = attrs.field(init=False)
    _table: PagedTable = attrs.field(init=False)  # req_to_token over the allocator's pages
    _length: dict[int, int] = attrs.field(init=False, factory=dict)
    _ready: collections.deque[int] = attrs.field(init=False, factory=collections.deque)
    _residency: dict[int, Residency] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        plan = self.plan
        p = plan.page_size
        self.rows = RequestRows(plan.max_running_requests)
        self.allocator = PagedAllocator("kv", plan.device_tokens // p + 1, p, reserve_first_page=True)
        self._table = token_table(self.allocator, plan.max_running_requests, plan.max_request_len)
        rows = self.allocator.num_pages * p
        layers = self.num_layers + self.num_mtp_layers
        self.store = ResidentKV(
            kv=torch.zeros(layers, rows, self.row_dim, dtype=self.dtype, device=self.device),
            index_k=torch.zeros(layers, rows, self.index_dim, dtype=self.dtype, device=self.device),
            req_to_token=self._table.table.to(self.device),
        )

    @property
    def req_to_token(self) -> torch.Tensor:
        return self._table.table

    def length(self, row: int) -> int:
        return self._length[row]

    def live_rows(self) -> list[int]:
        return sorted(self._length)

    def can_admit(self, num_tokens: int, *, speculative: bool = False) -> bool:
        return self.rows.can_allocate() and self.allocator.can_allocate(-(-num_tokens // self.plan.page_size))

    def admit(self, num_tokens: int, *, speculative: bool = False) -> int:
        if not self.can_admit(num_tokens):
            raise OutOfMemory(
                "kv admission", -(-num_tokens // self.plan.page_size), self.allocator.num_free_pages
            )
        row = self.rows.allocate()
        self._table.cover(row, num_tokens)
        self.store.req_to_token[row] = self._table.table[row].to(self.device)
        self._length[row] = 0
        self._residency[row] = Residency.PREFILL
        return row

    def prefill_targets(self, row: int, start: int, end: int) -> WriteTargets:
        """The locations of positions ``[start, end)``: every position is resident, so a later chunk
        reads the earlier ones in place."""
        locs = self._table.table[row, start:end].to(self.device)
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

    def can_decode(self, row: int, *, new_tokens: int = 1, speculative: bool = False) -> bool:
        end = self._length[row] + new_tokens
        return self._table.can_cover(row, end)

    def ensure_capacity(self, row: int, *, new_tokens: int, speculative: bool) -> None:
        end = self._length[row] + new_tokens
        if not self._table.can_cover(row, end):
            raise OutOfMemory("kv decode", self._table.pages_needed(row, end), self.allocator.num_free_pages)
        if self._table.cover(row, end):
            self.store.req_to_token[row] = self._table.table[row].to(self.device)

    def prepare_decode(self, rows: list[int]) -> WriteTargets:
        locs = []
        for row in rows:
            self.ensure_capacity(row, new_tokens=1, speculative=False)
            locs.append(self._table.table[row, self._length[row]])
        out = torch.stack(locs).to(self.device)
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
        out = torch.cat(locs).to(self.device)
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

    def release(self, row: int) -> None:
        self._length.pop(row)
        self._residency.pop(row)
        if row in self._ready:
            self._ready.remove(row)
        self._table.release(row)
        self.store.req_to_token[row] = 0
        self.rows.free(row)

    def close(self) -> None:
        return None

    def free_counts(self) -> dict[str, int]:
        """Free count of every pool (back at its initial value once nothing is live)."""
        return {"rows": self.rows.num_free, "kv_pages": self.allocator.num_free_pages}

    def free_pages(self) -> int:
        return self.allocator.num_free_pages

    def pools(self) -> dict[str, dict[str, int]]:
        """Every pool's free count and capacity (tokens; rows for request rows)."""
        p = self.plan.page_size
        return {
            "request_rows": {"free": self.rows.num_free, "capacity": self.rows.num_rows},
            "device": {
                "free": self.allocator.num_free_pages * p,
                "capacity": self.allocator.capacity_pages * p,
            },
        }

    def counters_dict(self) -> None:
        return None

    def device_tensors(self) -> dict[str, torch.Tensor]:
        """Every device tensor, by its name in the memory plan (``pipeline.capacity``)."""
        store = self.store
        return {"KV rows (target and draft layers)": store.kv, "indexer keys": store.index_k,
                "token table": store.req_to_token}

    def device_kv_bytes(self, row: int) -> int:
        """Device bytes of the target's MLA KV that ``row`` holds, all target layers."""
        pages = len(self._table.pages(row))
        return pages * self.plan.page_size * self.num_layers * self.row_dim * self.store.kv.element_size()

    def check_integrity(self, *, data: bool = True) -> None:
        self.rows.check_integrity()
        self.allocator.check_integrity()
        self._table.check_integrity()
        assert set(self._length) == set(self.rows.in_use()), "resident rows disagree with the row pool"
        assert set(self._residency) == set(self._length), "resident rows without a residency"
        staged = [r for r, phase in self._residency.items() if phase is Residency.STAGING]
        assert sorted(staged) == sorted(self._ready), "the ready queue disagrees with the rows' residency"
