"""Dynamic residency's mechanism: FULL rows (every position on the device), demotion to the hot buffer
and promotion back, at step boundaries.

Requests are demoted and promoted by hand between steps of the synchronous driver (invariants checked
after every step): in float64 their tokens stay those of the all-resident reference, plain and
speculative, alone and in batches mixing both layouts; the coordinator's own verbs are driven
directly for admission under pressure, the promotion rules and a release in every layout, with
``check_integrity`` after each and every pool back at its initial count.
"""

from __future__ import annotations

import pytest
import structlog
import torch
from test_chunked_prefill import HOT, PAGE, config, prompts

from pipeline.config import HiSparseConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.hisparse import residency as rules
from pipeline.hisparse.coordinator import HiSparseCoordinator
from pipeline.logs import replay
from pipeline.memory.interface import Layout, Residency
from pipeline.sampling import SamplingParams
from statemachines.request import Demoted, Promoted, State

from tiny_models import build_tiny_model

LENS = (5, 16, 40, 3 * HOT + 1)
MOVES = {"Demoted": Demoted, "Promoted": Promoted}
MOVED = {"Demoted": "freed_bytes", "Promoted": "copied_bytes"}  # each event's figure
OUTSIDER = 1000  # owner of the device pages a test takes to press the pool (no request row)
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


def dynamic(ratio: int = 8, **kw) -> HiSparseConfig:
    return HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=ratio, residency="dynamic", **kw)


def run(model, cfg, *, hook=None, lens=LENS):
    """Generate ``lens``' prompts, ``hook(executor, step)`` between steps; returns (tokens, executor
    stats, the requests' logged ``Demoted`` / ``Promoted`` events) after checking that every pool is
    back at its initial count and that the logged lifecycles replay."""
    executor = Executor(cfg, model=model)
    try:
        initial = executor.pool_counts()
        driver = SyncDriver(executor, check=True)
        with structlog.testing.capture_logs() as records:
            reqs = [driver.submit(p, PARAMS, request_id=f"r{i}") for i, p in enumerate(prompts(0, lens=lens))]
            step = 0
            while driver.step():
                if hook is not None:
                    hook(executor, step)
                    executor.check_integrity()
                step += 1
        assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
        assert executor.pool_counts() == initial
        assert set(replay(records).values()) == {State.FINISHED}
        moves = [
            (r["request_id"], MOVES[r["event"]](r[MOVED[r["event"]]]))
            for r in records
            if r["event"] in ("Demoted", "Promoted")
        ]
        return [r.output_ids for r in reqs], executor.stats(), moves
    finally:
        executor.close()


@pytest.fixture(scope="module")
def reference(tiny_model):
    return run(tiny_model, config(hisparse=False, chunk=None))[0]


def decoding(executor, layout: Layout) -> list[int]:
    memory = executor.memory
    return [
        row
        for row in memory.live_rows()
        if memory.residency(row) is Residency.RESIDENT and memory.layout(row) is layout
    ]


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_full_rows_decode_the_reference_tokens(tiny_model, reference, spec):
    tokens, stats, events = run(tiny_model, config(hisparse=dynamic(), chunk=7, spec=spec))
    assert tokens == reference
    assert stats["residency"]["demotions"] == 0 and not events
    assert stats["hisparse"] is not None and sum(stats["hisparse"]["misses"]) == 0, "no FULL row swaps in"


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_demoted_and_promoted_rows_keep_the_reference_tokens(tiny_model, reference, spec):
    """Every third step the largest FULL row is demoted and the smallest demoted one promoted: the
    batches mix both layouts, and each request changes layout mid-decode."""
    moved = {"demoted": 0, "promoted": 0}

    def hook(executor, step):
        memory = executor.memory
        if step % 3 == 0 and (full := decoding(executor, Layout.FULL)):
            memory.demote(max(full, key=memory.length))
            moved["demoted"] += 1
        elif step % 3 == 1 and (hot := decoding(executor, Layout.HOT)):
            memory.promote(min(hot, key=memory.length))
            moved["promoted"] += 1

    tokens, stats, events = run(tiny_model, config(hisparse=dynamic(), chunk=7, spec=spec), hook=hook)
    assert tokens == reference
    assert moved["demoted"] >= 3 and moved["promoted"] >= 2
    residency = stats["residency"]
    assert residency["demotions"] == moved["demoted"] and residency["promotions"] == moved["promoted"]
    kinds = [type(e) for _, e in events]
    # (a move whose request ends in the round it was reported in is not logged: a round's DRAFT and
    # VERIFY states take no residency event, and FINISHED none at all)
    assert moved["demoted"] - len(LENS) <= kinds.count(Demoted) <= moved["demoted"]
    assert moved["promoted"] - len(LENS) <= kinds.count(Promoted) <= moved["promoted"]
    if not spec:
        assert kinds.count(Demoted) == moved["demoted"] and kinds.count(Promoted) == moved["promoted"]
    assert residency["demoted_bytes"] > 0 and residency["promoted_bytes"] > 0


def test_always_admits_every_row_hot(tiny_model, reference):
    seen = set()

    def hook(executor, step):
        seen.update(executor.memory.layout(row) for row in executor.memory.live_rows())

    tokens, stats, events = run(tiny_model, config(hisparse=True, chunk=7), hook=hook)
    assert tokens == reference and seen == {Layout.HOT} and not events
    assert stats["residency"] == {
        "mode": "always", "resident": 0, "demoted": 0, "demotions": 0, "promotions": 0,
        "demoted_bytes": 0, "promoted_bytes": 0,
    }


def test_pressure_demotes_and_keeps_the_tokens(tiny_model, reference, monkeypatch):
    """A device arena that holds the longest request whole (its KV rows and its indexer keys): later
    ones are admitted by demotions."""
    cfg = config(hisparse=dynamic(ratio=4), chunk=7, device_pool_tokens=48, max_context_len=192)
    executor = Executor(cfg, model=tiny_model)
    try:
        longest = max(LENS) + PARAMS.max_new_tokens
        memory = executor.memory
        assert memory.alloc.fits(rules.pages_for(longest, PAGE), memory.layouts.full_pages(longest))
    finally:
        executor.close()
    demoted_by_admissions = []
    admit = HiSparseCoordinator.admit

    def counting_admit(self, *args, **kwargs):
        before = self.layouts.demotions
        row = admit(self, *args, **kwargs)
        demoted_by_admissions.append(self.layouts.demotions - before)
        return row

    monkeypatch.setattr(HiSparseCoordinator, "admit", counting_admit)
    tokens, stats, events = run(tiny_model, cfg)
    assert tokens == reference
    assert stats["residency"]["demotions"] >= 1
    assert any(demoted_by_admissions), "no admission demoted a row"
    assert any(isinstance(e, Demoted) and e.freed_bytes > 0 for _, e in events)


# --- the coordinator's verbs, driven directly ------------------------------------------------------


@pytest.fixture
def memory(tiny_model):
    executor = Executor(config(hisparse=dynamic(), chunk=32, device_pool_tokens=128), model=tiny_model)
    yield executor.memory
    executor.close()


@pytest.fixture
def small_memory(tiny_model):
    """A device arena that holds decoding rows of 52, 36 and 24 positions FULL with little room left."""
    cfg = config(hisparse=dynamic(ratio=4), chunk=32, device_pool_tokens=64, max_context_len=256)
    executor = Executor(cfg, model=tiny_model)
    yield executor.memory
    executor.close()


def decode_ready(memory, num_tokens: int) -> int:
    """A row admitted, prefilled (nothing computed: zeros), staged and collected."""
    row = memory.admit(num_tokens)
    memory.prefill_targets(row, 0, num_tokens)
    memory.commit_prefill(row, 0, num_tokens, final=True)
    memory.start_staging(row, num_tokens)
    memory.wait_staging()
    assert memory.collect_ready([row]) == [row]
    memory.check_integrity()
    return row


def decode_steps(memory, rows: list[int], steps: int) -> None:
    for _ in range(steps):
        targets = memory.prepare_decode(rows)
        memory.device_kv[:, targets.slots] = torch.rand(len(rows), memory.device_kv.shape[-1],
                                                        dtype=memory.device_kv.dtype)
        memory.commit_decode(rows, targets.slots)
        memory.check_integrity()


def test_demotion_frees_all_but_the_buffer_and_promotion_restores_the_layout(memory):
    initial = memory.free_counts()
    row = decode_ready(memory, 3 * HOT + 1)
    decode_steps(memory, [row], 5)
    assert memory.layout(row) is Layout.FULL
    held = memory.device_kv_bytes(row)
    freed = memory.demote(row)
    memory.check_integrity()
    assert memory.layout(row) is Layout.HOT
    assert memory.buffers.capacity(row) == HOT + PAGE and freed == held - memory.device_kv_bytes(row)
    newest = memory.length(row) - 1
    assert int(memory.buffers.tokens[0, row, HOT]) == newest, "the newest token sits in the newest column"
    decode_steps(memory, [row], 3)
    copied = memory.promote(row)
    memory.check_integrity()
    assert memory.layout(row) is Layout.FULL
    assert copied == memory.length(row) * memory.host.row_bytes * memory.num_layers
    decode_steps(memory, [row], 3)
    assert [c.kind for c in memory.take_residency_changes()] == ["demoted", "promoted"]
    memory.release(row)
    memory.check_integrity()
    assert memory.free_counts() == initial


def test_a_short_row_keeps_its_positions_in_identity_columns(memory):
    row = decode_ready(memory, 5)
    assert memory.layouts.candidates() == [(row, rules.GROWTH_PAGES)], "only its growth room goes"
    memory.demote(row)
    memory.check_integrity()
    assert memory.buffers.capacity(row) == 2 * PAGE
    decode_steps(memory, [row], 6)  # past its buffer: it grows as any HOT row
    assert memory.buffers.capacity(row) == 3 * PAGE
    memory.release(row)


def test_admission_under_pressure_demotes_the_largest_first(small_memory):
    memory = small_memory
    initial = memory.free_counts()
    big, mid, small = (decode_ready(memory, n) for n in (52, 36, 24))
    assert {memory.layout(r) for r in (big, mid, small)} == {Layout.FULL}
    num_tokens = 40
    hot_pages, logical_pages, _ = memory._needs(num_tokens, False, 0)
    assert not memory.alloc.physical.can_allocate(hot_pages), "not even a HOT admission fits"
    assert not memory.alloc.fits(logical_pages, hot_pages), "nor its rows and keys together"
    assert memory.can_admit(num_tokens)
    row = memory.admit(num_tokens)
    memory.check_integrity()
    assert memory.layout(row) is Layout.HOT
    assert memory.layout(big) is Layout.HOT, "the largest context went first"
    assert memory.layout(mid) is Layout.FULL and memory.layout(small) is Layout.FULL, "one was enough"
    assert [(c.row, c.kind) for c in memory.take_residency_changes()] == [(big, "demoted")]
    for r in (row, big, mid, small):
        memory.release(r)
    memory.check_integrity()
    assert memory.free_counts() == initial


def test_a_row_that_cannot_grow_demotes(memory):
    """The arena runs short of a FULL row's growth (its new KV rows and keys together): the row
    can still decode, by demoting."""
    rows = [decode_ready(memory, 40), decode_ready(memory, 40)]
    grow = rows[1]
    end = memory.length(grow)
    steps = len(memory._mem[grow].full_pages) * PAGE - end + 1  # its pages filled, then one more
    logical, physical, _ = memory.decode_needs(grow, new_tokens=steps, speculative=False)
    assert physical > 0
    # The arena runs dry of the growth (the physical side takes the highest frames, the keys the
    # lowest: taking every frame would leave the keys no room that any demotion could give back).
    while memory.alloc.fits(logical, physical):
        memory.alloc.physical.allocate(1, OUTSIDER)
    assert memory.can_decode(grow, new_tokens=steps)
    memory.ensure_capacity(grow, new_tokens=steps, speculative=False)
    assert [c.kind for c in memory.take_residency_changes()] == ["demoted"]
    memory.check_integrity()


def test_rebalance_waits_out_the_hysteresis_and_keeps_the_headroom(memory):
    row = decode_ready(memory, 40)
    memory.demote(row)
    for _ in range(rules.PROMOTE_AFTER - 1):  # (the hysteresis counts decode steps, not calls)
        memory.rebalance()
        memory.layouts.step()
        memory.rebalance()
        assert memory.layout(row) is Layout.HOT, "promoted too soon after its demotion"
    memory.layouts.step()
    hog = memory.alloc.physical.allocate(memory.alloc.physical.num_free_pages - 1, OUTSIDER)
    memory.rebalance()
    assert memory.layout(row) is Layout.HOT, "promoted without the headroom"
    memory.alloc.physical.free(hog, OUTSIDER)
    memory.rebalance()
    assert memory.layout(row) is Layout.FULL
    memory.check_integrity()
    memory.release(row)


def test_a_promotion_counts_the_buffer_it_gives_back(memory):
    """The free pages alone are short of the promotion, its buffer's pages make up the difference."""
    row = decode_ready(memory, 40)
    memory.demote(row)
    need = memory.layouts.promotion_pages(row)
    held = len(memory.buffers.pages(row))
    assert 0 < held < need
    hog = memory.alloc.physical.allocate(memory.alloc.physical.num_free_pages - (need - held), OUTSIDER)
    assert not memory.alloc.physical.can_allocate(need)
    memory.promote(row)
    memory.check_integrity()
    assert memory.layout(row) is Layout.FULL and memory.alloc.physical.num_free_pages == 0
    memory.alloc.physical.free(hog, OUTSIDER)
    memory.release(row)


def test_whole_prompt_prefill_leaves_a_headroom_promotions_can_meet():
    """With whole prompts as chunks one HOT admission can be most of a small arena: the headroom stays
    within a quarter of it, and a demoted row comes back once the hysteresis is waited out.

    The arena holds the indexer keys of every logical location besides the KV rows, so it is that
    small only where a key is a small part of a row: a model whose rows are 4.5 keys wide (as
    V3.2's, 576 and 128 values), ratio 1."""
    model = build_tiny_model(kv_lora_rank=64)
    cfg = config(hisparse=dynamic(ratio=1), chunk=None, device_pool_tokens=512, max_context_len=512)
    executor = Executor(cfg, model=model)
    try:
        memory = executor.memory
        plan, pool = memory.plan, memory.alloc.physical.capacity_pages
        one_admission = (memory.buffers.columns + plan.chunk_area(plan.max_request_len)) // plan.page_size
        assert one_admission > pool - pool // rules.HEADROOM_CAP, "uncapped, no promotion could leave it"
        assert memory.layouts.headroom_pages() <= pool // rules.HEADROOM_CAP
        row = decode_ready(memory, 24)
        memory.demote(row)
        for _ in range(rules.PROMOTE_AFTER):
            memory.layouts.step()
        memory.rebalance()
        assert memory.layout(row) is Layout.FULL
        memory.check_integrity()
        memory.release(row)
    finally:
        executor.close()


@pytest.mark.parametrize("stage", ["admitted", "prefilled", "staging", "decoding", "demoted"])
def test_release_in_every_layout_restores_the_pools(memory, stage):
    initial = memory.free_counts()
    num_tokens = 40
    row = memory.admit(num_tokens)
    if stage != "admitted":
        memory.prefill_targets(row, 0, 21)
        memory.commit_prefill(row, 0, 21, final=False)
    if stage in ("staging", "decoding", "demoted"):
        memory.prefill_targets(row, 21, num_tokens)
        memory.commit_prefill(row, 21, num_tokens, final=True)
        memory.start_staging(row, num_tokens)
    if stage in ("decoding", "demoted"):
        memory.wait_staging()
        memory.collect_ready([row])
        decode_steps(memory, [row], 2)
    if stage == "demoted":
        memory.demote(row)
    memory.check_integrity()
    memory.release(row)
    memory.check_integrity()
    assert memory.free_counts() == initial


# --- the one-call CPU attention of FULL rows --------------------------------------------------------


def _logits_of(model, monkeypatch, *, compiled: bool, num_steps: int | None):
    """Tokens, every logits row, the ``attend_paged`` call count of FULL-row decoding and the count of
    compiled layers of batches mixing both layouts (the second request demoted at its third step:
    the batches mix both layouts from then on)."""
    from test_equivalence import HOT as EQ_HOT
    from test_equivalence import prompts as eq_prompts
    from test_equivalence import two_page_config

    from kernels import hisparse_attend_numba
    from pipeline.hisparse.backend import HiSparseBackend

    config = two_page_config(
        HiSparseConfig(device_buffer_size=EQ_HOT, host_to_device_ratio=2, residency="dynamic"), num_steps
    )
    calls = {"paged": 0, "split": 0}
    with monkeypatch.context() as patch:
        if not compiled:
            patch.setattr(HiSparseBackend, "_compiled_fits", lambda self, inputs: False)
        inner = hisparse_attend_numba.attend_paged
        patch.setattr(hisparse_attend_numba, "attend_paged",
                      lambda *a: calls.__setitem__("paged", calls["paged"] + 1) or inner(*a))
        split = HiSparseBackend._attend_split
        patch.setattr(HiSparseBackend, "_attend_split",
                      lambda *a: calls.__setitem__("split", calls["split"] + 1) or split(*a))
        executor = Executor(config, model=model)
        calls["paged"] = 0  # the start's warm-up aside: what the forwards called
        logits: list[torch.Tensor] = []
        original = model.logits
        patch.setattr(model, "logits", lambda hidden: logits.append(original(hidden)) or logits[-1])
        driver = SyncDriver(executor, check=True)
        try:
            reqs = [driver.submit(p, SamplingParams(max_new_tokens=16, ignore_eos=True), request_id=f"c{i}")
                    for i, p in enumerate(eq_prompts(5, lens=(7, 3 * EQ_HOT + 1, 8 * EQ_HOT + 9)))]
            step = 0
            while driver.step():
                step += 1
                row = executor.seqs["c1"].row if "c1" in executor.seqs else None
                if step == 3 and row is not None and executor.memory.layout(row) is Layout.FULL:
                    executor.memory.demote(row)
            return [r.output_ids for r in reqs], logits, calls["paged"], calls["split"]
        finally:
            executor.close()


@pytest.mark.parametrize("num_steps", [None, 3], ids=["plain", "speculative"])
def test_the_one_call_serves_full_rows_like_the_steps(tiny_model, monkeypatch, num_steps):
    tokens, logits, paged, split = _logits_of(tiny_model, monkeypatch, compiled=True, num_steps=num_steps)
    ref = _logits_of(tiny_model, monkeypatch, compiled=False, num_steps=num_steps)
    ref_tokens, ref_logits, ref_paged, ref_split = ref
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) and all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    assert paged > 0 and ref_paged == 0
    assert split > 0 and ref_split == 0, "the mixed batches run compiled (two calls a layer)"


def _decode_ready_final(memory, num_tokens: int, final: int) -> int:
    """``decode_ready`` of a request that can reach ``final`` positions (``admit``'s hint)."""
    row = memory.admit(num_tokens, final=final)
    memory.prefill_targets(row, 0, num_tokens)
    memory.commit_prefill(row, 0, num_tokens, final=True)
    memory.start_staging(row, num_tokens)
    memory.wait_staging()
    assert memory.collect_ready([row]) == [row]
    return row


@pytest.mark.parametrize("final", [0, 40, 200])
def test_a_promotion_keeps_room_for_every_request_to_grow_to_its_final_length(memory, final):
    """Promotion is not optimistic: a demoted row comes back only when the arena holds it beside
    every live request's growth to its final length (``reserved``) and the headroom. Memory that
    holds the promotion and the headroom now but not a row's growth to come keeps the row HOT
    (its growth would demote it again); without the hint (``final`` 0) the row is promoted."""
    row = _decode_ready_final(memory, 40, final)
    other = _decode_ready_final(memory, 8, final and final // 2)
    memory.demote(row)
    for _ in range(rules.PROMOTE_AFTER):
        memory.layouts.step()
    page = memory.plan.page_size
    need = memory.layouts.promotion_pages(row) + memory.layouts.headroom_pages()
    grow_l, grow_p = memory.layouts.reserved(exclude=row)
    own_l = max(0, rules.pages_for(final, page) - memory.alloc.req_to_token.covered_len(row) // page)
    growth = max(0, rules.pages_for(final, page) - memory.layouts.promotion_pages(row))
    # leave the arena exactly the promotion and the headroom (its buffer given back), no more
    buffer = memory.buffers.pages(row)
    hog = []
    while memory.alloc.fits(0, need + 1, freed_physical=buffer):
        hog += memory.alloc.physical.allocate(1, OUTSIDER)
    assert memory.alloc.fits(0, need, freed_physical=buffer)
    reserve_fits = memory.alloc.fits(grow_l + own_l, need + growth + grow_p, freed_physical=buffer)
    memory.rebalance()
    if final == 0:
        assert memory.layout(row) is Layout.FULL, "no hint: promoted when the promotion and headroom fit"
    else:
        assert not reserve_fits and memory.layout(row) is Layout.HOT, "promoted into room its growth needs"
    memory.alloc.physical.free(hog, OUTSIDER)
    memory.rebalance()
    assert memory.layout(row) is Layout.FULL
    memory.check_integrity()
    for r in (row, other):
        memory.release(r)
