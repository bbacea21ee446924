"""``HiddenRun``: the target's hidden states a request holds until its MTP rows are written.

Row p of the MTP layer pairs the target's hidden state at position p with the token at p + 1; a run
keeps both for consecutive positions, in the blocks they came in (a prefill chunk, a decode step).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence as Seq

import attrs
import torch


@attrs.define(eq=False)
class HiddenRun:
    """The target's hidden states at consecutive positions whose MTP rows are not written yet, and
    the token after each (what the MTP layer's draft extend over them reads). Kept as the blocks
    they came in (a prefill chunk's ``[n, D]``, a decode step's row ``[D]``), never split into one
    tensor per position: a prompt's block costs one entry, not one view per position."""

    # (first position, rows, next ids) of each block, in position order
    blocks: list[tuple[int, torch.Tensor, tuple[int, ...]]] = attrs.Factory(list)
    count: int = 0

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    @property
    def first(self) -> int:
        return self.blocks[0][0]

    @property
    def last(self) -> int:
        return self.blocks[0][0] + self.count - 1

    def add(self, start: int, hidden: torch.Tensor, next_ids: Seq[int]) -> None:
        """Positions ``start, start + 1, ...`` (they continue the run): ``hidden`` ``[n, D]`` (or one
        row ``[D]``), ``next_ids`` of length n."""
        n = 1 if hidden.dim() == 1 else hidden.shape[0]
        assert n == len(next_ids) > 0, (n, len(next_ids))
        assert not self.count or start == self.last + 1, (
            f"position {start} does not continue the run at {self.last}"
        )
        self.blocks.append((start, hidden, tuple(next_ids)))
        self.count += n

    def truncate(self, end: int) -> None:
        """Keep the positions below ``end``."""
        kept: list[tuple[int, torch.Tensor, tuple[int, ...]]] = []
        for start, hidden, ids in self.blocks:
            if start >= end:
                break
            if start + len(ids) > end:
                hidden, ids = hidden[: end - start], ids[: end - start]
            kept.append((start, hidden, ids))
        self.blocks, self.count = kept, sum(len(ids) for _, _, ids in kept)

    def rows(self, start: int, end: int, *, own: bool = False) -> torch.Tensor:
        """The hidden states of positions ``[start, end)`` (held), ``[end - start, D]``: a view where
        one block holds them all, unless ``own`` (a copy then, which keeps no block alive)."""
        held = self.count and self.first <= start < end <= self.last + 1
        assert held, f"positions [{start}, {end}) not held"
        i = bisect.bisect_right(self.blocks, start, key=lambda block: block[0]) - 1
        parts: list[torch.Tensor] = []
        single: list[torch.Tensor] = []  # consecutive decode rows, stacked together
        while i < len(self.blocks) and self.blocks[i][0] < end:
            first, hidden, ids = self.blocks[i]
            if hidden.dim() == 1:
                single.append(hidden)
            else:
                if single:
                    parts.append(torch.stack(single))
                    single = []
                lo, hi = max(start, first), min(end, first + len(ids))
                parts.append(hidden[lo - first : hi - first])
            i += 1
        if single:
            parts.append(torch.stack(single))
        if len(parts) > 1:
            return torch.cat(parts)
        return parts[0].clone() if own and parts[0]._base is not None else parts[0]

    def whole(self) -> tuple[int, torch.Tensor, tuple[int, ...]]:
        """(first position, every row ``[count, D]``, every next id)."""
        ids = tuple(t for _, _, block in self.blocks for t in block)
        return self.first, self.rows(self.first, self.last + 1), ids
