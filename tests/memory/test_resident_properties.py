"""Properties of the all-resident memory (``ResidentMemory``) and of the resumable release, driven
directly (no model: a forward's KV is not needed to say who owns which page).

* a decoding request released with its tokens leaves its full pages to the prefix cache, and the
  same prompt admitted again shares them; without a prefix cache nothing is cached, and every page
  is free again;
* the free counts name each pool, and agree with the pool figures the stats report;
* at the longest request, decode room still counts the cached pages nobody shares as free;
* a release whose step fails is logged with its traceback, resumed at once, and a second failure is
  deferred to the next ``reclaim`` (logged too); either way the pools come back whole;
* a full row pool refuses an allocation with what was asked for and what was free;
* the host pool's tensors have the shape and dtype asked for (zeroed, for ``host_zeros``).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import structlog
import torch
from hypothesis import given, settings

from pipeline.capacity import MemoryPlan
from pipeline.memory import OutOfMemory, RequestRows
from pipeline.memory.host_pool import host_empty, host_zeros
from pipeline.memory.paged import PagedTable
from pipeline.memory.resident import ResidentMemory

PAGE = 4
MAX_LEN = 24
LONGEST = 4 * PAGE + 1  # a request's last position alone on its page


def memory(
    *, prefix_cache: bool, device_tokens: int = 64, rows: int = 3, max_len: int = MAX_LEN
) -> ResidentMemory:
    plan = MemoryPlan(
        page_size=PAGE,
        hot=0,
        buffer_columns=0,
        top_k=4,
        device_tokens=device_tokens,
        logical_tokens=device_tokens,
        host_tokens=0,
        max_context_len=max_len,
        max_running_requests=rows,
        draft_tokens=0,
        hisparse=False,
        prefill_chunk=max_len,
        prefix_cache=prefix_cache,
    )
    return ResidentMemory(plan=plan, num_layers=1, num_mtp_layers=0, row_dim=2, index_dim=2)


def decoding(mem: ResidentMemory, tokens: list[int], prompt: int) -> int:
    """A request of ``prompt`` tokens of ``tokens``, prefilled and staged, then decoding its other
    tokens one step at a time; returns its row."""
    row = mem.admit(prompt, tokens=tokens[:prompt])
    start = mem.length(row)
    mem.prefill_targets(row, start, prompt)
    mem.commit_prefill(row, start, prompt, final=True)
    mem.start_staging(row, prompt)
    assert mem.collect_ready() == [row]
    for _ in range(prompt, len(tokens) - 1):  # the last token's KV is never computed
        targets = mem.prepare_decode([row])
        mem.commit_decode([row], targets.slots)
    return row


def check_counts(mem: ResidentMemory) -> None:
    counts, pools = mem.free_counts(), mem.pools()
    assert set(counts) == {"rows", "kv_pages"}, counts
    assert counts["rows"] == pools["request_rows"]["free"]
    assert counts["kv_pages"] * PAGE == pools["device"]["free"], (counts, pools)


requests = st.integers(2, MAX_LEN).flatmap(
    lambda n: st.tuples(st.lists(st.integers(0, 9), min_size=n, max_size=n), st.integers(1, n - 1))
)


@pytest.mark.proptest
@settings(max_examples=30, deadline=None)
@given(request=requests, prefix_cache=st.booleans())
def test_a_released_request_leaves_its_full_pages_to_the_cache(request, prefix_cache):
    tokens, prompt = request
    mem = memory(prefix_cache=prefix_cache)
    initial = mem.free_counts()
    row = decoding(mem, tokens, prompt)
    check_counts(mem)
    mem.release(row, tokens=tokens)
    check_counts(mem)
    assert mem.free_counts() == initial, "a released request's pages are free (cached ones too)"
    full = (len(tokens) - 1) // PAGE  # KV committed for all but the last token, each page's next known
    cached = mem.pools()["device"]["cached"]
    if not prefix_cache:
        assert mem.cache_stats() is None and cached == 0, "no prefix cache, nothing cached"
        return
    assert cached == full * PAGE, f"{cached} tokens cached, the request had {full} full pages"
    again = mem.admit(len(tokens), tokens=tokens)
    assert mem.length(again) == full * PAGE, "the cached prefix is shared"
    mem.release(again)
    mem.check_integrity()
    assert mem.free_counts() == initial


@pytest.mark.proptest
@settings(max_examples=20, deadline=None)
@given(tokens=st.lists(st.integers(0, 9), min_size=LONGEST, max_size=LONGEST))
def test_room_at_the_longest_request_counts_unshared_cached_pages(tokens):
    """A request one position short of the longest, its last position on a page of its own, finds
    room for it in a cached page nobody shares when no page is free."""
    pages = -(-LONGEST // PAGE)
    mem = memory(prefix_cache=True, device_tokens=pages * PAGE, max_len=LONGEST)
    other = [t + 10 for t in tokens[: PAGE + 1]]
    cached = decoding(mem, other, PAGE)
    mem.release(cached, tokens=other)  # one page now cached, nobody shares it
    assert mem.pools()["device"]["cached"] == PAGE
    row = mem.admit(LONGEST - 1, tokens=tokens[: LONGEST - 1])
    mem.prefill_targets(row, 0, LONGEST - 1)
    mem.commit_prefill(row, 0, LONGEST - 1, final=True)
    assert mem.length(row) == LONGEST - 1
    assert mem.allocator.num_free_pages == 0, "the pool is the admitted pages and the cached one"
    assert mem.can_decode(row), "the cached page gives way for the last position"
    mem.ensure_capacity(row, new_tokens=1, speculative=False)
    mem.release(row)
    assert mem.free_counts()["kv_pages"] == pages


@pytest.mark.proptest
@settings(max_examples=10, deadline=None)
@given(failures=st.integers(1, 2), prompt=st.integers(1, MAX_LEN))
def test_a_failed_release_is_logged_and_resumed(failures, prompt):
    mem = memory(prefix_cache=False)
    initial = mem.free_counts()
    row = mem.admit(prompt)
    original, left = PagedTable.release, [failures]

    def release(self, *args, **kwargs):
        if left[0]:
            left[0] -= 1
            raise RuntimeError("a release step failed")
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m, structlog.testing.capture_logs() as logs:
        m.setattr(PagedTable, "release", release)
        mem.release(row)
        events = [(e["event"], e["row"], e.get("exc_info")) for e in logs]
        want = [("memory.release_failed", row, True)]
        if failures == 2:  # the immediate retry failed too: the next reclaim finishes it
            want.append(("memory.release_deferred", row, True))
        assert events == want, events
        assert row not in mem.live_rows()
        assert mem.reclaim() == 0
    assert mem.free_counts() == initial
    mem.check_integrity()


@pytest.mark.proptest
@settings(max_examples=10, deadline=None)
@given(num_rows=st.integers(1, 6))
def test_a_full_row_pool_says_what_was_asked_and_free(num_rows):
    rows = RequestRows(num_rows)
    taken = [rows.allocate() for _ in range(num_rows)]
    assert sorted(taken) == list(range(num_rows))
    with pytest.raises(OutOfMemory) as info:
        rows.allocate()
    assert (info.value.pool, info.value.requested, info.value.free) == ("request rows", 1, 0)
    assert rows.num_free == 0 and rows.in_use() == frozenset(taken)


@pytest.mark.proptest
@settings(max_examples=10, deadline=None)
@given(
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=3).map(tuple),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.uint8, torch.int64]),
)
def test_host_tensors_have_the_shape_and_dtype_asked_for(shape, dtype):
    for make in (host_empty, host_zeros):
        t = make(shape, dtype, pinned=False)
        assert (tuple(t.shape), t.dtype, t.device.type) == (shape, dtype, "cpu"), make.__name__
    assert not bool(host_zeros(shape, dtype, pinned=False).any())
