"""The prefix cache: pages of computed KV, found again by their tokens.

A finished (or retracted) request leaves its full pages here instead of freeing them; a request whose
prompt starts with the same tokens shares those pages and prefills only the rest. It is a chain of
page entries, as vLLM hashes full blocks: page ``i`` of a sequence is keyed by the entry of page
``i - 1`` and the page's tokens **plus the token after the page**. That extra token is there for the
MTP layer: its row at the page's last position pairs that position's hidden state with the next
token, so the row is only right for a sequence that continues with the same token. Keys are the
tokens themselves (no hashing, so no collision can alias two prefixes).

What an entry holds: one page in each pool the memory shares (``pools``): with HiSparse the logical
page (its indexer keys and the MTP layer's rows live on the device by logical location) and the host
page (the target's KV); all-resident, the device page (target KV, indexer keys and MTP rows). The
pages are owned by the cache (owner ``owner``, one past the request rows), so a request's release
never frees them.

MTP rows left for later: in speculative mode a request whose MTP layer is behind (it decoded plainly)
may leave its pages without their MTP rows, holding instead the target's hidden states at those
positions (``CachedPage.mtp_pending``, with the next tokens already in the key); the first request
that shares such a page writes its rows before anything reads them (``pending`` / ``clear_pending``),
and a page evicted first never costs them. ``pending_positions`` counts what the cache holds so.

Reference counts: a request sharing an entry holds one reference from its admission to its release.
An entry nobody references may be evicted: least recently used first, and only once no cached entry
continues it (leaves first), so every cached chain stays reachable from its first page. Memory held
only by unreferenced entries counts as free for admission and for a growing request
(``make_room``): the cache never keeps a request from being served.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from pipeline.memory.paged import PagedAllocator


@attrs.define(eq=False)
class CachedPage:
    key: tuple  # (parent entry id or -1, the page's tokens and the token after it)
    id: int
    parent: CachedPage | None
    pages: tuple[int, ...]  # one page per pool, in the cache's pool order
    refs: int = 0  # live requests sharing it
    children: int = 0  # cached entries that continue it
    last_used: int = 0
    # the page's MTP rows not written yet: (the first such offset within the page, the target's hidden
    # states at the page's positions from there on, ``[page_size - offset, D]``); None: all written
    mtp_pending: tuple[int, Any] | None = None


@attrs.define
class CacheCounters:
    queried_tokens: int = 0  # prompt tokens looked up at admission
    hit_tokens: int = 0  # of them, found cached
    inserted_pages: int = 0
    evicted_pages: int = 0

    def as_dict(self) -> dict[str, float]:
        rate = self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
        return {**attrs.asdict(self), "hit_rate": rate}


@attrs.define(eq=False)
class PrefixCache:
    page_size: int
    pools: tuple[PagedAllocator, ...]
    owner: int  # the owner id of cached pages in every pool (one past the request rows)
    entries: dict[tuple, CachedPage] = attrs.field(factory=dict)
    counters: CacheCounters = attrs.field(factory=CacheCounters)
    pending_positions: int = 0  # positions whose MTP rows the entries hold as hidden states
    # entries some request shares (``refs > 0``), counted as references come and go: the figures a
    # step reports read it, never a walk over every entry
    _referenced: int = attrs.field(default=0, init=False)
    _ids: itertools.count = attrs.field(factory=itertools.count)
    _clock: itertools.count = attrs.field(factory=lambda: itertools.count(1))

    # --- lookup ---------------------------------------------------------------------------------

    def _key(self, parent: CachedPage | None, tokens: Sequence[int], index: int) -> tuple:
        p = self.page_size
        return (-1 if parent is None else parent.id, tuple(tokens[index * p : (index + 1) * p + 1]))

    def match(self, tokens: Sequence[int]) -> list[CachedPage]:
        """The longest cached chain of ``tokens``' pages, each followed by its next token, leaving at
        least the last token to compute (its logits give the first output)."""
        chain: list[CachedPage] = []
        p = self.page_size
        parent = None
        for index in range((len(tokens) - 1) // p):
            entry = self.entries.get(self._key(parent, tokens, index))
            if entry is None:
                break
            chain.append(entry)
            parent = entry
        return chain

    def lock(self, chain: list[CachedPage]) -> None:
        """A request shares ``chain`` (from its admission to its release)."""
        now = next(self._clock)
        for entry in chain:
            self._referenced += entry.refs == 0
            entry.refs += 1
            entry.last_used = now

    def spare(self, chain: list[CachedPage]) -> int:
        """Pages (in every pool) eviction could free once a request shares ``chain``."""
        return self.evictable() - sum(1 for e in chain if e.refs == 0)

    def share(self, chain: list[CachedPage], needs: Sequence[int], num_tokens: int) -> None:
        """Admission of a prompt that matched ``chain`` (``num_tokens``: its tokens looked up): the
        request shares it, and the entries nobody shares make room for ``needs`` (one count per
        pool), which the caller checked with ``spare``. If making room fails, ``chain`` is not
        shared (the entries evicted before the failure stay evicted: each went whole)."""
        self.lock(chain)
        try:
            room = self.make_room(needs)
        except BaseException:
            self.unlock(chain)
            raise
        assert room, "the admission counted more spare cached pages than there are"
        self.counters.queried_tokens += num_tokens
        self.counters.hit_tokens += len(chain) * self.page_size

    def full_pages(self, length: int, tokens: Sequence[int]) -> int:
        """Leading pages of a request that ``insert`` may cache: KV committed for ``length``
        positions, and the token after each page known (``tokens``)."""
        return min(length // self.page_size, (len(tokens) - 1) // self.page_size)

    def unlock(self, chain: list[CachedPage]) -> None:
        now = next(self._clock)
        for entry in chain:
            assert entry.refs > 0, f"prefix cache: page entry {entry.id} released more often than shared"
            entry.refs -= 1
            self._referenced -= entry.refs == 0
            entry.last_used = now

    # --- insertion ------------------------------------------------------------------------------

    def insert(
        self, tokens: Sequence[int], shared: list[CachedPage], own_pages: Sequence[tuple[int, ...]], row: int
    ) -> int:
        """Cache the pages of a finished request ``row``: ``tokens`` its known tokens, ``shared``
        the entries it shares (its first pages), ``own_pages[j]`` its page ``len(shared) + j`` in
        each pool (only full pages whose KV and next token exist). Pages whose key is cached already
        stay the row's; the others are handed to the cache. Returns how many leading own pages were
        handed (the caller frees the rest with the row). A page goes whole: if handing it fails in
        one pool, its pages in the others go back to ``row`` and the error propagates (the pages
        handed before it stay cached)."""
        parent = shared[-1] if shared else None
        handed = 0
        now = next(self._clock)
        for j, pages in enumerate(own_pages):
            key = self._key(parent, tokens, len(shared) + j)
            if key in self.entries:  # the same content, cached by another request meanwhile
                break
            moved: list[tuple[PagedAllocator, int]] = []
            try:
                for pool, page in zip(self.pools, pages):
                    pool.transfer([page], row, self.owner)
                    moved.append((pool, page))
            except BaseException:
                for pool, page in moved:
                    pool.transfer([page], self.owner, row)
                self.counters.inserted_pages += handed
                raise
            entry = CachedPage(key, next(self._ids), parent, pages, last_used=now)
            self.entries[key] = entry
            if parent is not None:
                parent.children += 1
            parent = entry
            handed += 1
        self.counters.inserted_pages += handed
        return handed

    # --- MTP rows left for later ---------------------------------------------------------------

    def set_pending(self, entry: CachedPage, offset: int, hidden: Any) -> None:
        """``entry``'s MTP rows from ``offset`` within its page on are not written: ``hidden`` holds
        the target's hidden states there (one row per position to the page's end)."""
        assert entry.mtp_pending is None and entry.refs == 0, (
            f"prefix cache: page entry {entry.id} is not new"
        )
        assert len(hidden) == self.page_size - offset, "prefix cache: pending rows must reach the page's end"
        entry.mtp_pending = (offset, hidden)
        self.pending_positions += len(hidden)

    def pending(self, chain: Sequence[CachedPage]) -> list[tuple[int, CachedPage]]:
        """``(page index, entry)`` of the entries of ``chain`` (a match, in order) whose MTP rows are
        not written yet."""
        return [(i, e) for i, e in enumerate(chain) if e.mtp_pending is not None]

    def clear_pending(self, entries: Iterable[CachedPage]) -> None:
        """Their MTP rows are written now."""
        for entry in entries:
            if entry.mtp_pending is not None:
                self.pending_positions -= len(entry.mtp_pending[1])
                entry.mtp_pending = None

    # --- eviction -------------------------------------------------------------------------------

    def evictable(self) -> int:
        """Entries that eviction can free (nobody references them or anything they continue... to
        the leaves: an unreferenced entry's descendants are unreferenced too)."""
        return len(self.entries) - self._referenced

    def evictable_pages(self, pool: int, keep: Sequence[CachedPage] = ()) -> list[int]:
        """The pages in pool ``pool`` of the entries eviction can free, ``keep`` aside."""
        kept = {id(e) for e in keep}
        return [e.pages[pool] for e in self.entries.values() if e.refs == 0 and id(e) not in kept]

    def evict(self, count: int) -> int:
        """Free up to ``count`` unreferenced entries (least recently used leaves first); returns how
        many were freed."""
        freed = 0
        while freed < count:
            leaves = [e for e in self.entries.values() if e.refs == 0 and e.children == 0]
            if not leaves:
                break
            victims = sorted(leaves, key=lambda e: (e.last_used, e.id))[: count - freed]
            for entry in victims:
                self._drop(entry)
                freed += 1
                self.counters.evicted_pages += 1
        return freed

    def make_room(self, needs: Sequence[int]) -> bool:
        """Evict until every pool has ``needs[i]`` free pages, if the unreferenced entries allow;
        evicts nothing and returns False when they do not."""
        short = max(
            (need - pool.num_free_pages for pool, need in zip(self.pools, needs)), default=0
        )  # each entry frees one page in every pool
        if short <= 0:
            return True
        if short > self.evictable():
            return False
        return self.evict(short) == short

    def flush(self) -> int:
        """Evict every unreferenced entry; returns how many."""
        return self.evict(len(self.entries))

    def _drop(self, entry: CachedPage) -> None:
        """Evict ``entry`` whole: if freeing its page fails in one pool, the pages freed in the
        others are taken back and the entry stays."""
        freed: list[tuple[PagedAllocator, int]] = []
        try:
            for pool, page in zip(self.pools, entry.pages):
                pool.free([page], self.owner)
                freed.append((pool, page))
        except BaseException:
            for pool, page in freed:
                pool.take([page], self.owner)
            raise
        del self.entries[entry.key]
        self.clear_pending([entry])  # rows nobody will read
        if entry.parent is not None:
            entry.parent.children -= 1

    # --- figures and checks ---------------------------------------------------------------------

    def held_pages(self) -> int:
        return len(self.entries)

    def stats(self) -> dict[str, float]:
        return {
            **self.counters.as_dict(),
            "pages_held": len(self.entries),
            "pages_referenced": self.referenced(),
        }

    def referenced(self) -> int:
        return self._referenced

    def check_integrity(self, chains: Iterable[list[CachedPage]]) -> None:
        """``chains``: what each live request shares. Reference counts equal the requests sharing
        each entry; every entry's pages are the cache's; children counts and parent links agree."""
        shares: dict[int, int] = {}
        for chain in chains:
            for entry in chain:
                shares[entry.id] = shares.get(entry.id, 0) + 1
        children: dict[int, int] = {}
        for entry in self.entries.values():
            assert entry.refs == shares.get(entry.id, 0), (
                f"prefix cache: entry {entry.id} has {entry.refs} references, "
                f"{shares.get(entry.id, 0)} requests share it"
            )
            for pool, page in zip(self.pools, entry.pages):
                assert pool.owner_of(page) == self.owner, (
                    f"prefix cache: {pool.name} page {page} is not the cache's"
                )
            if entry.parent is not None:
                assert self.entries.get(entry.parent.key) is entry.parent, (
                    f"entry {entry.id}: parent evicted first"
                )
                children[entry.parent.id] = children.get(entry.parent.id, 0) + 1
        referenced = sum(1 for e in self.entries.values() if e.refs)
        assert self._referenced == referenced, (
            f"prefix cache: {self._referenced} entries counted shared, {referenced} are"
        )
        for entry in self.entries.values():
            assert entry.children == children.get(entry.id, 0), (
                f"prefix cache: entry {entry.id} children count"
            )
        for pool in self.pools:
            assert len(pool.pages_of(self.owner)) == len(self.entries), (
                f"prefix cache: {pool.name} pages held"
            )
        pending = sum(len(e.mtp_pending[1]) for e in self.entries.values() if e.mtp_pending is not None)
        assert pending == self.pending_positions, "prefix cache: pending MTP positions miscounted"
