"""Admission and release are all or nothing.

Every allocation and free call that admitting or releasing a request can reach (the request rows,
the paged allocators, the page tables, the host pool, the device buffers, the prefix cache) is made
to raise in turn: the first call of an admission, then the second, ... until an admission makes no
k-th call; the same for a release. After each fault:

* admission: the request being admitted holds nothing and fails at its first prefill; the other
  candidates are admitted as without the fault; ``check_integrity`` passes;
* release: the request is gone from the executor and from the memory all the same (the release
  goes on from where the fault stopped it), every pool is back at what a fault-free release leaves,
  and ``check_integrity`` passes;

and once every request has ended and the prefix cache is flushed, every pool is back at its initial
count. Run with HiSparse on and off, speculation on and off, with a prefix cache whose pages the
admission shares and evicts and to which the release leaves its pages.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import structlog

from pipeline.executor import Executor
from pipeline.hisparse.buffers import DeviceBuffers
from pipeline.logs import configure_logging
from pipeline.memory import HiSparseAllocator, HostPool, PagedAllocator, PagedTable, RequestRows
from pipeline.memory.prefix_cache import PrefixCache
from pipeline.messages import Admit, CollectReady, Decode, NewSequence, Prefill, PrefillChunk, Release
from pipeline.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from _reliability_util import small_config

GREEDY = SamplingParams(max_new_tokens=10_000, ignore_eos=True)


@pytest.fixture(autouse=True)
def quiet_logs():
    """Every injected fault is logged with its traceback: kept out of the output (and its time)."""
    sink = configure_logging(level="critical", stream=io.StringIO())
    yield
    sink.close()
    structlog.reset_defaults()

# every call that takes or gives back memory on the way of an admission or a release
CALLS = (
    (RequestRows, ("allocate", "free")),
    (PagedAllocator, ("allocate", "free", "transfer")),
    (PagedTable, ("share", "cover", "release")),
    (HostPool, ("reserve", "release")),
    (HiSparseAllocator, ("extend", "alloc_physical", "free_physical", "release_locations")),
    (DeviceBuffers, ("assign", "grow", "reset")),
    (PrefixCache, ("share", "lock", "unlock", "make_room", "evict", "insert", "set_pending")),
)


class Injected(RuntimeError):
    pass


class CallFaults:
    """While armed, counts the calls of ``CALLS`` (nested ones too) and makes the k-th raise before
    it runs."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.armed = False
        self.calls: list[str] = []

    @contextmanager
    def installed(self) -> Iterator[CallFaults]:
        with ExitStack() as stack:
            for owner, names in CALLS:
                for name in names:
                    real = owner.__dict__[name]
                    setattr(owner, name, self._wrap(f"{owner.__name__}.{name}", real))
                    stack.callback(setattr, owner, name, real)
            yield self

    @contextmanager
    def arm(self) -> Iterator[None]:
        self.armed = True
        try:
            yield
        finally:
            self.armed = False

    @property
    def fired(self) -> str | None:
        return self.calls[self.k - 1] if len(self.calls) >= self.k else None

    def _wrap(self, name: str, real):
        def call(*args, **kwargs):
            if self.armed:
                self.calls.append(name)
                if len(self.calls) == self.k:
                    raise Injected(f"injected fault at {name}")
            return real(*args, **kwargs)

        return call


CONFIGS = {
    "hisparse": dict(hisparse=True, num_steps=None),
    "hisparse-spec": dict(hisparse=True, num_steps=2),
    "resident": dict(hisparse=False, num_steps=None),
    "resident-spec": dict(hisparse=False, num_steps=2),
}
PREFIX = tuple((7 * i + 3) % 250 for i in range(24))  # three pages the warm-up leaves to the cache


def prompt(seed: int, n: int, *, shared: bool = False) -> tuple[int, ...]:
    tail = tuple((seed * 31 + 11 * i) % 250 for i in range(n))
    return PREFIX + tail if shared else tail


def prefill_all(ex: Executor, rids: list[str]) -> dict[str, str]:
    """Prefill the admitted ``rids`` to their first token (chunks of the config's size); returns
    the failed ones."""
    failed: dict[str, str] = {}
    while True:
        chunks = []
        for rid in rids:
            seq = ex.seqs.get(rid)
            if rid in failed or (seq is None and rid not in ex.failed_admissions):
                continue
            if seq is None:  # its admission failed: its first prefill reports it
                chunks.append(PrefillChunk(rid, 0, 1))
            elif seq.prefilled < len(seq.token_ids):
                chunks.append(PrefillChunk(rid, seq.prefilled, min(len(seq.token_ids), seq.prefilled + 16)))
        if not chunks:
            return failed
        outcome = ex.run(Prefill(tuple(chunks)))
        assert outcome.error is None, outcome.error
        failed.update(outcome.result.failed)


def to_decode(ex: Executor, rids: list[str], steps: int) -> None:
    assert not prefill_all(ex, rids)
    ready = ex.run(CollectReady(tuple(rids)))
    assert list(ready.result.ready) == rids
    for _ in range(steps):
        assert not ex.run(Decode(tuple(rids))).result.failed


def warm(ex: Executor) -> None:
    """Leave pages in the prefix cache: requests sharing ``PREFIX`` decoded and released."""
    seqs = [NewSequence(f"warm{i}", prompt(i, 5 + i, shared=True), GREEDY) for i in range(2)]
    assert len(ex.run(Admit(tuple(seqs))).result.admitted) == 2
    to_decode(ex, ["warm0", "warm1"], 9)
    assert ex.run(Release(("warm0", "warm1"))).error is None
    assert ex.memory.cache.held_pages() > 0


def start(ex: Executor) -> None:
    """A cached prefix, and a request decoding."""
    warm(ex)
    assert ex.run(Admit((NewSequence("live", prompt(5, 20), GREEDY),))).result.admitted == ("live",)
    to_decode(ex, ["live"], 3)


def finish(ex: Executor, initial: dict[str, int]) -> None:
    """End every request; every pool is back at its initial count."""
    ex.run(Release(tuple(ex.seqs) + tuple(ex.failed_admissions)))
    ex.flush_prefix_cache()
    ex.check_integrity()
    assert ex.pool_counts() == initial


def each_fault(run_one) -> int:
    """``run_one(faults)`` for k = 1, 2, ... until a run makes fewer than k calls; returns how many
    faults were injected."""
    k = 1
    while True:
        faults = CallFaults(k)
        with faults.installed():
            run_one(faults)
        if faults.fired is None:
            return k - 1
        k += 1


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_fault_anywhere_in_an_admission_leaves_nothing(tiny_model, name):
    ex = Executor(small_config(**CONFIGS[name]), model=tiny_model)
    initial = ex.pool_counts()
    candidates = (
        NewSequence("a", prompt(1, 6, shared=True), GREEDY),  # shares the cached prefix
        NewSequence("b", prompt(2, 30), GREEDY),  # past HOT: a chunk's rows too
    )
    seen: set[str] = set()

    def run_one(faults: CallFaults) -> None:
        start(ex)
        with faults.arm():
            outcome = ex.run(Admit(candidates))
        assert outcome.error is None, outcome.error
        ex.check_integrity()
        assert outcome.result.admitted == ("a", "b")
        culprit = None if faults.fired is None else ("a" if "a" in ex.failed_admissions else "b")
        if faults.fired is not None:
            seen.add(faults.fired)
            assert set(ex.failed_admissions) == {culprit}, faults.fired
            assert culprit not in ex.seqs
        failed = prefill_all(ex, ["a", "b"])
        assert set(failed) == ({culprit} if culprit else set()), (faults.fired, failed)
        if culprit is not None:
            assert "injected fault" in failed[culprit]
        ex.check_integrity()
        finish(ex, initial)

    assert each_fault(run_one) >= 5
    assert {"RequestRows.allocate", "PagedAllocator.allocate", "PagedTable.cover"} <= seen
    if ex.config.hisparse is not None:
        assert {"HostPool.reserve", "HiSparseAllocator.alloc_physical", "DeviceBuffers.assign"} <= seen
    ex.close()


def test_a_fault_while_admission_evicts_cached_pages_leaves_nothing(tiny_model):
    """Pools so small that admitting takes pages the prefix cache holds: a fault in the middle of
    the eviction leaves every cached entry whole or gone, never half freed."""
    ex = Executor(small_config(num_steps=None, device_pool_tokens=320, max_context_len=160), model=tiny_model)
    initial = ex.pool_counts()
    big = NewSequence("big", prompt(9, 150), GREEDY)
    seen: set[str] = set()

    def fill_cache() -> None:
        for i in range(6):
            rid = f"fill{i}"
            assert ex.run(Admit((NewSequence(rid, prompt(20 + i, 100), GREEDY),))).result.admitted == (rid,)
            to_decode(ex, [rid], 1)
            ex.run(Release((rid,)))

    def run_one(faults: CallFaults) -> None:
        fill_cache()
        evicted = ex.memory.cache.counters.evicted_pages
        with faults.arm():
            outcome = ex.run(Admit((big,)))
        assert outcome.error is None and outcome.result.admitted == ("big",)
        if faults.fired is None:
            assert ex.memory.cache.counters.evicted_pages > evicted, "the admission should evict"
        else:
            seen.add(faults.fired)
            assert "big" in ex.failed_admissions
        ex.check_integrity()
        finish(ex, initial)

    assert each_fault(run_one) >= 5
    assert {"PrefixCache.make_room", "PrefixCache.evict", "PagedAllocator.free"} <= seen
    ex.close()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_fault_anywhere_in_a_release_still_returns_everything(tiny_model, name):
    """Requests in every phase released together (decoding, staging, halfway through a chunked
    prefill), with their pages going to the prefix cache."""
    ex = Executor(small_config(**CONFIGS[name]), model=tiny_model)
    initial = ex.pool_counts()
    leaving = ("d", "s", "p")
    seen: set[str] = set()

    def run_one(faults: CallFaults) -> dict[str, int]:
        start(ex)
        seqs = (NewSequence("d", prompt(1, 6, shared=True), GREEDY), NewSequence("s", prompt(3, 12), GREEDY),
                NewSequence("p", prompt(4, 40), GREEDY))
        assert ex.run(Admit(seqs)).result.admitted == ("d", "s", "p")
        to_decode(ex, ["d"], 12)
        assert not ex.run(Prefill((PrefillChunk("s", 0, 12), PrefillChunk("p", 0, 16)))).result.failed
        with faults.arm():
            outcome = ex.run(Release(leaving))
        assert outcome.error is None
        if faults.fired is not None:
            seen.add(faults.fired)
        assert not set(leaving) & set(ex.seqs)
        ex.check_integrity()
        after = ex.pool_counts()
        finish(ex, initial)
        return after

    clean: list[dict[str, int]] = []
    faulty: list[tuple[str, dict[str, int]]] = []

    def checked(faults: CallFaults) -> None:
        after = run_one(faults)
        if faults.fired is None:
            clean.append(after)
        else:
            faulty.append((faults.fired, after))

    assert each_fault(checked) >= 5
    for where, after in faulty:  # what each faulty release left equals what a clean one leaves
        assert after == clean[0], f"a fault at {where} kept memory: {after} vs {clean[0]}"
    assert {"RequestRows.free", "PagedAllocator.free", "PagedTable.release"} <= seen
    if ex.config.hisparse is not None:
        assert {"HostPool.release", "HiSparseAllocator.free_physical", "DeviceBuffers.reset"} <= seen
    ex.close()


@pytest.mark.parametrize("hisparse", [True, False])
def test_a_release_that_keeps_failing_is_finished_by_the_next_command(tiny_model, monkeypatch, hisparse):
    """Every free raises while a request is released (its retry too): the request is gone all the
    same, its row no longer live and the memory consistent; it holds its pages until the next
    command, which finishes the release."""
    ex = Executor(small_config(hisparse=hisparse, num_steps=None), model=tiny_model)
    initial = ex.pool_counts()
    assert ex.run(Admit((NewSequence("r", prompt(1, 20), GREEDY),))).result.admitted == ("r",)
    to_decode(ex, ["r"], 3)
    real = PagedAllocator.free
    broken = [True]

    def free(self, pages, owner):
        if broken[0]:
            raise Injected("injected fault at PagedAllocator.free")
        return real(self, pages, owner)

    monkeypatch.setattr(PagedAllocator, "free", free)
    assert ex.run(Release(("r",))).error is None
    assert "r" not in ex.seqs and ex.memory.live_rows() == []
    ex.check_integrity()
    assert ex.pool_counts() != initial  # held back, not lost
    broken[0] = False
    assert ex.run(Release(("nobody",))).error is None
    ex.flush_prefix_cache()
    ex.check_integrity()
    assert ex.pool_counts() == initial
    ex.close()
