"""Acceptance rules: greedy picks the target's argmax chain; rejection sampling reproduces the target
distribution exactly (checked analytically, then empirically through the function itself)."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from pipeline.speculative.acceptance import greedy_accept, output_distribution, rejection_accept


def test_greedy_accepts_the_matching_prefix_and_takes_the_targets_next_choice():
    logits = torch.full((4, 10), -1.0)
    for j, best in enumerate([3, 5, 7, 1]):
        logits[j, best] = 2.0
    assert greedy_accept([3, 5, 7], logits) == (3, 1)
    assert greedy_accept([3, 9, 7], logits) == (1, 5)
    assert greedy_accept([4, 5, 7], logits) == (0, 3)


def test_greedy_ties_go_to_the_lowest_token_like_plain_greedy():
    logits = torch.zeros(2, 6)
    assert greedy_accept([0], logits) == (1, 0)
    assert greedy_accept([2], logits) == (0, 0)


def _dist(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64) + 1e-3
    return t / t.sum()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0, 1), min_size=2, max_size=12).flatmap(
        lambda p: st.tuples(st.just(p), st.lists(st.floats(0, 1), min_size=len(p), max_size=len(p)))
    )
)
def test_one_step_output_distribution_is_exactly_the_target(pq):
    p, q = _dist(pq[0]), _dist(pq[1])
    assert torch.allclose(output_distribution(p, q), p, atol=1e-12)


def test_rejection_accept_samples_the_target_distribution():
    """20,000 draws of the first emitted token, drafts sampled from q; chi-square goodness of fit
    against p at significance level 0.001 (seeded, so the verdict is deterministic)."""
    gen = torch.Generator().manual_seed(0)
    vocab = 6
    p = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.20, 0.10], dtype=torch.float64)
    q = torch.tensor([0.10, 0.40, 0.10, 0.20, 0.10, 0.10], dtype=torch.float64)
    p2 = torch.full((vocab,), 1 / vocab, dtype=torch.float64)
    target = torch.stack([p, p2])
    counts = torch.zeros(vocab)
    draws = 20_000
    for _ in range(draws):
        draft = int(torch.multinomial(q, 1, generator=gen))
        accepted, token = rejection_accept([draft], (q,), target, gen)
        counts[draft if accepted == 1 else token] += 1
    expected = p * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.52, f"chi-square {chi2:.2f} with 5 degrees of freedom exceeds the 0.001 critical value"


@settings(max_examples=60, deadline=None)
@given(
    greedy=st.lists(st.booleans(), min_size=1, max_size=6),
    vocab=st.integers(2, 9),
    seed=st.integers(0, 2**16),
)
def test_a_batch_of_proposals_is_each_rows_own_proposal(greedy, vocab, seed):
    """``propose_rows`` (one argmax for a batch's greedy rows) proposes for every row what
    ``propose`` proposes for it alone: the first maximum for greedy rows (logits with ties), the
    same draw from the same generator for sampled ones."""
    from pipeline.sampling import SamplingParams
    from pipeline.speculative.drafting import propose, propose_rows

    logits = torch.randint(0, 3, (len(greedy), vocab), generator=torch.Generator().manual_seed(seed)).double()
    params = [
        SamplingParams() if g else SamplingParams(temperature=0.8, seed=seed + i)
        for i, g in enumerate(greedy)
    ]

    def generators():
        return [None if g else torch.Generator().manual_seed(seed + i) for i, g in enumerate(greedy)]

    together = propose_rows(logits, params, generators())
    alone = [propose(logits[i], p, gen) for i, (p, gen) in enumerate(zip(params, generators()))]
    assert [t for t, _ in together] == [t for t, _ in alone]
    for (_, q), (_, want) in zip(together, alone):
        assert (q is None and want is None) or torch.equal(q, want)
