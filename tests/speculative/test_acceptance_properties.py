"""Property tests of the acceptance rules (marked ``proptest``): for any target and draft
distributions, rejection sampling accepts what the rule says and draws its token from the right
distribution, exactly; greedy acceptance takes the longest matching prefix.

The draws are replaced by a recording generator stand-in (``Draws``): each uniform comes from the
test, each ``multinomial`` records the distribution it was given, so the rule itself is checked, not
a sample of its outcomes (``test_acceptance`` checks the outcomes' frequencies).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from pipeline.speculative import acceptance
from pipeline.speculative.acceptance import greedy_accept, output_distribution, rejection_accept

pytestmark = pytest.mark.proptest

VOCAB = 5


def _dist(weights: list[float]) -> torch.Tensor:
    t = torch.tensor(weights, dtype=torch.float64)
    return t / t.sum()


# a distribution over VOCAB tokens with zeros allowed (at least one token has mass)
dists = (
    st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]), min_size=VOCAB, max_size=VOCAB)
    .filter(lambda w: sum(w) > 0)
    .map(_dist)
)


class Draws:
    """Stands in for ``torch.rand`` and ``torch.multinomial`` inside ``acceptance``: the uniforms are
    the test's, every multinomial call records its distribution and returns the given token."""

    def __init__(self, uniforms: list[float], token: int) -> None:
        self.uniforms, self.token = list(uniforms), token
        self.drawn_from: list[torch.Tensor] = []

    def rand(self, *args, **kwargs) -> torch.Tensor:
        return torch.tensor(self.uniforms.pop(0), dtype=torch.float64)

    def multinomial(self, dist: torch.Tensor, n: int, **kwargs) -> torch.Tensor:
        self.drawn_from.append(dist.clone())
        return torch.tensor([self.token])


# (the fixture only installs the stand-in: each example makes its own ``Draws``)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(1, 3), data=st.data())
def test_rejection_accepts_by_the_rule_and_draws_from_the_residual(monkeypatch_draws, k, data):
    """Draft j is accepted iff u_j q_j(d_j) < p_{j-1}(d_j) with q_j(d_j) > 0; at the first
    rejection the token comes from max(p - q, 0) renormalised (p itself if that is all zero);
    when every draft is accepted, from p_k. One uniform per examined draft, one draw in all."""
    target = torch.stack([data.draw(dists) for _ in range(k + 1)])
    q = tuple(data.draw(dists) for _ in range(k))
    drafts = [data.draw(st.integers(0, VOCAB - 1)) for _ in range(k)]
    uniforms = [data.draw(st.sampled_from([0.0, 0.25, 0.5, 0.75, 0.999])) for _ in range(k)]
    draws = monkeypatch_draws(uniforms, token=data.draw(st.integers(0, VOCAB - 1)))

    a, token = rejection_accept(drafts, q, target, None)

    expect = 0
    while expect < k:
        p_d, q_d = float(target[expect, drafts[expect]]), float(q[expect][drafts[expect]])
        if not (q_d > 0 and uniforms[expect] * q_d < p_d):
            break
        expect += 1
    assert a == expect
    assert token == draws.token
    assert len(draws.drawn_from) == 1, "exactly one token draw"
    assert len(draws.uniforms) == k - min(a + 1, k), "one uniform per examined draft"
    if a == k:
        want = target[k]
    else:
        residual = torch.clamp(target[a] - q[a], min=0.0)
        want = residual / residual.sum() if float(residual.sum()) > 0 else target[a]
    assert torch.allclose(draws.drawn_from[0], want, atol=1e-12), (draws.drawn_from[0], want)


@pytest.fixture
def monkeypatch_draws(monkeypatch):
    """Installs a ``Draws`` in ``acceptance``'s view of torch (the module's other torch calls go to
    torch itself)."""
    made: list[Draws] = []

    class TorchView:
        def __getattr__(self, name):
            if name in ("rand", "multinomial"):
                return getattr(made[-1], name)
            return getattr(torch, name)

    monkeypatch.setattr(acceptance, "torch", TorchView())

    def install(uniforms: list[float], token: int) -> Draws:
        made.append(Draws(uniforms, token))
        return made[-1]

    return install


@settings(max_examples=200, deadline=None)
@given(p=dists, q=dists)
def test_one_draft_step_emits_exactly_the_target_distribution(p, q):
    """Accept with min(1, p/q), else draw from the residual: the emitted token is distributed as p."""
    out = output_distribution(p, q)
    assert torch.allclose(out, p, atol=1e-12), (out, p)


@settings(max_examples=200, deadline=None)
@given(
    choice=st.lists(st.integers(0, 3), min_size=2, max_size=5),
    data=st.data(),
)
def test_greedy_accepts_the_longest_prefix_that_matches_the_targets_choice(choice, data):
    k = len(choice) - 1
    drafts = data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k))
    logits = torch.zeros(k + 1, 4, dtype=torch.float64)
    logits[torch.arange(k + 1), torch.tensor(choice)] = 1.0
    a, token = greedy_accept(drafts, logits)
    expect = 0
    while expect < k and drafts[expect] == choice[expect]:
        expect += 1
    assert (a, token) == (expect, choice[expect])
    assert greedy_accept(drafts, logits, choice) == (a, token)
