"""The draft state of a request between steps, and its stash / merge.

After a target forward (a prefill or a verify) the MTP layer runs a *draft extend* over the newly
committed tokens; what it leaves behind is one request's draft state: the bonus token (the target's
choice, whose KV does not exist yet), the MTP hidden state to continue the chain from, and the first
draft proposal. A request carries its own state (the *stash*): its prefill batch dissolves into
staging, and it comes back, in whatever group becomes ready, to be *merged* row by row into the
decode batch. ``DraftBatch.merge`` and ``DraftBatch.slice`` are exact inverses.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(eq=False)
class DraftState:
    """One request's drafting state (the stash)."""

    bonus: int  # the target's token at position `length`; verify token 0 of the next round
    hidden: torch.Tensor  # [D] MTP hidden to continue the chain from
    drafts: tuple[int, ...]  # proposals so far: (d_1,) after an extend, (d_1..d_k) after drafting
    draft_probs: tuple[torch.Tensor, ...] | None  # q_j [V] per proposal; None when greedy


@attrs.frozen(eq=False)
class DraftBatch:
    """The draft states of a batch, row i = request i."""

    bonus: torch.Tensor  # [B] int64
    hidden: torch.Tensor  # [B, D]
    drafts: torch.Tensor  # [B, k] int64
    draft_probs: tuple[tuple[torch.Tensor, ...] | None, ...]  # per row

    @classmethod
    def merge(cls, states: list[DraftState]) -> DraftBatch:
        """Stack stashed states row by row; every state must hold the same number of drafts."""
        counts = {len(s.drafts) for s in states}
        if len(counts) != 1:
            raise ValueError(f"cannot merge draft states with {sorted(counts)} drafts")
        return cls(
            bonus=torch.tensor([s.bonus for s in states], dtype=torch.int64),
            hidden=torch.stack([s.hidden for s in states]),
            drafts=torch.tensor([list(s.drafts) for s in states], dtype=torch.int64),
            draft_probs=tuple(s.draft_probs for s in states),
        )

    def slice(self, i: int) -> DraftState:
        """Row ``i`` as a request's own state (views of this batch's tensors are fine: immutable)."""
        return DraftState(
            bonus=int(self.bonus[i]),
            hidden=self.hidden[i].clone(),
            drafts=tuple(self.drafts[i].tolist()),
            draft_probs=self.draft_probs[i],
        )

    def __len__(self) -> int:
        return int(self.bonus.shape[0])
