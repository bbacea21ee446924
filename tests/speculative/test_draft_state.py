"""Stash and merge: draft states sliced off a batch and merged back in arbitrary groups are unchanged."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from pipeline.speculative.draft_state import DraftBatch, DraftState


def state(i: int, k: int, sampled: bool) -> DraftState:
    gen = torch.Generator().manual_seed(i)
    probs = tuple(torch.softmax(torch.randn(7, generator=gen), 0) for _ in range(k)) if sampled else None
    return DraftState(i * 3, torch.randn(5, generator=gen), tuple(range(i, i + k)), probs)


@given(st.integers(1, 9), st.integers(1, 4), st.randoms(use_true_random=False))
def test_merge_then_slice_in_arbitrary_groups_is_the_identity(n, k, rnd):
    states = [state(i, k, sampled=i % 2 == 0) for i in range(n)]
    order = list(range(n))
    rnd.shuffle(order)
    cut = rnd.randint(0, n)
    for group in (order[:cut], order[cut:]):
        if not group:
            continue
        batch = DraftBatch.merge([states[i] for i in group])
        assert len(batch) == len(group)
        for row, i in enumerate(group):
            back = batch.slice(row)
            assert back.bonus == states[i].bonus and back.drafts == states[i].drafts
            assert torch.equal(back.hidden, states[i].hidden)
            assert back.draft_probs is states[i].draft_probs


def test_merge_refuses_states_in_different_phases():
    with pytest.raises(ValueError, match="drafts"):
        DraftBatch.merge([state(0, 1, False), state(1, 3, False)])
