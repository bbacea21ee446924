"""Stateful property test of dynamic residency: requests demoted and promoted at every step boundary.

The rules of the HiSparse executor machine (``test_executor_machine``: admissions, copies landing at
arbitrary times, staging collection, decode steps, finishes and aborts in every phase, a device pool
small enough that memory pressure is real), with ``residency="dynamic"``, plus ``demote`` and
``promote`` of a decoding request chosen by the test and the coordinator's own ``rebalance``, each
also right after a decode step (whose backups are then in flight, as where the executor rebalances).
Variants prefill in chunks, and run speculative rounds (``SpecMachine``'s draft and verify) over FULL
and HOT requests together. The tokens equal the all-resident shadow's after every rule. Its shadow
model of each request (``RowModel``) is its layout (what admission chose, then changed only by a
demotion, which the residency figures count, or a promotion), its committed positions and, while
FULL, the device slot of each position (learnt when the position first has one, then fixed until the
request's layout changes). An admission is refused only when ``can_admit`` says no, demotions
counted (the progress guarantee). After every rule:

* no position lost: every committed position of a FULL request maps to a device slot holding its KV
  (every layer, against the shadow, without waiting for any copy); a hot column holding a position
  holds its KV (``check_device_kv``); every committed position has a host copy (the host map), equal
  to the shadow's KV whenever no copy is in flight, but a FULL request's newest partial page: its
  positions past those it had when it became FULL have host copies page by page, as each page
  fills (the model's ``backed``), and none before;
* no row aliased: every device slot a request reads (its buffer's columns, the slots its locations
  map to) lies in a page that request owns; a FULL request's positions have distinct slots, none a
  column that holds another position; a HOT request's mapped locations map to its own columns;
  nothing else is mapped (``check_tables``);
* the host copy is complete before any device row is dropped: right after a demotion, with the copies
  still in flight left so, every committed position's host copy equals the shadow's KV; a demotion
  keeps some of the request's pages (its hot buffer) and takes no new one;
* ``check_integrity()``; the residency figures (``residency_stats``) count the requests of each
  layout and every move; a promotion copies no more than the request's context; ``rebalance``
  promotes at most one request, the smallest context of those not demoted within
  ``PROMOTE_AFTER`` decode steps, and leaves the headroom free;
* ending a request frees exactly what it owned; with nothing live every pool is back at its initial
  free count.

Planted defects (a demotion that drops device rows before the row's backups landed, one that leaves
a FULL row's newest partial page without a host copy, a promotion that copies host rows before they
landed, a promotion that leaves a location unmapped) must each be caught by this machine alone
(``test_*_is_caught``, in the manner of ``tests/statemachines/test_planted_defects.py``).
"""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import initialize, precondition, rule, run_state_machine_as_test
from shadow_model import (
    PositionModel,
    check_tables,
    last_chunk_start,
    machine_settings,
    prefilled,
    verify_columns,
)
from speculative.test_spec_machine import SpecMachine
from test_executor_machine import ExecutorMachine

from pipeline.config import HiSparseConfig
from pipeline.driver import prefill_whole
from pipeline.executor import NewSequence
from pipeline.hisparse.coordinator import HiSparseCoordinator
from pipeline.hisparse.residency import BACKUP_PAGES, PROMOTE_AFTER, DynamicResidency
from pipeline.memory import OutOfMemory, page_slots
from pipeline.memory.interface import Layout
from pipeline.memory.targets import VerifyLayout

from shadowed_machine import GREEDY

DYNAMIC = HiSparseConfig(device_buffer_size=8, host_to_device_ratio=3, residency="dynamic")


@attrs.define
class RowModel:
    """What the test knows of a request's layout (from its admission on)."""

    layout: Layout
    slots: dict[int, int] = attrs.Factory(dict)  # FULL: position -> its device slot, once seen
    demoted_at: int | None = None  # the decode steps made before its last demotion
    # FULL: its positions with host copies: those it had when it became FULL (its prompt, or its
    # context when promoted), then up to its last backup (made once BACKUP_PAGES filled pages wait:
    # ``committed``)
    base: int = 0


class ResidencyMachine(ExecutorMachine):
    config = attrs.evolve(ExecutorMachine.config, hisparse=DYNAMIC)

    def __init__(self) -> None:
        super().__init__()
        self.layouts: dict[str, RowModel] = {}  # every live request's, from its admission on
        self.moves = {"demotions": 0, "promotions": 0}  # the figures the model expects
        self.ticks = 0  # decode steps (decode and verify forwards that committed tokens)
        self.allow_promotion = False  # only promote and rebalance may promote

    # --- helpers ------------------------------------------------------------------------------

    @property
    def coord(self) -> HiSparseCoordinator:
        return self.executor.memory

    def row(self, rid: str) -> int:
        return self.executor.seqs[rid].row

    def decoding(self, layout: Layout, phases: tuple[str, ...] = ("decode",)) -> list[str]:
        """The decoding requests of ``layout`` (``phases``: between rounds; with "drafted", also
        between draft and verify)."""
        return sorted(
            rid for rid, m in self.layouts.items() if m.layout is layout and self.phase[rid] in phases
        )

    def page_bytes(self) -> int:
        coord = self.coord
        return coord.plan.page_size * coord.num_layers * coord.row_dim * coord.device_kv.element_size()

    def backed(self, rid: str) -> int:
        """The positions of ``rid`` that must have host copies: all its committed ones, but those of
        a FULL decoding request past its last backup."""
        model, layout = self.models[rid], self.layouts[rid]
        if layout.layout is Layout.HOT or self.phase[rid] not in ("decode", "drafted"):
            return model.length
        return layout.base

    def committed(self, rid: str, count: int) -> None:
        """``rid`` committed ``count`` more positions; a FULL request backs up its filled pages once
        ``BACKUP_PAGES`` of them wait."""
        model, layout = self.models[rid], self.layouts[rid]
        model.length += count
        page = self.coord.plan.page_size
        if layout.layout is Layout.FULL and model.length // page * page - layout.base >= BACKUP_PAGES * page:
            layout.base = model.length // page * page

    def check_host_kv(self) -> None:
        """Every position that must have a host copy (``backed``) has its KV there (once every copy
        has landed)."""
        coord = self.coord
        every = torch.arange(coord.num_layers)[:, None]
        for rid in self.phase:
            positions = torch.arange(self.backed(rid))
            host_kv = coord.host.kv[:, coord.host.req_to_host[self.row(rid), positions]]
            true_kv = self._true_kv(rid, every, positions[None, :])
            assert torch.equal(host_kv, true_kv), f"{rid}: a host copy differs from the position's KV"

    def check_host_kv_of(self, rid: str, what: str, *, fresh: int = 0) -> None:
        """Every committed position of ``rid`` (but the ``fresh`` newest) has a host copy equal to
        its KV, now (no waiting)."""
        coord, row = self.coord, self.row(rid)
        positions = torch.arange(coord.length(row) - fresh)
        host_slots = coord.host.req_to_host[row, positions]
        assert bool((host_slots >= 0).all()), f"{what}{rid}: a committed position has no host copy"
        every = torch.arange(coord.num_layers)[:, None]
        host_kv = coord.host.kv[:, host_slots]
        assert torch.equal(host_kv, self._true_kv(rid, every, positions[None, :])), (
            f"{what}{rid}: a host copy is not the position's KV"
        )

    # --- rules --------------------------------------------------------------------------------

    @rule(length=st.integers(1, 40), seed=st.integers(0, 255))
    def admit(self, length: int, seed: int) -> None:
        """An admission, FULL or HOT as the coordinator decides (demoting decoding requests when
        only that makes room); refused only when ``can_admit`` says no (the progress guarantee)."""
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = tuple((seed * 7 + i * 13) % 256 for i in range(min(length, self.max_prompt)))
        result = prefill_whole(self.executor, [NewSequence(rid, prompt, GREEDY)])
        self.follow_demotions("during an admission: ")
        if rid not in result.first_tokens:  # not admitted: memory is short, nothing changed
            assert not result.failed and not self.executor.can_admit(len(prompt))
            return
        shadow = prefill_whole(self.shadow, [NewSequence(rid, prompt, GREEDY)])
        assert shadow.first_tokens == result.first_tokens
        self.phase[rid] = "staging"
        coord, row = self.coord, self.row(rid)
        self.layouts[rid] = RowModel(coord.layout(row), base=len(prompt))
        self.models[rid] = model = PositionModel(row)
        if self.layouts[rid].layout is Layout.FULL:  # every position at a slot of its own
            model.length = len(prompt)
            return
        start = last_chunk_start(
            len(prompt), self.executor.plan.prefill_budget, self.config.chunked_prefill_tokens
        )
        area = torch.cat(
            [
                coord.buffers.locs[row, coord.hot :].cpu(),
                page_slots(coord._mem[row].chunk_pages, coord.plan.page_size),
            ]
        )
        prefilled(model, len(prompt), start, coord.hot, area, self.columns(rid))

    @initialize(length=st.integers(1, 40), seed=st.integers(0, 255))
    def a_request_decoding(self, length: int, seed: int) -> None:
        """Every run starts with a request past staging, so that moves come early."""
        self.admit_decoding(length, seed)

    @rule(length=st.integers(1, 40), seed=st.integers(0, 255))
    def admit_decoding(self, length: int, seed: int) -> None:
        """An admission whose staging copy lands at once, and the collection of what is ready."""
        self.admit(length, seed)
        self.all_copies_land()
        self.collect()

    @precondition(lambda self: "decode" in self.phase.values())
    @rule(steps=st.integers(1, 5))
    def decode(self, steps: int) -> None:
        for _ in range(steps):
            ids = [r for r, p in self.phase.items() if p == "decode"]
            # the first request's room is reserved first: ``can_decode`` foretells its refusal
            fits = bool(ids) and self.executor.memory.can_decode(self.executor.seqs[ids[0]].row)
            result = self.executor.decode(ids)
            assert not ids or fits == (ids[0] not in result.refused), f"can_decode said {fits}"
            assert not result.failed, result.failed
            # (a demotion came before the step's forward: its new positions' backups may be in flight)
            self.follow_demotions("during a decode step: ", fresh=1)
            for rid in result.refused:  # memory pressure: the request is retracted
                self.end_request(rid)
            shadow = self.shadow.decode(list(result.tokens))
            assert shadow.tokens == result.tokens, "dynamic residency changed the answer"
            for rid, new in result.tokens.items():
                assert len(new) == 1, (rid, new)
                self.committed(rid, 1)
            self.ticks += bool(result.tokens)  # (after the demotions it made: they came before it)
            self.check_device_kv()
            self.check_model("after a decode step: ")

    @precondition(lambda self: bool(self.decoding(Layout.FULL)))
    @rule(data=st.data())
    def demote(self, data) -> None:
        rid = data.draw(st.sampled_from(self.decoding(Layout.FULL)))
        coord, row = self.coord, self.row(rid)
        before = set(coord.alloc.physical.pages_of(row))
        freed = coord.demote(row)
        after = set(coord.alloc.physical.pages_of(row))
        assert coord.layout(row) is Layout.HOT
        # the host copy is complete before any device row is dropped: no copy waited for here
        self.check_host_kv_of(rid, "right after its demotion: ")
        assert after, f"{rid}: a demotion keeps its buffer's pages"
        assert freed == (len(before) - len(after)) * self.page_bytes(), (freed, len(before), len(after))
        if coord.alloc.arena is not None:  # the physical side's highest free pages: none left above
            holes = set(coord.alloc.arena.physical.snapshot()[0])
            assert not holes or max(holes) < min(after), f"{rid}: its buffer left free pages above it"
        self.layouts[rid] = RowModel(Layout.HOT, demoted_at=self.ticks)
        self.moves["demotions"] += 1
        self.check_model("after a demotion: ")

    @precondition(lambda self: bool(self.decoding(Layout.HOT)))
    @rule(data=st.data(), after_a_step=st.booleans())
    def promote(self, data, after_a_step: bool) -> None:
        """A promotion; ``after_a_step``: right after a decode step, whose backups are in flight
        (the executor's ``rebalance`` promotes there)."""
        if after_a_step:
            self.decode(1)
            if not self.decoding(Layout.HOT):
                return
        rid = data.draw(st.sampled_from(self.decoding(Layout.HOT)))
        coord, row = self.coord, self.row(rid)
        counts = self.executor.pool_counts()
        try:
            self.allow_promotion = True
            copied = coord.promote(row)
        except OutOfMemory:
            assert coord.layout(row) is Layout.HOT and self.executor.pool_counts() == counts
            return
        finally:
            self.allow_promotion = False
        assert coord.layout(row) is Layout.FULL
        assert 0 <= copied <= coord.length(row) * coord.host.row_bytes * coord.num_layers, copied
        self.layouts[rid] = RowModel(Layout.FULL, base=coord.length(row))
        self.moves["promotions"] += 1
        self.check_model("after a promotion: ")

    @rule(after_a_step=st.booleans())
    def rebalance(self, after_a_step: bool) -> None:
        """The executor's step-boundary call (``after_a_step``: right after a decode step, as the
        executor makes it): at most one promotion, of a request demoted at least ``PROMOTE_AFTER``
        calls ago (or admitted HOT), the smallest context of those, leaving the headroom free (no
        thrash)."""
        if after_a_step and "decode" in self.phase.values():
            self.decode(1)
        coord = self.coord
        hot = self.decoding(Layout.HOT, ("decode", "drafted"))  # (between draft and verify too)
        self.allow_promotion = True
        try:
            coord.rebalance()
        finally:
            self.allow_promotion = False
        promoted = [rid for rid in hot if coord.layout(self.row(rid)) is Layout.FULL]
        assert len(promoted) <= 1, f"one rebalance promoted {promoted}"
        for rid in promoted:
            waited = self.layouts[rid].demoted_at
            assert waited is None or self.ticks - waited >= PROMOTE_AFTER, (
                f"{rid} promoted {self.ticks - waited} decode steps after its demotion"
            )
            eligible = [r for r in hot if self.layouts[r].demoted_at is None
                        or self.ticks - self.layouts[r].demoted_at >= PROMOTE_AFTER]
            smallest = min(coord.length(self.row(r)) for r in eligible)
            assert coord.length(self.row(rid)) == smallest, f"{rid} is not the smallest waiting"
            layouts: DynamicResidency = coord.layouts
            free = coord.alloc.physical.num_free_pages
            assert free >= layouts.headroom_pages(), f"{rid} promoted into the headroom ({free} pages left)"
            self.layouts[rid] = RowModel(Layout.FULL, base=coord.length(self.row(rid)))
            self.moves["promotions"] += 1

    def end_request(self, rid: str) -> None:
        super().end_request(rid)
        self.layouts.pop(rid, None)

    # --- the model ----------------------------------------------------------------------------

    def check_model(self, what: str = "") -> None:
        """Layouts and figures, then every table against the model (FULL slots learnt on first
        sight), then the no-alias rules."""
        self.follow_demotions(what)
        coord = self.coord
        models: dict[str, PositionModel] = {}
        for rid, model in self.models.items():
            if self.layouts[rid].layout is Layout.FULL:
                mapped = self.full_map(rid, what)
                models[rid] = PositionModel(model.row, self.backed(rid), mapped)
                continue
            elif self.phase[rid] != "staging":
                mapped = self.hot_map(rid, what)
            else:  # a HOT prompt: the executor machine's exact model
                models[rid] = model
                continue
            models[rid] = PositionModel(model.row, model.length, mapped)
        check_tables(models, coord.alloc, coord.host.map, what=what)
        self.check_owned(what)
        self.check_figures(what)

    def follow_demotions(self, what: str, *, fresh: int = 0) -> None:
        """A FULL request found HOT was demoted by memory pressure (admission, or growth before the
        last ``fresh`` positions were computed; counted by the figures); a HOT one found FULL must
        come from a promotion."""
        for rid, model in self.layouts.items():
            now = self.coord.layout(self.row(rid))
            if now is model.layout:
                continue
            if now is Layout.HOT:
                self.check_host_kv_of(rid, f"{what}demoted under pressure: ", fresh=fresh)
                self.layouts[rid] = RowModel(Layout.HOT, demoted_at=self.ticks)
                self.moves["demotions"] += 1
            else:
                assert self.allow_promotion, f"{what}{rid} was promoted outside promote / rebalance"

    def full_map(self, rid: str, what: str) -> dict[int, int]:
        """A FULL request: every committed position maps to a slot of its own, holding its KV; a
        slot once seen stays."""
        coord, row, model = self.coord, self.row(rid), self.layouts[rid]
        length = coord.length(row)
        positions = torch.arange(length)
        slots = coord.alloc.lookup(coord.req_to_token[row, positions]).cpu()
        missing = positions[slots <= 0]
        assert missing.numel() == 0, f"{what}{rid} is FULL and position {int(missing[0])} has no device slot"
        for pos, slot in enumerate(slots.tolist()):
            seen = model.slots.setdefault(pos, slot)
            assert seen == slot, f"{what}{rid}: FULL position {pos} moved from slot {seen} to {slot}"
        assert len(set(slots.tolist())) == length, f"{what}{rid}: two FULL positions share a slot"
        every = torch.arange(coord.num_layers)[:, None]
        device_rows = coord.device_kv[:, slots.to(coord.device)].cpu()
        assert torch.equal(device_rows, self._true_kv(rid, every, positions[None, :])), (
            f"{what}{rid}: a FULL position's device row is not its KV"
        )
        # a buffer column holding a position is that position's slot or holds nothing mapped
        held = coord.buffers.tokens[:, row].long().cpu()
        locs = coord.buffers.locs[row].cpu()
        for col in range(locs.numel()):
            if locs[col] < 0:
                continue
            owners = {int(p) for p in held[:, col].tolist() if 0 <= p < length}
            for pos in owners:
                assert slots[pos] == locs[col] or int(locs[col]) not in set(slots.tolist()), (
                    f"{what}{rid}: column {col} holds position {pos} and is another position's slot"
                )
        return dict(enumerate(slots.tolist()))

    def hot_map(self, rid: str, what: str) -> dict[int, int]:
        """A HOT request: what its locations map to are its own buffer's columns."""
        coord, row = self.coord, self.row(rid)
        length = coord.length(row)
        slots = coord.alloc.lookup(coord.req_to_token[row, :length]).cpu()
        columns = set(coord.buffers.locs[row].cpu().tolist()) - {-1}
        mapped = {pos: slot for pos, slot in enumerate(slots.tolist()) if slot != 0}
        strays = {pos: slot for pos, slot in mapped.items() if slot not in columns}
        assert not strays, f"{what}{rid} is HOT and maps positions {strays} outside its buffer"
        return mapped

    def check_owned(self, what: str) -> None:
        """Every slot a live request reads lies in a page it owns (no row aliased)."""
        coord, page = self.coord, self.coord.plan.page_size
        for rid in self.phase:
            row = self.row(rid)
            owned = coord.alloc.physical.pages_of(row)
            length = coord.length(row)
            slots = coord.alloc.lookup(coord.req_to_token[row, :length]).cpu()
            reads = set((slots[slots > 0] // page).tolist())
            locs = coord.buffers.locs[row].cpu()
            reads |= set((locs[locs >= 0] // page).tolist())
            assert reads <= owned, f"{what}{rid} reads pages {sorted(reads - owned)} it does not own"

    def check_figures(self, what: str) -> None:
        figures = self.coord.residency_stats()
        assert figures["mode"] == "dynamic"
        live = ("decode", "drafted")
        full, hot = len(self.decoding(Layout.FULL, live)), len(self.decoding(Layout.HOT, live))
        got = (figures["resident"], figures["demoted"], figures["demotions"], figures["promotions"])
        want = (full, hot, self.moves["demotions"], self.moves["promotions"])
        assert got == want, f"{what}residency figures {got}, the model says {want}"


TestResidencyMachine = pytest.mark.proptest(ResidencyMachine.TestCase)
TestResidencyMachine.settings = machine_settings(examples=20, steps=50)


class ChunkedResidencyMachine(ResidencyMachine):
    """The same rules with prompts prefilled 6 tokens per forward (the shadow in the same chunks): a
    FULL prompt's chunks write their own slots, a HOT one's read the earlier chunks through the hot
    region; and the headroom a promotion must leave is one such chunk's admission, so ``rebalance``
    promotes in a pool this small."""

    config = attrs.evolve(ResidencyMachine.config, chunked_prefill_tokens=6)
    shadow_config = attrs.evolve(ResidencyMachine.shadow_config, chunked_prefill_tokens=6)


TestChunkedResidencyMachine = pytest.mark.proptest(ChunkedResidencyMachine.TestCase)
TestChunkedResidencyMachine.settings = machine_settings(examples=15, steps=50)


class SpecResidencyMachine(ResidencyMachine, SpecMachine):
    """The rules of both with speculative rounds (``SpecMachine``'s draft and verify as separate
    commands) over FULL and HOT requests together. Verify binding is checked before the forward:
    a FULL request's verify tokens get distinct slots of its own pages, none holding a committed
    position; a HOT one's the columns of its draft zone (or identity columns), as in ``SpecMachine``."""

    model = SpecMachine.model
    max_prompt = SpecMachine.max_prompt
    config = attrs.evolve(SpecMachine.config, hisparse=DYNAMIC)
    shadow_config = SpecMachine.shadow_config

    @precondition(lambda self: "drafted" in self.phase.values())
    @rule()
    def verify(self) -> None:
        ids = [r for r, p in self.phase.items() if p == "drafted"]
        result = self.executor.verify(ids)
        assert not result.failed
        assert result.tokens == self.shadow.verify(ids).tokens, "dynamic residency changed the answer"
        for rid in ids:
            self.phase[rid] = "decode"
            count = len(result.tokens[rid])
            assert count == result.accepted[rid] + 1, (rid, result.tokens[rid], result.accepted[rid])
            self.committed(rid, count)
        self.executor.check_integrity(data=False)
        self.check_model("after finalize: ")
        self.ticks += bool(result.tokens)  # (after the demotions its binding made: they came before it)

    def checked_prepare(self, rows: list[int], draft_tokens: int) -> VerifyLayout:
        layout = self.prepare(rows, draft_tokens)
        coord, page = self.coord, self.coord.plan.page_size
        by_row = {self.row(rid): rid for rid in self.models}
        targets = layout.targets.slots.cpu().reshape(len(rows), draft_tokens)
        tokens = coord.buffers.tokens.cpu()
        for i, row in enumerate(rows):
            rid, length = by_row[row], coord.length(row)
            slots = targets[i].tolist()
            locs = coord.req_to_token[row, length : length + draft_tokens]
            mapped = coord.alloc.lookup(locs).cpu().tolist()
            assert mapped == slots, f"{rid}: a verify location maps elsewhere"
            if coord.layout(row) is Layout.FULL:
                committed = set(coord.alloc.lookup(coord.req_to_token[row, :length]).cpu().tolist())
                assert len(set(slots)) == draft_tokens, f"{rid}: two verify tokens share a slot"
                assert not committed & set(slots), f"{rid}: a verify token overwrites a committed position"
                owned = coord.alloc.physical.pages_of(row)
                assert {s // page for s in slots} <= owned, f"{rid}: a verify slot outside its pages"
                continue
            columns = coord.buffers.locs[row].cpu().tolist()
            for j, col in enumerate(verify_columns(length, draft_tokens, coord.hot)):
                held = tokens[:, row, col]
                assert bool((held == length + j).all()), f"{rid}: verify column {col} holds {held.tolist()}"
                assert columns[col] == slots[j], f"{rid}: verify token {j} is not at its column"
        return layout


TestSpecResidencyMachine = pytest.mark.proptest(SpecResidencyMachine.TestCase)
TestSpecResidencyMachine.settings = machine_settings(examples=20, steps=40)


# --- planted defects: each must be caught by this machine alone -------------------------------------


def run_until_it_fails(machine, *, examples: int, steps: int) -> BaseException:
    """Run ``machine`` deterministically (no database, no shrinking); returns what made it fail
    (fails the test if nothing did)."""
    fixed = settings(
        max_examples=examples,
        stateful_step_count=steps,
        derandomize=True,
        database=None,
        deadline=None,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    with pytest.raises(Exception) as info:  # any failure of the machine's checks
        run_state_machine_as_test(machine, settings=fixed)
    return info.value


@pytest.mark.proptest
def test_a_demotion_that_drops_rows_before_the_backups_landed_is_caught(monkeypatch):
    """The demotion does not wait for the row's backups in flight: its host copy is incomplete when
    its device rows go."""
    original = HiSparseCoordinator.demote

    def demote(self, row):
        with monkeypatch.context() as m:
            m.setattr(HiSparseCoordinator, "settle_backups", lambda self, upto=None: None)
            return original(self, row)

    monkeypatch.setattr(HiSparseCoordinator, "demote", demote)
    error = run_until_it_fails(ResidencyMachine, examples=100, steps=40)
    assert "host copy" in str(error), error


@pytest.mark.proptest
def test_a_demotion_that_leaves_the_partial_page_unbacked_is_caught(monkeypatch):
    """The demotion drops the device rows of a FULL row's positions since its last backup without
    backing them up: those positions have no host copy."""
    original = HiSparseCoordinator.demote

    def demote(self, row):
        with monkeypatch.context() as m:
            m.setattr(HiSparseCoordinator, "flush_backup", lambda self, row: None)
            return original(self, row)

    monkeypatch.setattr(HiSparseCoordinator, "demote", demote)
    error = run_until_it_fails(ResidencyMachine, examples=100, steps=40)
    assert "host copy" in str(error), error


@pytest.mark.proptest
def test_a_promotion_that_copies_before_the_backups_landed_is_caught(monkeypatch):
    """The promotion copies the host rows without waiting for the row's backups in flight: the
    newest positions come back stale (and the backup, reading the buffer the promotion gave back
    and wrote over, leaves a wrong host copy)."""
    original = HiSparseCoordinator.promote

    def promote(self, row):
        with monkeypatch.context() as m:
            m.setattr(HiSparseCoordinator, "settle_backups", lambda self, upto=None: None)
            return original(self, row)

    monkeypatch.setattr(HiSparseCoordinator, "promote", promote)
    error = run_until_it_fails(ResidencyMachine, examples=100, steps=40)
    found = ("device row is not its KV", "host copy differs", "differs from its host copy")
    assert any(what in str(error) for what in found), error


@pytest.mark.proptest
def test_a_promotion_that_leaves_a_location_unmapped_is_caught(monkeypatch):
    """The promotion forgets to map the row's first position."""
    original = HiSparseCoordinator.promote

    def promote(self, row):
        copied = original(self, row)
        self.alloc.clear(self.req_to_token[row, :1])
        return copied

    monkeypatch.setattr(HiSparseCoordinator, "promote", promote)
    error = run_until_it_fails(ResidencyMachine, examples=100, steps=40)
    # (the machine's model, or the coordinator's I14 check the machine runs after every rule)
    assert "has no device slot" in str(error) or "not mapped to its slot" in str(error), error
