"""The prefill swap-in's grouping of a chunk's queries: the compiled loop equals the Python one."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.hisparse.prefill_swap import group_bounds, group_bounds_reference


def _past(seed: int, queries: int, k: int, context: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of distinct positions below ``context`` (a top-k's), -1 padded at random."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.full((queries, k), -1, dtype=dtype)
    for i in range(queries):
        n = int(torch.randint(0, min(k, context) + 1, (1,), generator=g))
        rows[i, :n] = torch.randperm(context, generator=g)[:n].to(dtype)
    return rows


@pytest.mark.proptest
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    queries=st.integers(1, 40),
    k=st.integers(1, 12),
    context=st.integers(1, 50),
    hot=st.integers(1, 30),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_compiled_grouping_equals_the_python_loop(seed, queries, k, context, hot, dtype):
    past = _past(seed, queries, k, context, dtype)
    got = group_bounds(past, hot, context)
    assert got == group_bounds_reference(past, hot, context)
    assert got[0][0] == 0 and got[-1][1] == queries  # consecutive ranges covering every query
    assert all(a < b == c for (a, b), (c, _) in itertools.pairwise(got))


def test_compiled_grouping_refuses_a_position_past_the_context():
    with pytest.raises(IndexError, match="past position"):
        group_bounds(torch.tensor([[0, 5]], dtype=torch.int32), 4, 5)
