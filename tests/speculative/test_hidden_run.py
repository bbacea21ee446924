"""``HiddenRun``: a request's hidden states awaiting their MTP rows, kept in the blocks they came in,
against a list of one row per position."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from pipeline.speculative.hidden_run import HiddenRun

D = 3


@given(
    start=st.integers(0, 50),
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=6),  # 0: one decode row [D]
    cut=st.integers(0, 80),
    data=st.data(),
)
def test_a_run_gives_the_rows_and_ids_of_one_row_per_position(start, sizes, cut, data):
    run, naive, position = HiddenRun(), [], start
    for n in sizes:
        rows = torch.randn(max(n, 1), D)
        block = rows[0] if n == 0 else rows  # a decode step's row is 1-D
        ids = [1000 + position + i for i in range(len(rows))]
        run.add(position, block, ids)
        naive += [(position + i, rows[i], ids[i]) for i in range(len(rows))]
        position += len(rows)
    assert len(run) == len(naive) and run.first == start and run.last == position - 1
    first, hidden, ids = run.whole()
    assert first == start and ids == tuple(t for *_, t in naive)
    assert torch.equal(hidden, torch.stack([h for _, h, _ in naive]))
    lo = data.draw(st.integers(start, position - 1))
    hi = data.draw(st.integers(lo + 1, position))
    assert torch.equal(run.rows(lo, hi), torch.stack([h for p, h, _ in naive if lo <= p < hi]))
    run.truncate(cut)
    kept = [e for e in naive if e[0] < cut]
    assert len(run) == len(kept) and bool(run) == bool(kept)
    if kept:
        assert run.last == kept[-1][0] and run.whole()[2] == tuple(t for *_, t in kept)
        assert torch.equal(run.whole()[1], torch.stack([h for _, h, _ in kept]))


def test_a_block_must_continue_the_run():
    run = HiddenRun()
    run.add(4, torch.zeros(2, D), (1, 2))
    try:
        run.add(7, torch.zeros(D), (3,))
    except AssertionError:
        return
    raise AssertionError("a gap in the positions must be refused")
