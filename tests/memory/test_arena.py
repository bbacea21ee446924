"""The device arena of dynamic residency (pipeline/memory/arena.py): one tensor for the KV rows and
the indexer keys, handed out in frames to either side.

* its layout: the frame size loses few key pages to frame boundaries, and the arena takes the bytes
  the two separate pools would take (to within one frame), never fewer than the keys need;
* a hypothesis ``RuleBasedStateMachine`` allocating, freeing, taking back and transferring pages of
  both sides for a few owners: after every rule invariant I15 holds (``check_integrity``), the
  sides agree with a model of who owns what, no byte of a layer's slab backs an allocated KV row and
  an allocated key at once, ``fits`` answers what allocating actually does, every frame a side
  takes from the other side (or fresh) is zeroed once (``on_take``) and one it held last is not,
  and once every owner has freed everything the free counts are back at their initial values;
* under a coordinator: a frame a released FULL row's rows leave and a HOT row's keys take is zeroed,
  so a fresh location's key never reads the rows' bytes.
"""

from __future__ import annotations

import itertools
import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from shadow_model import machine_settings

from pipeline.config import EngineConfig, HiSparseConfig
from pipeline.executor import Executor
from pipeline.memory import OutOfMemory, OwnershipError, page_slots
from pipeline.memory.arena import (
    FREE,
    LOGICAL,
    PHYSICAL,
    DeviceArena,
    arena_layout,
    key_pages_in,
    pick_pages_per_frame,
)
from pipeline.memory.interface import Layout

BUNDLED = (320, 128)  # bytes of a KV row and of an indexer key, one layer: the bundled model's
V32_FP8 = (656, 132)  # DeepSeek-V3.2's FP8 cache
TINY = (192, 128)  # the tests' tiny random model in float64


# --- the layout ------------------------------------------------------------------------------------


def test_bundled_dims_pack_five_key_pages_a_frame_and_lose_none():
    row, key = BUNDLED
    c = pick_pages_per_frame(row, key)
    assert c == 2
    frames = [key_pages_in(f, c, row, key, 1 << 30) for f in range(50)]
    assert all(len(pages) == 5 for pages in frames)
    assert [p for pages in frames for p in pages] == list(range(250)), "every key page in one frame"


def test_v32_fp8_loses_a_small_share_of_key_pages_to_frame_boundaries():
    row, key = V32_FP8
    c = pick_pages_per_frame(row, key)
    assert c == 8
    period = key // math.gcd(c * row, key)  # frames after which the boundaries repeat
    whole = period * c * row // key  # key pages in those frames' bytes
    kept = sum(len(key_pages_in(f, c, row, key, 1 << 30)) for f in range(period))
    assert (period, whole, kept) == (33, 1312, 1280)  # one page of 41 straddles each boundary
    assert (whole - kept) / whole < 0.025


@pytest.mark.parametrize("dims", [BUNDLED, V32_FP8, TINY], ids=["bundled", "v32-fp8", "tiny"])
def test_the_arena_takes_the_two_pools_bytes_to_within_a_frame(dims):
    """For every physical pool larger than a frame and a page (every engine's: it holds a device
    buffer), the arena is no more than one frame over the two pools' bytes, and its keys' view
    holds exactly the usable logical pages asked for."""
    row, key = dims
    c = pick_pages_per_frame(row, key)
    frame = c * row  # bytes of a frame per position of a page (the page size cancels)
    for device_pages in range(c + 2, 60, 3):
        for logical_pages in range(1, 300, 7):
            c_, num_frames, view = arena_layout(row, key, device_pages, logical_pages)
            assert c_ == c
            pools = device_pages * row + (logical_pages + 1) * key
            assert num_frames * frame <= pools + frame, (device_pages, logical_pages)
            assert num_frames * frame >= view * key
            arena = DeviceArena(4, row, key, device_pages, logical_pages)
            assert arena.logical.capacity_pages == logical_pages and arena.logical.num_pages == view
            assert arena.physical.capacity_pages == (num_frames - 1) * c


# --- frames changing hands -------------------------------------------------------------------------


def test_a_frame_is_zeroed_once_when_it_changes_hands_and_never_when_taken_back():
    """``on_take`` runs once for each free frame a side takes from the other side (or fresh); never
    for a frame the side still holds, nor for one it held last (an undone free, ``take`` right after
    ``free``, among them)."""
    arena = DeviceArena(2, *BUNDLED, device_pages=3, logical_pages=20)  # keys in every frame
    taken: list[int] = []
    arena.frames.on_take = taken.append
    rows = arena.physical.allocate(3, 0)
    top = [arena.frames.num_frames - 1, arena.frames.num_frames - 2]
    assert taken == top, "two frames, the highest first"
    assert {arena.physical.frame_of(p) for p in rows} == set(top)
    assert rows == sorted(rows) and arena.physical.frame_of(rows[0]) == top[1], "the highest pages, in order"
    arena.physical.free(rows[-1:], 0)
    assert arena.frames.holder[arena.physical.frame_of(rows[-1])] == PHYSICAL, "its frame stays held"
    arena.physical.take(rows[-1:], 0)
    arena.physical.free(rows, 0)  # both frames go free
    arena.physical.take(rows, 0)  # the free undone: its bytes are the row's own
    assert taken == top
    arena.physical.free(rows, 0)
    arena.physical.allocate(3, 2)  # the rows' side again: its own bytes, nothing zeroed
    assert taken == top
    arena.physical.free(arena.physical.pages_of(2), 2)
    everything = arena.logical.allocate(arena.logical.num_free_pages, 1)  # the keys take every frame
    held = sorted({arena.logical.frame_of(p) for p in everything})
    assert taken[len(top) :] == held, "each frame the keys took zeroed once, the lowest first"
    assert set(top) <= set(held), "the rows' frames went to the keys"
    arena.check_integrity()


# --- the state machine -----------------------------------------------------------------------------

OWNERS = 3
TRIAL = 99  # owner of the pages a fits() check allocates on a snapshot
SIDES = (PHYSICAL, LOGICAL)


class ArenaMachine(RuleBasedStateMachine):
    """Both sides of one arena under allocate / free / take / transfer by a few owners."""

    def __init__(self) -> None:
        super().__init__()
        self.arena: DeviceArena | None = None
        self.owned: dict[tuple[int, int], set[int]] = {}  # (side, owner) -> its pages
        self.taken: list[int] = []  # frames on_take saw in the current rule
        self.last_holder: dict[int, int] = {}  # frame -> the side that took it last
        self.last_free: tuple[int, int, list[int]] | None = None  # (side, owner, pages) freed last

    @initialize(
        dims=st.sampled_from([BUNDLED, V32_FP8, TINY]),
        page=st.sampled_from([1, 2, 4]),
        device_pages=st.integers(2, 16),
        logical_pages=st.integers(1, 32),
    )
    def start(self, dims, page, device_pages, logical_pages) -> None:
        self.arena = DeviceArena(page, *dims, device_pages=device_pages, logical_pages=logical_pages)
        self.arena.frames.on_take = self.taken.append
        self.initial = self._free_counts()

    def _free_counts(self) -> tuple[int, int, int]:
        a = self.arena
        return a.physical.num_free_pages, a.logical.num_free_pages, a.frames.num_free

    def _side(self, side: int):
        return self.arena.physical if side == PHYSICAL else self.arena.logical

    def _allocated(self, side: int) -> list[int]:
        return sorted(p for (s, _), pages in self.owned.items() if s == side for p in pages)

    def _step(self, action, *, undo: bool = False) -> None:
        """Run ``action``: each frame it takes (free before, held after) is zeroed once when the
        other side (or nobody) held it last, and no other frame is: a side gets its own bytes
        back as it left them (an undone free, ``undo``, among them)."""
        before = list(self.arena.frames.holder)
        self.taken.clear()
        self.last_free = None  # (a free is undone right after it, as the prefix cache does)
        action()
        after = self.arena.frames.holder
        took = [f for f, (b, a) in enumerate(zip(before, after)) if b == FREE and a in SIDES]
        changed = [f for f in took if self.last_holder.get(f, FREE) != after[f]]
        assert not undo or not changed, f"an undone free zeroed {changed}"
        assert sorted(self.taken) == changed, f"zeroed {self.taken}, expected {changed}"
        for f in took:
            self.last_holder[f] = after[f]

    # --- rules ----------------------------------------------------------------------------------

    @rule(side=st.sampled_from(SIDES), owner=st.integers(0, OWNERS - 1), num_pages=st.integers(0, 9))
    def allocate(self, side, owner, num_pages) -> None:
        alloc = self._side(side)
        could = alloc.can_allocate(num_pages)
        snap = self.arena.snapshot()
        got: list[int] = []
        try:
            self._step(lambda: got.extend(alloc.allocate(num_pages, owner)))
        except OutOfMemory:
            assert not could, "can_allocate said yes"
            assert self.arena.snapshot() == snap, "a failed allocation changed the arena"
            return
        assert could, "can_allocate said no"
        assert len(got) == len(set(got)) == num_pages
        assert not set(got) & set(self._allocated(side)), "handed out an allocated page"
        if got:
            self.owned.setdefault((side, owner), set()).update(got)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free(self, data) -> None:
        side, owner = data.draw(st.sampled_from(sorted(self.owned)))
        mine = sorted(self.owned[side, owner])
        pages = data.draw(st.lists(st.sampled_from(mine), min_size=1, unique=True))
        self._step(lambda: self._side(side).free(pages, owner))
        self._forget(side, owner, pages)
        self.last_free = (side, owner, pages)  # (until the next rule)

    def _forget(self, side: int, owner: int, pages) -> None:
        self.owned[side, owner] -= set(pages)
        if not self.owned[side, owner]:
            del self.owned[side, owner]

    @precondition(lambda self: self.last_free is not None)
    @rule()
    def take_back(self) -> None:
        """Undo the free of the rule before: the pages, and the frames that went free with them,
        are the owner's again."""
        side, owner, pages = self.last_free
        self._step(lambda: self._side(side).take(pages, owner), undo=True)
        self.owned.setdefault((side, owner), set()).update(pages)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def take_an_allocated_page(self, data) -> None:
        side, owner = data.draw(st.sampled_from(sorted(self.owned)))
        page = data.draw(st.sampled_from(sorted(self.owned[side, owner])))
        snap = self.arena.snapshot()
        with pytest.raises(OwnershipError):
            self._side(side).take([page], (owner + 1) % OWNERS)
        assert self.arena.snapshot() == snap

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), new_owner=st.integers(0, OWNERS - 1))
    def transfer(self, data, new_owner) -> None:
        side, owner = data.draw(st.sampled_from(sorted(self.owned)))
        pages = data.draw(st.lists(st.sampled_from(sorted(self.owned[side, owner])), min_size=1, unique=True))
        self._step(lambda: self._side(side).transfer(pages, owner, new_owner))
        self._forget(side, owner, pages)
        self.owned.setdefault((side, new_owner), set()).update(pages)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free_an_unowned_page(self, data) -> None:
        side, owner = data.draw(st.sampled_from(sorted(self.owned)))
        other = (owner + 1) % OWNERS
        page = data.draw(st.sampled_from(sorted(self.owned[side, owner])))
        snap = self.arena.snapshot()
        with pytest.raises(OwnershipError):
            self._side(side).free([page], other)
        assert self.arena.snapshot() == snap

    @rule(data=st.data())
    def fits(self, data) -> None:
        """``fits`` (and ``free_pages_after``) answer what freeing the given pages and then
        allocating does, in either order; checked on a snapshot, restored after."""
        freed = {
            side: data.draw(st.lists(st.sampled_from(pages), unique=True))
            if (pages := self._allocated(side))
            else []
            for side in SIDES
        }
        # asks near what either side could have alone, where the two sides' competition decides
        logical, physical = (
            data.draw(st.integers(0, self._side(side).num_free_pages + len(freed[side]) + 1))
            for side in SIDES[::-1]
        )
        answer = self.arena.fits(
            logical, physical, freed_physical=freed[PHYSICAL], freed_logical=freed[LOGICAL]
        )
        after = {
            side: self.arena.free_pages_after(
                side, freed_physical=freed[PHYSICAL], freed_logical=freed[LOGICAL]
            )
            for side in SIDES
        }
        for order in ((LOGICAL, logical), (PHYSICAL, physical)), ((PHYSICAL, physical), (LOGICAL, logical)):
            snap = self.arena.snapshot()
            for side in SIDES:
                alloc = self._side(side)
                for page in freed[side]:
                    alloc.free([page], alloc.owner_of(page))
            assert {side: self._side(side).num_free_pages for side in SIDES} == after
            done = self._allocate_then_restore(order, snap)
            assert done == answer, f"fits said {answer}, allocating {order} {'did' if done else 'did not'}"

    def _allocate_then_restore(self, order, snap) -> bool:
        """Whether allocating ``order``'s (side, pages) in turn succeeds; the arena back at ``snap``."""
        try:
            for side, n in order:
                self._side(side).allocate(n, TRIAL)
            done = True
        except OutOfMemory:
            done = False
        self.arena.restore(snap)
        assert self.arena.snapshot() == snap
        return done

    @precondition(lambda self: any(s == PHYSICAL and pages for (s, _), pages in self.owned.items()))
    @rule(data=st.data())
    def fits_after_demotions(self, data) -> None:
        """``fits`` with ``moves`` (demotions: an owner's physical pages freed, then as many as it
        keeps allocated to it again) answers what making the moves in turn and then allocating
        does, in either order; checked on a snapshot, restored after."""
        owners = sorted({o for (s, o), pages in self.owned.items() if s == PHYSICAL and pages})
        chosen = data.draw(st.lists(st.sampled_from(owners), min_size=1, unique=True))
        moves = [
            (sorted(self.owned[PHYSICAL, o]), data.draw(st.integers(0, len(self.owned[PHYSICAL, o]))))
            for o in chosen
        ]
        logical, physical = (
            data.draw(st.integers(0, self._side(side).num_free_pages + 3)) for side in SIDES[::-1]
        )
        answer = self.arena.fits(logical, physical, moves=moves)
        for order in ((LOGICAL, logical), (PHYSICAL, physical)), ((PHYSICAL, physical), (LOGICAL, logical)):
            snap = self.arena.snapshot()
            for owner, (pages, keep) in zip(chosen, moves):
                self.arena.physical.free(pages, owner)
                kept = self.arena.physical.allocate(keep, owner)
                free = set(self.arena.physical.snapshot()[0])
                assert not free or not kept or max(free) < min(kept), "the highest free pages"
            done = self._allocate_then_restore(order, snap)
            assert done == answer, f"fits said {answer} after {moves}, allocating {order}: {done}"
        self.taken.clear()  # (the trials' frames: undone with the snapshot)

    # --- checks ---------------------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        if self.arena is None:
            return
        self.arena.check_integrity()
        for side in SIDES:
            alloc = self._side(side)
            owners = sorted(o for (s, o) in self.owned if s == side)
            assert alloc.owners() == owners
            for owner in owners:
                assert alloc.pages_of(owner) == frozenset(self.owned[side, owner])

    @invariant()
    def no_byte_is_a_row_and_a_key(self) -> None:
        """Byte ranges of one layer's slab: physical page p is [p*P*R, (p+1)*P*R), logical page g
        [g*P*K, (g+1)*P*K); the allocated ones of the two sides never overlap, and lie in the slab."""
        if self.arena is None:
            return
        a = self.arena
        p, r, k = a.page_size, a.row_bytes, a.key_bytes
        slab = a.physical.num_pages * p * r
        ranges = [(page * p * r, (page + 1) * p * r, "row") for page in self._allocated(PHYSICAL)]
        ranges += [(g * p * k, (g + 1) * p * k, "key") for g in self._allocated(LOGICAL)]
        ranges.sort()
        for (_, end, kind), (next_start, _, next_kind) in itertools.pairwise(ranges):
            assert end <= next_start, f"a {kind} page and a {next_kind} page share bytes at {next_start}"
        assert not ranges or ranges[-1][1] <= slab

    def teardown(self) -> None:
        if self.arena is None:
            return
        for (side, owner), pages in list(self.owned.items()):
            alloc = self._side(side)
            mine = sorted(pages)
            self._step(lambda alloc=alloc, mine=mine, owner=owner: alloc.free(mine, owner))
        self.owned.clear()
        self.arena.check_integrity()
        assert self._free_counts() == self.initial, "a free count is not back at its initial value"
        assert all(h == FREE for h in self.arena.frames.holder[1:]), "a frame is still held"


TestArenaMachine = pytest.mark.proptest(ArenaMachine.TestCase)
TestArenaMachine.settings = machine_settings(examples=100, steps=50)


# --- under a coordinator ---------------------------------------------------------------------------


def test_keys_in_a_frame_a_released_full_row_left_read_zeros(tiny_model):
    """A FULL row's device rows hold non-finite garbage; once it is released, a HOT admission's keys
    take its frames, and every key of its fresh locations reads zero."""
    cfg = EngineConfig(
        dtype="float64",
        page_size=4,
        max_context_len=128,
        max_running_requests=4,
        device_pool_tokens=64,
        chunked_prefill_tokens=32,
        speculative=None,
        hisparse=HiSparseConfig(device_buffer_size=16, host_to_device_ratio=4, residency="dynamic"),
    )
    executor = Executor(cfg, model=tiny_model)
    try:
        memory = executor.memory
        arena = memory.alloc.arena
        outsider = 1000  # owner of the pages the test holds itself (no request row)
        # the frames above the keys' view first, so that the row's rows land where keys can go
        keyless = [f for f in range(1, arena.frames.num_frames) if not arena.logical.frame_pages[f]]
        above = arena.physical.allocate(len(keyless) * arena.pages_per_frame, outsider)
        row = memory.admit(40)
        memory.prefill_targets(row, 0, 32)
        memory.commit_prefill(row, 0, 32, final=False)
        memory.prefill_targets(row, 32, 40)
        memory.commit_prefill(row, 32, 40, final=True)
        memory.start_staging(row, 40)
        memory.wait_staging()
        assert memory.collect_ready([row]) == [row] and memory.layout(row) is Layout.FULL
        pages = memory._mem[row].full_pages
        frames = {arena.physical.frame_of(p) for p in pages}
        assert all(arena.logical.frame_pages[f] for f in frames)
        memory.device_kv[:, page_slots(pages, 4)] = float("nan")
        hog = arena.logical.allocate(arena.logical.num_free_pages, outsider)  # every other key page
        memory.release(row)
        assert all(arena.frames.holder[f] == FREE for f in frames)
        hot_pages, logical_pages, _ = memory._needs(24, False, 0)
        # every free key page but the newcomer's goes, the lowest first: its keys take the highest of
        # the row's old frames, and its rows only fit above the keys in a HOT layout
        hog += arena.logical.allocate(arena.logical.num_free_pages - logical_pages, outsider)
        arena.physical.free(above[:hot_pages], outsider)
        above = above[hot_pages:]
        memory.check_integrity()
        assert not memory.alloc.fits(logical_pages, memory.layouts.full_pages(24))
        newcomer = memory.admit(24)
        assert memory.layout(newcomer) is Layout.HOT
        locs = memory.req_to_token[newcomer, :24]
        reused = {arena.logical.frame_of(int(g)) for g in locs // 4}
        assert reused and reused <= frames, "the newcomer's keys are not in the row's old frames"
        keys = memory.index_k[:, locs]
        assert bool(torch.isfinite(keys).all()) and not bool(keys.any()), "a fresh key reads old bytes"
        memory.release(newcomer)
        arena.logical.free(hog, outsider)
        arena.physical.free(above, outsider)
        memory.check_integrity()
    finally:
        executor.close()
