"""Stateful property test of the memory layer.

A hypothesis ``RuleBasedStateMachine`` interleaves prefill allocations, staging copies, device-buffer
allocations, decode allocations (with buffer growth), finishes, aborts (in every phase), bad frees
and over-capacity requests across many requests. After every rule every ``check_integrity()`` runs,
the test's own model of who owns what must agree with the allocators, the token table, the host map
and the logical-to-physical map equal its shadow model entry for entry (``shadow_model``), and the
mirrors of ``req_to_token`` and ``req_to_host`` (distinct tensors here) equal the tables: every
change, a rolled-back transaction included, reached them. When every request has ended, every pool
is back at its initial free count.
"""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
import pytest
import torch
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from shadow_model import PositionModel, check_tables, machine_settings

from pipeline.memory import (
    HiSparseAllocator,
    HostPool,
    OutOfMemory,
    OwnershipError,
    RequestRows,
    page_slots,
    round_up,
)

PAGE = 4
HOT = 8  # hot columns; the buffer of a long request has HOT + PAGE columns
ROWS = 5
MAX_LEN = 48


@attrs.define
class Req:
    row: int
    length: int  # committed positions
    phase: str  # "prefill" (staging) or "decode"
    prefill_pages: list[int]
    prefill_locs: torch.Tensor
    buffer_pages: list[int] = attrs.Factory(list)
    mapped: dict[int, int] = attrs.Factory(dict)  # the shadow model: position -> the slot it maps to

    @property
    def physical_pages(self) -> list[int]:
        return self.prefill_pages if self.phase == "prefill" else self.buffer_pages


class MemoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.rows = RequestRows(ROWS)
        self.alloc = HiSparseAllocator(
            page_size=PAGE, logical_tokens=96, device_tokens=40, num_rows=ROWS, max_len=MAX_LEN
        )
        self.host = HostPool(
            num_layers=2, host_tokens=96, row_dim=3, page_size=PAGE, num_rows=ROWS, max_len=MAX_LEN
        )
        self.mirrors = {
            "req_to_token": self.alloc.req_to_token.mirror_on(torch.device("cpu"), separate=True),
            "req_to_host": self.host.map.mirror_on(torch.device("cpu"), separate=True),
        }
        self.reqs: dict[int, Req] = {}
        self.initial = self._free_counts()

    def _free_counts(self) -> tuple[int, ...]:
        return (
            self.rows.num_free,
            self.alloc.logical.num_free_pages,
            self.alloc.physical.num_free_pages,
            self.host.allocator.num_free_pages,
        )

    # --- rules ----------------------------------------------------------------------------------

    @rule(length=st.integers(1, 30))
    def start_request(self, length: int) -> None:
        """Prefill: both levels bound, host pages reserved and the staging copy recorded."""
        if not self.rows.can_allocate():
            with pytest.raises(OutOfMemory) as refused:
                self.rows.allocate()
            assert (refused.value.requested, refused.value.free) == (1, 0)
            return
        row = self.rows.allocate()
        before = self._free_counts()
        if not self.alloc.can_alloc_prefill(row, length):
            with pytest.raises(OutOfMemory):
                self.alloc.alloc_prefill(row, length)
        elif not self.host.can_reserve(row, length):
            with pytest.raises(OutOfMemory, match="host"):
                self.host.reserve(row, length)
        else:
            before = None
        if before is not None:  # refused: nothing may have changed
            assert self._free_counts() == before
            self.rows.free(row)
            return
        got = self.alloc.alloc_prefill(row, length)
        assert torch.equal(self.alloc.lookup(got.locs), got.slots)
        assert torch.equal(self.alloc.req_to_token.table[row, :length], got.locs)
        self.host.reserve(row, length)
        self.host.record(row, torch.arange(length))
        slots = page_slots(got.physical_pages, PAGE)[:length].tolist()  # bound 1:1, in page order
        self.reqs[row] = Req(
            row, length, "prefill", got.physical_pages, got.locs, mapped=dict(enumerate(slots))
        )

    @precondition(lambda self: any(r.phase == "prefill" for r in self.reqs.values()))
    @rule(data=st.data())
    def collect_ready(self, data) -> None:
        """Staging done: the device buffer reuses the prefill pages; every prefill mapping goes to 0."""
        req = data.draw(
            st.sampled_from(
                sorted((r for r in self.reqs.values() if r.phase == "prefill"), key=lambda r: r.row)
            )
        )
        need = min(round_up(req.length, PAGE), HOT)
        if req.length >= HOT:
            need = HOT + PAGE
        short = need // PAGE - len(req.prefill_pages)
        if short > 0 and not self.alloc.physical.can_allocate(short):
            before = self.alloc.snapshot()
            with pytest.raises(OutOfMemory):
                self.alloc.alloc_device_buffer(req.row, req.prefill_pages, req.prefill_locs, need)
            assert torch.equal(before.mapping, self.alloc.logical_to_physical)
            return
        pages = self.alloc.alloc_device_buffer(req.row, req.prefill_pages, req.prefill_locs, need)
        assert pages[: len(req.prefill_pages)] == req.prefill_pages[: len(pages)]
        assert int(self.alloc.lookup(req.prefill_locs).abs().sum()) == 0
        req.phase, req.buffer_pages, req.mapped = "decode", pages, {}

    @precondition(lambda self: any(r.phase == "decode" for r in self.reqs.values()))
    @rule(data=st.data(), steps=st.integers(1, 6))
    def decode(self, data, steps: int) -> None:
        """Decode: logical-only locations, a grown buffer once long, every token backed up."""
        req = data.draw(
            st.sampled_from(
                sorted((r for r in self.reqs.values() if r.phase == "decode"), key=lambda r: r.row)
            )
        )
        for _ in range(steps):
            new_len = req.length + 1
            if new_len > MAX_LEN:
                return
            cap = len(req.buffer_pages) * PAGE
            want = HOT + PAGE if new_len >= HOT else min(round_up(new_len, PAGE), HOT)
            grow = max(0, want - cap) // PAGE
            ok = (
                self.alloc.can_extend(req.row, new_len)
                and self.alloc.physical.can_allocate(grow)
                and self.host.can_reserve(req.row, new_len)
            )
            if not ok:
                return
            self.alloc.extend(req.row, new_len)
            req.buffer_pages += self.alloc.alloc_physical(req.row, grow)
            self.host.reserve(req.row, new_len)
            self.host.record(req.row, torch.tensor([req.length]))
            loc = self.alloc.req_to_token.table[req.row, req.length]
            slot = req.buffer_pages[min(req.length, HOT) // PAGE] * PAGE + min(req.length, HOT) % PAGE
            self.alloc.clear(self.alloc.req_to_token.table[req.row, : req.length])  # the old newest
            self.alloc.bind(loc.reshape(1), torch.tensor([slot]))
            req.mapped = {req.length: slot}
            req.length = new_len

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data())
    def end_request(self, data) -> None:
        """Finish or abort, in either phase: everything the request owns goes back exactly once."""
        self._release(data.draw(st.sampled_from(sorted(self.reqs))))

    def _release(self, row: int) -> None:
        req = self.reqs.pop(row)
        # (the coordinator clears the map first; here ``release_locations`` must clear it itself)
        self.alloc.free_physical(row, req.physical_pages)
        self.alloc.release_locations(row)
        self.host.release(row)
        self.rows.free(row)

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), kind=st.sampled_from(["other", "double", "reserved", "range", "dup"]))
    def bad_free(self, data, kind: str) -> None:
        """A bad free raises a clear error and changes nothing."""
        row = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[row]
        others = [p for r in self.reqs.values() if r.row != row for p in r.physical_pages]
        free_pages = [
            p for p in range(1, self.alloc.physical.num_pages) if self.alloc.physical.owner_of(p) < 0
        ]
        page = {
            "other": others[0] if others else None,
            "double": free_pages[0] if free_pages else None,
            "reserved": 0,
            "range": self.alloc.physical.num_pages + 3,
            "dup": req.physical_pages[0] if req.physical_pages else None,
        }[kind]
        if page is None:
            return
        pages = [page, page] if kind == "dup" else [*req.physical_pages[:1], page]
        before = self.alloc.snapshot()
        with pytest.raises(OwnershipError, match="cannot free page"):
            self.alloc.free_physical(row, pages)
        after = self.alloc.snapshot()
        assert before.physical == after.physical

    @rule(pages=st.integers(1, 40))
    def over_capacity(self, pages: int) -> None:
        """Asking for more than is free raises and changes nothing."""
        free = self.alloc.physical.num_free_pages
        if pages <= free:
            return
        before = self.alloc.physical.snapshot()
        with pytest.raises(OutOfMemory, match="physical") as refused:
            self.alloc.alloc_physical(0, pages)
        assert (refused.value.requested, refused.value.free) == (pages, free)
        assert self.alloc.physical.snapshot() == before

    @precondition(lambda self: any(r.physical_pages for r in self.reqs.values()))
    @rule(data=st.data())
    def free_and_take_back(self, data) -> None:
        """A transaction's undo: pages freed and taken back leave the pool exactly as it was; a take
        naming a page that is not free (twice, reserved, owned, out of range) or no owner raises and
        changes nothing."""
        req = data.draw(
            st.sampled_from(sorted((r for r in self.reqs.values() if r.physical_pages), key=lambda r: r.row))
        )
        pool = self.alloc.physical
        before = pool.snapshot()
        pages = req.physical_pages[: data.draw(st.integers(1, len(req.physical_pages)))]
        pool.free(pages, req.row)
        freed = pool.snapshot()
        bad = data.draw(st.sampled_from([[pages[0], pages[0]], [*pages, 0], [pages[0], pool.num_pages]]))
        others = [p for r in self.reqs.values() if r.row != req.row for p in r.physical_pages]
        if others and data.draw(st.booleans()):
            bad = [*pages, others[0]]
        with pytest.raises(OwnershipError):
            pool.take(bad, req.row)
        with pytest.raises(ValueError, match="owner"):
            pool.take(pages, -1)
        assert pool.snapshot() == freed
        pool.take(pages, req.row)
        assert pool.pages_of(req.row) == frozenset(req.physical_pages)
        assert sorted(pool.snapshot().free) == sorted(before.free)
        assert pool.snapshot().owner == before.owner

    @precondition(lambda self: any(r.phase == "decode" for r in self.reqs.values()))
    @rule(data=st.data())
    def cover_to_the_limit(self, data) -> None:
        """A row's locations reach ``MAX_LEN`` exactly (when the pool has the pages), never past
        it: asking for more raises and changes nothing."""
        decoding = sorted((r for r in self.reqs.values() if r.phase == "decode"), key=lambda r: r.row)
        req = data.draw(st.sampled_from(decoding))
        before = self.alloc.snapshot()
        assert not self.alloc.can_extend(req.row, MAX_LEN + 1)
        with pytest.raises(ValueError, match="cannot hold"):
            self.alloc.extend(req.row, MAX_LEN + 1)
        after = self.alloc.snapshot()
        assert before.logical == after.logical and torch.equal(before.table, after.table)
        table = self.alloc.req_to_token
        fits = table.pages_needed(req.row, MAX_LEN) <= self.alloc.logical.num_free_pages
        assert self.alloc.can_extend(req.row, MAX_LEN) == fits
        if fits:
            self.alloc.extend(req.row, MAX_LEN)
            assert table.covered_len(req.row) == round_up(MAX_LEN, PAGE)

    @rule(length=st.integers(1, 12))
    def snapshot_restore(self, length: int) -> None:
        """A transaction rolled back leaves no trace."""
        if not self.rows.can_allocate():
            return
        before = self.alloc.snapshot()
        row = self.rows.allocate()
        try:
            if self.alloc.can_alloc_prefill(row, length):
                self.alloc.alloc_prefill(row, length)
        finally:
            self.alloc.restore(before)
            self.rows.free(row)
        after = self.alloc.snapshot()
        assert before.logical == after.logical and before.physical == after.physical
        assert torch.equal(before.mapping, after.mapping) and torch.equal(before.table, after.table)

    # --- invariants -----------------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        self.rows.check_integrity()
        self.alloc.check_integrity()
        self.host.check_integrity()
        for row, req in self.reqs.items():
            assert self.alloc.physical.pages_of(row) == frozenset(req.physical_pages)
            assert bool((self.host.req_to_host[row, : req.length] >= 0).all()), (
                "a committed token has no copy"
            )
        assert self.alloc.physical.owners() == sorted(r for r, q in self.reqs.items() if q.physical_pages)

    @invariant()
    def tables_match_the_model(self) -> None:
        """The token table, the host map and the map equal the shadow model, entry for entry."""
        models = {f"row {r}": PositionModel(r, q.length, q.mapped) for r, q in self.reqs.items()}
        check_tables(models, self.alloc, self.host.map)

    @invariant()
    def mirrors_match_tables(self) -> None:
        for name, mirror in self.mirrors.items():
            assert mirror.tensor is not mirror.host, f"{name}: the mirror should be a distinct tensor"
            assert torch.equal(mirror.tensor, mirror.host), f"{name}: the mirror missed an update"

    def teardown(self) -> None:
        for row in list(self.reqs):
            self._release(row)
        self.integrity()
        assert self._free_counts() == self.initial, "a pool did not return to its initial free count"


TestMemoryMachine = pytest.mark.proptest(MemoryMachine.TestCase)
TestMemoryMachine.settings = machine_settings(examples=60, steps=40)
