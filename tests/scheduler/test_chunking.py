"""The chunked-prefill plan (``pipeline.chunking.plan_chunks``) against its rule, over random queues."""

from hypothesis import given
from hypothesis import strategies as st

from pipeline.chunking import plan_chunks

queues = st.lists(st.tuples(st.integers(0, 60), st.integers(1, 60)), min_size=1, max_size=8).map(
    lambda rows: [(f"r{i}", min(done, total), total) for i, (done, total) in enumerate(rows)]
)


@given(queue=queues, budget=st.none() | st.integers(1, 100), chunk=st.none() | st.integers(1, 40))
def test_a_plan_takes_the_queue_in_order_within_the_chunk_and_the_budget(queue, budget, chunk):
    plan = plan_chunks(queue, budget, chunk)
    pending = [(rid, done, total) for rid, done, total in queue if done < total]
    if not pending:
        assert plan == ()
        return
    # the head request always makes progress; the requests are a prefix of the pending ones, in order
    assert plan and [c.request_id for c in plan] == [rid for rid, _, _ in pending[: len(plan)]]
    sizes = []
    for c, (_, done, total) in zip(plan, pending):
        assert c.start == done and done < c.end <= total
        size = c.end - c.start
        sizes.append(size)
        if chunk is not None:
            assert size <= chunk
        elif c is not plan[0]:
            assert c.end == total, "without a chunk, only the head may be split (by a budget below it)"
    if budget is not None:
        assert sum(sizes) <= budget
    # nothing was left out that the rule would have taken
    want = [(total - done) if chunk is None else min(total - done, chunk) for _, done, total in pending]
    if budget is None:
        assert sizes == want
    else:
        # every request but the last got all it wanted; the one after the last did not fit
        assert sizes[:-1] == want[: len(sizes) - 1]
        assert sizes[-1] == want[len(sizes) - 1] or sum(sizes) == budget, "cut only where the budget ends"
        if len(plan) < len(pending):
            left = budget - sum(sizes)
            assert left == 0 or (chunk is None and want[len(plan)] > left)
