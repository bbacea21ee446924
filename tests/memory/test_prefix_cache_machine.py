"""The prefix cache alone, against a naive oracle (a dict of cached prefixes).

Random token sequences sharing prefixes are inserted (as finished requests' pages), matched, locked
(a request shares its match) and unlocked (it ends), while eviction makes room. After every step:
conservation (free + owned + cache-held = capacity in every pool), reference counts equal the live
sharers, and a match is exactly the longest chain of page prefixes the oracle still holds.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import event
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from shadow_model import machine_settings

from pipeline.memory.paged import PagedAllocator
from pipeline.memory.prefix_cache import PrefixCache

PAGE = 4
ROWS = 4  # request rows 0..3; the cache owns pages as owner 4
POOL_PAGES = 24
# sequences share prefixes: drawn from a small alphabet, built by extending earlier ones
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=22)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pools = (PagedAllocator("a", POOL_PAGES, PAGE), PagedAllocator("b", POOL_PAGES, PAGE))
        self.cache = PrefixCache(PAGE, self.pools, owner=ROWS)
        self.live: dict[int, tuple] = {}  # row -> (tokens, shared chain, own pages per pool)
        self.history: list[tuple[int, ...]] = []  # every sequence so far (new ones extend them)
        # oracle: each cached page-end prefix (its tokens and the next one) -> the entry holding it
        self.known: dict[tuple[int, ...], int] = {}

    def _oracle_match(self, seq: tuple[int, ...]) -> int:
        pages = 0
        while (pages + 1) * PAGE <= len(seq) - 1 and seq[: (pages + 1) * PAGE + 1] in self.known:
            pages += 1
        return pages

    @precondition(lambda self: len(self.live) < ROWS)
    @rule(seq=tokens, base=st.integers(0, 3))
    def admit(self, seq, base) -> None:
        """A request arrives: it shares its match, and owns pages for the rest of its tokens."""
        earlier = self.history
        seq = tuple((earlier[base % len(earlier)][: 3 * len(seq)] if earlier else ()) + tuple(seq))
        self.history.append(seq)
        chain = self.cache.match(seq)
        assert len(chain) == self._oracle_match(seq), "match is not the longest cached chain"
        event("a match shared pages" if chain else "no match")
        need = -(-len(seq) // PAGE) - len(chain)
        self.cache.lock(chain)
        referenced = {e.id for e in self.cache.entries.values() if e.refs}
        if not self.cache.make_room((need, need)):
            # refused only when the unshared pages (its own match is shared now) cannot make room
            assert need > min(p.num_free_pages for p in self.pools) + self.cache.evictable()
            self.cache.unlock(chain)
            return
        assert referenced <= {e.id for e in self.cache.entries.values()}, "evicted a shared page"
        row = next(r for r in range(ROWS) if r not in self.live)
        own = list(zip(self.pools[0].allocate(need, row), self.pools[1].allocate(need, row)))
        self.live[row] = (seq, chain, own)
        self._forget_evicted()

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), keep=st.booleans())
    def finish(self, data, keep) -> None:
        """A request ends: its full pages (with their next token) go to the cache, or are freed."""
        row = data.draw(st.sampled_from(sorted(self.live)))
        seq, chain, own = self.live.pop(row)
        handed = 0
        if keep:
            full = (len(seq) - 1) // PAGE
            handed = self.cache.insert(seq, chain, own[: max(0, full - len(chain))], row)
            by_window = {e.key: e.id for e in self.cache.entries.values()}
            parent = chain[-1].id if chain else -1
            for i in range(len(chain), len(chain) + handed):
                parent = by_window[(parent, seq[i * PAGE : (i + 1) * PAGE + 1])]
                self.known[seq[: (i + 1) * PAGE + 1]] = parent
        self.cache.unlock(chain)
        for pool, pages in zip(self.pools, zip(*own[handed:]) if own[handed:] else ((), ())):
            pool.free(list(pages), row)

    @rule(count=st.integers(1, 6))
    def evict(self, count) -> None:
        referenced = {e.id for e in self.cache.entries.values() if e.refs}
        before = len(self.cache.entries)
        freed = self.cache.evict(count)
        assert freed == before - len(self.cache.entries) and freed <= count
        assert referenced <= {e.id for e in self.cache.entries.values()}, "evicted a shared page"
        self._forget_evicted()

    @rule(extra=st.integers(-2, 3))
    def make_room(self, extra) -> None:
        """Room for ``extra`` pages more than are free (fewer when negative): granted iff the
        unreferenced entries cover the shortfall, and then every pool has them free; evicts only
        what it must, and nothing when it refuses."""
        free = min(p.num_free_pages for p in self.pools)
        need = max(0, free + extra)
        before = len(self.cache.entries)
        granted = self.cache.make_room((need, need))
        assert granted == (need - free <= self.cache.evictable() + (before - len(self.cache.entries)))
        evicted = before - len(self.cache.entries)
        if granted:
            assert all(p.num_free_pages >= need for p in self.pools), "make_room granted too little"
            assert evicted == max(0, need - free), f"evicted {evicted} for a shortfall of {need - free}"
        else:
            assert evicted == 0, "a refused make_room evicted entries"
        self._forget_evicted()

    def _forget_evicted(self) -> None:
        alive = {e.id for e in self.cache.entries.values()}
        self.known = {prefix: eid for prefix, eid in self.known.items() if eid in alive}

    @invariant()
    def conservation(self) -> None:
        self.cache.check_integrity(chain for _, chain, _ in self.live.values())
        # the counts a step's figures read are kept as references come and go: they equal a recount
        unshared = sum(1 for e in self.cache.entries.values() if e.refs == 0)
        assert self.cache.evictable() == unshared, "evictable entries miscounted"
        assert self.cache.stats()["pages_referenced"] == len(self.cache.entries) - unshared
        for pool in self.pools:
            pool.check_integrity()
            owned = sum(len(pool.pages_of(r)) for r in range(ROWS))
            assert pool.num_free_pages + owned + self.cache.held_pages() == pool.capacity_pages

    def teardown(self) -> None:
        for row in list(self.live):
            _seq, chain, own = self.live.pop(row)
            self.cache.unlock(chain)
            for pool, pages in zip(self.pools, zip(*own) if own else ((), ())):
                pool.free(list(pages), row)
        self.cache.flush()
        assert self.cache.held_pages() == 0
        assert all(p.num_free_pages == p.capacity_pages for p in self.pools), "flush left pages held"


TestCacheMachine = pytest.mark.proptest(CacheMachine.TestCase)
TestCacheMachine.settings = machine_settings(examples=60, steps=40)


def test_a_match_needs_the_token_after_the_page_and_leaves_the_last_token():
    pools = (PagedAllocator("a", 8, PAGE),)
    cache = PrefixCache(PAGE, pools, owner=ROWS)
    seq = (1, 2, 3, 4, 5, 6, 7, 8, 9)
    pages = pools[0].allocate(2, 0)
    assert cache.insert(seq, [], [(pages[0],), (pages[1],)], 0) == 2
    assert len(cache.match(seq)) == 2  # 8 of 9 tokens: the last is computed
    assert len(cache.match(seq[:8])) == 1  # the second page needs its next token, and one to compute
    assert len(cache.match((1, 2, 3, 4, 0, 6, 7, 8, 9))) == 0  # the first page's next token differs
    assert len(cache.match((1, 2, 3, 4, 5, 6, 7, 0, 9))) == 1
