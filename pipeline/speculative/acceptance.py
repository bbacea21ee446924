"""Acceptance of chain drafts: greedy, and rejection sampling that preserves the target distribution.

Given drafts ``d_1..d_k`` and the target's distributions ``p_0..p_k`` at the verify tokens (``p_j``
is the target's next-token distribution after verify token j):

* greedy: accept ``d_j`` while it equals ``argmax p_{j-1}``; the next token is ``argmax p_a``;
* sampling (Leviathan et al.): accept ``d_j`` with probability ``min(1, p_{j-1}(d_j) / q_j(d_j))``;
  at the first rejection the next token is drawn from ``max(p_{j-1} - q_j, 0)`` renormalised; if all
  are accepted it is drawn from ``p_k``. The output has exactly the distribution of sampling ``p``.

Both return ``(a, next_token)``: ``a`` accepted drafts, so ``a + 1`` tokens are committed (the bonus
that was verify token 0, then ``d_1..d_a``) and ``next_token`` is the new bonus.

``accept`` is one request's acceptance in a verify: its logit adjustments, either rule, and the
log-probabilities of the committed tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipeline.sampling import LogitContext, SamplingParams, adjust_logits, probabilities, token_logprob

if TYPE_CHECKING:
    from pipeline.messages import TokenLogprob


def greedy_accept(
    drafts: list[int], target_logits: torch.Tensor, choice: list[int] | None = None
) -> tuple[int, int]:
    """``target_logits [k + 1, V]``; argmax ties go to the lowest id, as in plain greedy decoding.
    ``choice``: that argmax of each row, when the caller read it for a whole batch at once."""
    if choice is None:
        choice = target_logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == choice[accepted]:
        accepted += 1
    return accepted, choice[accepted]


def rejection_accept(
    drafts: list[int],
    draft_probs: tuple[torch.Tensor, ...],  # q_j [V] for each draft
    target_probs: torch.Tensor,  # [k + 1, V]
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling; consumes one uniform per examined draft and one draw for the token."""
    for j, token in enumerate(drafts):
        p, q = target_probs[j], draft_probs[j]
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if q[token] > 0 and u * float(q[token]) < float(p[token]):  # u < p/q without dividing
            continue
        residual = torch.clamp(p - q, min=0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p
        return j, int(torch.multinomial(dist, 1, generator=generator))
    return len(drafts), int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator))


def output_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exact distribution of the token one draft step emits, for tests: draft ~ q, accept with
    min(1, p/q), else draw from the residual."""
    accept = torch.minimum(q, p)  # q(x) * min(1, p(x)/q(x))
    residual = torch.clamp(p - q, min=0.0)
    rejected_mass = 1.0 - float(accept.sum())
    total = float(residual.sum())
    return accept + (rejected_mass * residual / total if total > 0 else torch.zeros_like(p))


def accept(
    drafts: list[int],
    draft_probs: tuple[torch.Tensor, ...] | None,
    logits: torch.Tensor,  # [k + 1, V]
    params: SamplingParams,
    generator: torch.Generator | None,
    choice: list[int] | None = None,  # greedy: the target's argmax per row, when already read
    context: LogitContext | None = None,  # the request's, before the bonus token's successor
) -> tuple[int, int, tuple[TokenLogprob, ...] | None]:
    """(accepted drafts a, the new bonus token, the log-probabilities of the ``a + 1`` committed
    tokens when the request asks for them). Row j's logits are adjusted for the context extended by
    ``d_1..d_j`` (the output a plain step there would have seen), so a request with penalties, a
    bias or ``min_tokens`` is verified against exactly the distribution plain decoding samples."""
    if params.adjusts_logits:
        assert context is not None, "adjusted logits need the request's context"
        logits = torch.stack([adjust_logits(logits[j], params, context.extended(drafts[:j]))
                              for j in range(logits.shape[0])])
        choice = None
    if params.greedy:
        a, token = greedy_accept(drafts, logits, choice)
    else:
        assert draft_probs is not None
        target = probabilities(logits.cpu(), params)
        a, token = rejection_accept(drafts, draft_probs, target, generator)
    if params.logprobs is None:
        return a, token, None
    committed = (*drafts[:a], token)
    return a, token, tuple(token_logprob(logits[j], params, t) for j, t in enumerate(committed))
