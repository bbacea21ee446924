"""One device arena for the KV rows and the indexer keys of a dynamic-residency engine.

A dynamic engine (``HiSparseConfig.residency="dynamic"``) keeps a request's whole context on the
device while memory lasts and falls back to the hot buffer under pressure. Its two device pools
trade memory the other way round as load grows: FULL requests want KV rows (the physical pool),
HOT requests want indexer keys for every location (the logical pool) and only a buffer of rows.
Two fixed pools would leave the keys of unused seats idle while FULL requests are turned away, so
both pools are views of one tensor, and its memory is handed out in **frames**:

::

    device_kv[layer]  | frame 0 (reserved) | frame 1 | frame 2 | ... | frame F-1 |
                        c physical pages each, at bytes [f * c*P*R, (f+1) * c*P*R) of the layer
    index_k[layer]    | the same bytes, read as keys: logical page g at [g * P*K, (g+1) * P*K)

Each frame is free or held by one side. The physical side holds a frame to hand out its ``c``
pages; the logical side holds one to hand out the key pages that lie wholly inside it (``c`` is
picked so that few key pages straddle two frames; those are never handed out). A side takes a free
frame when its held frames have no free page left, and gives a frame back as soon as none of its
pages is allocated, so the free frames are what either side can grow into. The physical side takes
the highest free frame and the logical side the lowest (the keys are a prefix of each layer's
bytes), so the two meet in the middle. Within its frames the physical side hands out its highest
free pages, and takes a free frame without key pages before it uses a free page of a frame with
some: a KV row low in the arena keeps its whole frame from the keys, which at high load (every
request HOT) need the keys' whole view. A frame changing hands is zeroed (``on_take``): neither
side ever reads the other's bytes as its own.

Known rounding: frame 0 holds ``c`` physical pages and a frame of key pages where separate pools
reserve one page each, and the arena is whole frames; so a device pool that HiSparse's buffers fill
to within two frames holds one request fewer in the arena, at the seats, than the plan counts.

Frame 0 is reserved: it holds physical page 0 (the sink "no device copy" points at) and logical
page 0 (location 0 is never a real token).

Invariant I15 (docs/invariants.md): every allocated page of either side lies in a frame its side
holds, every held frame has an allocated page, and each frame's count of allocated pages is exact;
so no byte of the arena backs a KV row and an indexer key at once.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

import attrs
import torch

from pipeline.memory.paged import FREE, RESERVED, OutOfMemory, OwnershipError

DORMANT = -3  # owner of a page whose frame its side does not hold
PHYSICAL, LOGICAL = 0, 1  # the two sides; a frame's holder is one of them, FREE or RESERVED
SIDE_NAMES = ("physical", "logical")
MAX_PAGES_PER_FRAME = 8  # the most physical pages a frame is made of


def key_pages_in(frame: int, pages_per_frame: int, row_bytes: int, key_bytes: int, num_pages: int) -> range:
    """Logical pages that lie wholly inside ``frame`` (in units of one position's bytes: a logical
    page of P keys is P * key_bytes, a frame c * P * row_bytes; P cancels)."""
    span = pages_per_frame * row_bytes
    first = -(-(frame * span) // key_bytes)
    end = ((frame + 1) * span) // key_bytes  # pages [first, end) end inside the frame
    return range(min(first, num_pages), min(max(first, end), num_pages))


def pick_pages_per_frame(row_bytes: int, key_bytes: int) -> int:
    """The frame size (physical pages, at most ``MAX_PAGES_PER_FRAME``) that loses the smallest share
    of key pages to frame boundaries; the smallest of equals."""

    def lost(c: int) -> float:
        span = c * row_bytes
        whole = span // key_bytes  # key pages per frame if the frame started on a page boundary
        return 1 - whole * key_bytes / span if span % key_bytes else 0.0

    return min(range(1, MAX_PAGES_PER_FRAME + 1), key=lambda c: (round(lost(c), 6), c))


def arena_layout(
    row_bytes: int, key_bytes: int, device_pages: int, logical_pages: int
) -> tuple[int, int, int]:
    """(physical pages per frame, frames, logical pages of the keys' view) of the arena that takes the
    bytes of a physical pool of ``device_pages`` pages (page 0 included) and of the keys of
    ``logical_pages`` usable logical pages (and page 0), at whole frames, never fewer than the keys
    need: the memory plan (``pipeline.capacity``) and the allocator both size it here."""
    if key_bytes > row_bytes * MAX_PAGES_PER_FRAME:
        raise ValueError(f"device arena: a key of {key_bytes} bytes is wider than a frame")
    c = pick_pages_per_frame(row_bytes, key_bytes)
    total = device_pages * row_bytes + (logical_pages + 1) * key_bytes  # in a page's worth of positions
    num_frames = max(2, total // (c * row_bytes))
    while True:
        usable = 0
        for frame in range(1, num_frames):
            pages = key_pages_in(frame, c, row_bytes, key_bytes, 1 << 62)
            if usable + len(pages) >= logical_pages:
                return c, num_frames, pages.start + (logical_pages - usable)
            usable += len(pages)
        num_frames += 1  # the keys need more room than the rows: grow the arena


@attrs.define(eq=False)
class Frames:
    """Which side holds each frame, and how many of its pages that side has allocated."""

    num_frames: int
    counts: tuple[list[int], list[int]]  # per side, per frame: the pages of that side inside it
    holder: list[int] = attrs.field(init=False)
    used: list[int] = attrs.field(init=False)
    # the free frames, lowest first (the logical side: only frames with key pages) and highest first
    # (the physical side); entries of frames taken since are skipped when met (``holder`` decides)
    _low: list[int] = attrs.field(init=False)
    _high: list[int] = attrs.field(init=False)
    num_free: int = attrs.field(init=False)
    free_pages: list[int] = attrs.field(init=False)  # per side: its pages in the free frames
    on_take: Callable[[int], None] | None = None  # a frame changing hands (zero it)
    last: list[int] = attrs.field(init=False)  # per frame: the side that held it last (FREE: none)

    def __attrs_post_init__(self) -> None:
        if self.num_frames < 2:
            raise ValueError(f"device arena: needs at least 2 frames, got {self.num_frames}")
        self.holder = [RESERVED] + [FREE] * (self.num_frames - 1)
        self.last = [FREE] * self.num_frames
        self.used = [0] * self.num_frames
        self._rebuild()

    def _rebuild(self) -> None:
        free = [f for f in range(self.num_frames) if self.holder[f] == FREE]
        self.num_free = len(free)
        self.free_pages = [sum(self.counts[side][f] for f in free) for side in (PHYSICAL, LOGICAL)]
        self._low = [f for f in free if self.counts[LOGICAL][f]]
        self._high = [-f for f in reversed(free)]
        heapq.heapify(self._high)

    def _heap(self, side: int) -> tuple[list[int], int]:
        return (self._high, -1) if side == PHYSICAL else (self._low, 1)

    def free_frames(self, side: int) -> list[int]:
        """The free frames ``side`` can use, in the order it takes them (changes nothing)."""
        heap, sign = self._heap(side)
        return [sign * f for f in sorted(heap) if self.holder[sign * f] == FREE]

    def first_free(self, side: int) -> int:
        """The free frame ``side`` takes next (there is one: the caller counted)."""
        heap, sign = self._heap(side)
        while self.holder[sign * heap[0]] != FREE:
            heapq.heappop(heap)
        return sign * heap[0]

    def take(self, frame: int, side: int) -> None:
        """``side`` takes the free ``frame``, zeroed (``on_take``) when the other side held it last
        (or nobody did): a side's own bytes come back as it left them, as in a pool of its own."""
        assert self.holder[frame] == FREE, f"device arena: frame {frame} is not free"
        changes_hands = self.last[frame] != side
        self.holder[frame] = self.last[frame] = side
        self.num_free -= 1
        for s in (PHYSICAL, LOGICAL):
            self.free_pages[s] -= self.counts[s][frame]
        if len(self._high) > 2 * self.num_free + 64:  # stale entries piled up
            self._rebuild()
        if changes_hands and self.on_take is not None:
            self.on_take(frame)

    def give_back(self, frame: int, side: int) -> None:
        assert self.holder[frame] == side and self.used[frame] == 0, (
            frame,
            self.holder[frame],
            self.used[frame],
        )
        self.holder[frame] = FREE
        self.num_free += 1
        for s in (PHYSICAL, LOGICAL):
            self.free_pages[s] += self.counts[s][frame]
        if self.counts[LOGICAL][frame]:
            heapq.heappush(self._low, frame)
        heapq.heappush(self._high, -frame)

    def snapshot(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.holder), tuple(self.used), tuple(self.last)

    def restore(self, snap: tuple[tuple[int, ...], ...]) -> None:
        self.holder, self.used, self.last = list(snap[0]), list(snap[1]), list(snap[2])
        self._rebuild()

    def check_integrity(self) -> None:
        assert self.holder[0] == RESERVED, "device arena: frame 0 must stay reserved"
        free = [f for f, h in enumerate(self.holder) if h == FREE]
        assert len(free) == self.num_free, f"device arena: {len(free)} free frames, {self.num_free} counted"
        for side in (PHYSICAL, LOGICAL):
            pages = sum(self.counts[side][f] for f in free)
            assert pages == self.free_pages[side], (
                f"device arena: {SIDE_NAMES[side]} pages of free frames miscounted"
            )
        for frame, (holder, used) in enumerate(zip(self.holder, self.used)):
            if holder in (PHYSICAL, LOGICAL):
                assert used > 0, (
                    f"device arena: frame {frame} held by the {SIDE_NAMES[holder]} side with no page in use"
                )
            else:
                assert used == 0, f"device arena: frame {frame} is not held but counts {used} pages"


@attrs.define(eq=False)
class ArenaSide:
    """One side's pages of a ``Frames`` arena, behind ``PagedAllocator``'s interface: whole pages,
    each owned by at most one request row, handed out only from frames this side holds (taking free
    frames as needed) and given back with their frame once it has none in use."""

    name: str
    side: int
    frames: Frames
    num_pages: int  # pages of this side's view, the unusable ones included
    page_size: int
    frame_pages: list[range]  # per frame, this side's pages inside it
    reserve_first_page: bool = True
    _frame_of: list[int] = attrs.field(init=False)  # per page: its frame, -1 for a page never used
    _owner: list[int] = attrs.field(init=False)
    _free: set[int] = attrs.field(init=False, factory=set)  # free pages of held frames
    _owned: dict[int, set[int]] = attrs.field(init=False, factory=dict)
    _usable: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._frame_of = [-1] * self.num_pages
        self._owner = [RESERVED] * self.num_pages
        for frame, pages in enumerate(self.frame_pages):
            for page in pages:
                self._frame_of[page] = frame
                if frame:  # frame 0 is reserved
                    self._owner[page] = DORMANT
        self._usable = sum(len(pages) for pages in self.frame_pages[1:])

    # --- PagedAllocator's interface -------------------------------------------------------------

    @property
    def capacity_pages(self) -> int:
        return self._usable

    @property
    def num_free_pages(self) -> int:
        """Free pages of the frames this side holds, and every page of the free frames it could take
        (the other side may take the same free frames: ``free_after`` answers for both at once)."""
        return len(self._free) + self.frames.free_pages[self.side]

    def can_allocate(self, num_pages: int) -> bool:
        return 0 <= num_pages <= self.num_free_pages

    def allocate(self, num_pages: int, owner: int) -> list[int]:
        """Hand ``num_pages`` pages to ``owner``: free pages of held frames first, taking free frames
        in this side's order when they are too few; the logical side's lowest pages, the physical
        side's highest (in order), and the physical side takes a free frame without key pages rather
        than use a free page of a frame that has some (a row in such a frame keeps it from the
        keys). Raises ``OutOfMemory`` and changes nothing if short."""
        if owner < 0:
            raise ValueError(f"{self.name}: owner must be a request row >= 0, got {owner}")
        if not self.can_allocate(num_pages):
            raise OutOfMemory(self.name, num_pages, self.num_free_pages)
        while len(self._free) < num_pages:
            self._take(self.frames.first_free(self.side))
        free = sorted(self._free)
        if self.side == LOGICAL or not num_pages:
            pages = free[:num_pages]
        else:
            while self.frames.counts[LOGICAL][self._frame_of[free[-num_pages]]] and self.frames.num_free:
                top = self.frames.first_free(PHYSICAL)
                if self.frames.counts[LOGICAL][top]:
                    break  # every free frame has key pages
                self._take(top)
                free = sorted(self._free)
            pages = free[-num_pages:]
        mine = self._owned.setdefault(owner, set())
        for page in pages:
            self._free.discard(page)
            self._owner[page] = owner
            self.frames.used[self._frame_of[page]] += 1
            mine.add(page)
        if not mine:
            self._owned.pop(owner, None)
        return pages

    def _take(self, frame: int) -> None:
        """Take the free ``frame``: its pages are free pages of a held frame."""
        self.frames.take(frame, self.side)
        for page in self.frame_pages[frame]:
            self._owner[page] = FREE
            self._free.add(page)

    def check_owned(self, pages: Iterable[int], owner: int) -> None:
        seen: set[int] = set()
        for page in pages:
            actual = self._owner[page] if 0 <= page < self.num_pages else RESERVED
            if actual != owner or page in seen:
                raise OwnershipError(self.name, page, owner, FREE if page in seen else min(actual, FREE))
            seen.add(page)

    def free(self, pages: Iterable[int], owner: int) -> None:
        """Return ``owner``'s pages (a frame with none left in use goes back); raises
        ``OwnershipError`` and changes nothing on any bad page."""
        pages = list(pages)
        self.check_owned(pages, owner)
        mine = self._owned.get(owner, set())
        emptied = []
        for page in pages:
            frame = self._frame_of[page]
            self._owner[page] = FREE
            self._free.add(page)
            mine.discard(page)
            self.frames.used[frame] -= 1
            if not self.frames.used[frame]:
                emptied.append(frame)
        if not mine:
            self._owned.pop(owner, None)
        for frame in emptied:
            for page in self.frame_pages[frame]:
                self._free.discard(page)
                self._owner[page] = DORMANT
            self.frames.give_back(frame, self.side)

    def take(self, pages: Iterable[int], owner: int) -> None:
        """Hand ``owner`` these free pages (undoes a ``free``, taking their frames back if they went
        free); raises ``OwnershipError`` and changes nothing unless every page can be taken."""
        pages = list(pages)
        if owner < 0:
            raise ValueError(f"{self.name}: owner must be >= 0, got {owner}")
        for page in pages:
            actual = self._owner[page] if 0 <= page < self.num_pages else RESERVED
            free = actual == FREE or (actual == DORMANT and self.frames.holder[self._frame_of[page]] == FREE)
            if not free or pages.count(page) > 1:
                raise OwnershipError(self.name, page, owner, min(actual, FREE))
        for page in pages:
            frame = self._frame_of[page]
            if self.frames.holder[frame] == FREE:  # (zeroed only if the other side held it since)
                self.frames.take(frame, self.side)
                for other in self.frame_pages[frame]:
                    self._owner[other] = FREE
                    self._free.add(other)
            self._free.discard(page)
            self._owner[page] = owner
            self.frames.used[frame] += 1
            self._owned.setdefault(owner, set()).add(page)

    def transfer(self, pages: Iterable[int], owner: int, new_owner: int) -> None:
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
        """``[num_pages]`` int64 owner of each page (FREE / RESERVED / DORMANT / request row)."""
        return torch.tensor(self._owner, dtype=torch.int64)

    def frame_of(self, page: int) -> int:
        return self._frame_of[page]

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(sorted(self._free)), tuple(self._owner)

    def restore(self, snap: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
        """Put this side back as it was at ``snap`` (restore the ``Frames`` with it)."""
        self._free = set(snap[0])
        self._owner = list(snap[1])
        self._owned = {}
        for page, owner in enumerate(self._owner):
            if owner >= 0:
                self._owned.setdefault(owner, set()).add(page)

    def check_integrity(self) -> None:
        """Invariant I1 for this side, and its half of I15 (module docstring)."""
        name, frames = self.name, self.frames
        counts: dict[int, int] = {}
        for page, owner in enumerate(self._owner):
            frame = self._frame_of[page]
            if frame <= 0:
                assert owner == RESERVED, f"{name}: page {page} outside the usable frames has owner {owner}"
                continue
            held = frames.holder[frame] == self.side
            if owner == DORMANT:
                assert not held, f"{name}: page {page} of held frame {frame} is dormant"
            else:
                assert held, (
                    f"{name}: page {page} (owner {owner}) lies in frame {frame}, "
                    "which this side does not hold"
                )
            if owner == FREE:
                assert page in self._free, f"{name}: free page {page} missing from the free set"
            elif owner >= 0:
                counts[frame] = counts.get(frame, 0) + 1
        for page in self._free:
            assert self._owner[page] == FREE, f"{name}: free-set page {page} has owner {self._owner[page]}"
        for frame, holder in enumerate(frames.holder):
            if holder == self.side:
                assert counts.get(frame, 0) == frames.used[frame], (
                    f"{name}: frame {frame} counts {frames.used[frame]} pages in use, "
                    f"holds {counts.get(frame, 0)}"
                )
        for owner, pages in self._owned.items():
            assert pages, f"{name}: empty ownership record for {owner}"
            for page in pages:
                assert self._owner[page] == owner, f"{name}: page {page} listed for {owner}"


@attrs.define(eq=False)
class DeviceArena:
    """The frames of one dynamic engine's device memory and its two sides."""

    page_size: int
    row_bytes: int  # one position's KV row, one layer
    key_bytes: int  # one location's indexer key, one layer
    device_pages: int  # the physical pool's pages as separate pools would have it (page 0 included)
    logical_pages: int  # usable logical pages (page 0 excluded); their keys' bytes join the arena
    pages_per_frame: int = attrs.field(init=False)
    frames: Frames = attrs.field(init=False)
    physical: ArenaSide = attrs.field(init=False)
    logical: ArenaSide = attrs.field(init=False)
    _keys_per_frame: int = attrs.field(init=False)  # the most key pages in one frame

    def __attrs_post_init__(self) -> None:
        c, num_frames, view = arena_layout(
            self.row_bytes, self.key_bytes, self.device_pages, self.logical_pages
        )
        self.pages_per_frame = c
        physical = [range(f * c, (f + 1) * c) for f in range(num_frames)]
        logical = [key_pages_in(f, c, self.row_bytes, self.key_bytes, view) for f in range(num_frames)]
        self.frames = Frames(num_frames, ([len(r) for r in physical], [len(r) for r in logical]))
        p = self.page_size
        self.physical = ArenaSide("physical", PHYSICAL, self.frames, num_frames * c, p, physical)
        self.logical = ArenaSide("logical", LOGICAL, self.frames, view, p, logical)
        self._keys_per_frame = max(1, max(len(r) for r in logical))

    @property
    def physical_rows(self) -> int:
        return self.physical.num_pages * self.page_size

    @property
    def logical_rows(self) -> int:
        return self.logical.num_pages * self.page_size

    def _after(
        self,
        freed_physical: Iterable[int],
        freed_logical: Iterable[int],
        moves: Iterable[tuple[Iterable[int], int]] = (),
    ) -> tuple[list[int], set[int]]:
        """(free pages of held frames per side, free frames) once the allocated pages ``freed_*`` are
        freed, then each of ``moves`` made in turn: its physical pages freed and as many as it keeps
        allocated again (a demotion: ``ArenaSide.allocate``'s order, the highest first). Changes
        nothing."""
        used = list(self.frames.used)
        free = set(self.frames.free_frames(PHYSICAL))
        physical, logical = self.physical, self.logical
        holes: dict[int, int] = {}  # physical side: free pages per held frame
        for page in physical._free:
            frame = physical.frame_of(page)
            holes[frame] = holes.get(frame, 0) + 1
        logical_holes = len(logical._free)

        def release(side: ArenaSide, pages: Iterable[int]) -> None:
            nonlocal logical_holes
            for page in pages:
                frame = side.frame_of(page)
                used[frame] -= 1
                if side is physical:
                    holes[frame] = holes.get(frame, 0) + 1
                else:
                    logical_holes += 1
                if used[frame] == 0:  # the frame goes back whole
                    free.add(frame)
                    if side is physical:
                        del holes[frame]
                    else:
                        logical_holes -= len(side.frame_pages[frame])

        release(physical, freed_physical)
        release(logical, freed_logical)
        keyed = self.frames.counts[LOGICAL]

        def lowest_taken(keep: int) -> int:  # the frame of the lowest of the ``keep`` highest holes
            for frame in sorted(holes, reverse=True):
                keep -= holes[frame]
                if keep <= 0:
                    return frame
            return -1

        for pages, keep in moves:  # ``ArenaSide.allocate``'s choices, made on the counts
            release(physical, pages)
            while sum(holes.values()) < keep and free:
                frame = max(free)
                free.discard(frame)
                holes[frame] = len(physical.frame_pages[frame])
            while keep and free and keyed[lowest_taken(keep)] and not keyed[max(free)]:
                frame = max(free)
                free.discard(frame)
                holes[frame] = len(physical.frame_pages[frame])
            for frame in sorted(holes, reverse=True):  # and its pages, the highest first
                if keep <= 0:
                    break
                took = min(keep, holes[frame])
                keep -= took
                used[frame] += took
                holes[frame] -= took
                if not holes[frame]:
                    del holes[frame]
        return [sum(holes.values()), logical_holes], free

    def free_pages_after(
        self, side: int, *, freed_physical: Iterable[int] = (), freed_logical: Iterable[int] = ()
    ) -> int:
        """``side``'s free pages (its holes and every page of the free frames) once ``freed_*`` are freed."""
        holes, free = self._after(freed_physical, freed_logical)
        owner = self.physical if side == PHYSICAL else self.logical
        return holes[side] + sum(len(owner.frame_pages[f]) for f in free)

    def fits(
        self,
        logical: int,
        physical: int,
        *,
        freed_physical: Iterable[int] = (),
        freed_logical: Iterable[int] = (),
        moves: Iterable[tuple[Iterable[int], int]] = (),
    ) -> bool:
        """Whether ``logical`` logical pages and ``physical`` physical pages can be allocated together,
        once the allocated pages ``freed_*`` are freed and ``moves`` made (``_after``: what evictions
        and demotions would give back): the physical side takes the highest free frames, the logical
        side the lowest with key pages, and the two must not need the same frame."""
        freed_physical, freed_logical, moves = list(freed_physical), list(freed_logical), list(moves)
        if not (freed_physical or freed_logical or moves) and (
            physical <= len(self.physical._free) and logical <= len(self.logical._free)
        ):  # the usual step: the held frames' free pages suffice, no frame changes hands
            return True
        if not (freed_logical or moves) and physical > self._physical_bound(logical, len(freed_physical)):
            return False  # (a promotion's usual answer, found without ``_after``)
        holes, free = self._after(freed_physical, freed_logical, moves)
        high = sorted(free, reverse=True)
        low = [f for f in sorted(free) if self.logical.frame_pages[f]]
        need_p = self._frames_for(self.physical, physical - holes[PHYSICAL], high)
        need_l = self._frames_for(self.logical, logical - holes[LOGICAL], low)
        if need_p is None or need_l is None:
            return False
        return not set(high[:need_p]) & set(low[:need_l])

    def _physical_bound(self, logical: int, freed_physical: int) -> int:
        """At most how many physical pages the arena can give beside ``logical`` logical pages once
        ``freed_physical`` physical pages are freed: the logical side needs at least ``short``
        frames beyond its holes, and every other free frame (those the freed pages empty included)
        gives the physical side at most a frame's pages."""
        short = logical - len(self.logical._free)
        frames = -(-short // self._keys_per_frame) if short > 0 else 0
        spare_frames = self.frames.num_free - frames
        return len(self.physical._free) + freed_physical + self.pages_per_frame * spare_frames

    @staticmethod
    def _frames_for(side: ArenaSide, short: int, order: list[int]) -> int | None:
        if short <= 0:
            return 0
        for count, frame in enumerate(order, start=1):
            short -= len(side.frame_pages[frame])
            if short <= 0:
                return count
        return None

    def snapshot(self) -> tuple:
        return self.frames.snapshot(), self.physical.snapshot(), self.logical.snapshot()

    def restore(self, snap: tuple) -> None:
        self.frames.restore(snap[0])
        self.physical.restore(snap[1])
        self.logical.restore(snap[2])

    def check_integrity(self) -> None:
        self.frames.check_integrity()
        self.physical.check_integrity()
        self.logical.check_integrity()
