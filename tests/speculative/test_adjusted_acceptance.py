"""Property of greedy acceptance with adjusted logits (penalties, a bias): each verify row is
adjusted for the context extended by the drafts before it, and the accepted drafts are the longest
prefix whose adjusted argmax matches, with the bonus token the adjusted argmax after them."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from pipeline.sampling import LogitContext, SamplingParams, adjust_logits
from pipeline.speculative.acceptance import accept

VOCAB = 6


@pytest.mark.proptest
@settings(max_examples=40, deadline=None)
@given(
    drafts=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3),
    rows=st.lists(st.lists(st.integers(-3, 3), min_size=VOCAB, max_size=VOCAB), min_size=4, max_size=4),
    penalty=st.sampled_from([1.0, 1.5]),
    bias=st.lists(st.tuples(st.integers(0, VOCAB - 1), st.sampled_from([-2.0, 2.5])), max_size=2),
    output=st.lists(st.integers(0, VOCAB - 1), max_size=4),
)
def test_adjusted_greedy_acceptance_follows_the_extended_context(drafts, rows, penalty, bias, output):
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty, logit_bias=tuple(bias) or None)
    if not params.adjusts_logits:
        params = SamplingParams(temperature=0.0, repetition_penalty=1.25)
    logits = torch.tensor(rows[: len(drafts) + 1], dtype=torch.float64)
    context = LogitContext(prompt_ids=(1, 2), output_ids=tuple(output), end_ids=frozenset())
    a, token, _ = accept(drafts, None, logits, params, None, choice=None, context=context)
    for j in range(len(drafts) + 1):
        best = int(adjust_logits(logits[j], params, context.extended(drafts[:j])).argmax())
        if j == len(drafts) or best != drafts[j]:
            assert (a, token) == (j, best), f"accepted {a}, then {token}; the adjusted rows say {j}, {best}"
            break
