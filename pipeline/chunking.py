"""Chunked prefill: which positions of which prompts the next prefill forward computes.

A prefill forward carries at most ``budget`` prompt tokens (None: no limit). Requests are served in
admission order; each gets as much of what is left of its prompt as the budget still allows, so a
long prompt is computed over several forwards (chunks of at most ``budget`` tokens) and short prompts
share a forward. The head request always gets a chunk (the budget is at least 1), so every forward
makes progress. The scheduling core and ``Executor.prefill`` both plan with this one rule.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from pipeline.messages import PrefillChunk


def plan_chunks(pending: Iterable[tuple[str, int, int]], budget: int | None) -> tuple[PrefillChunk, ...]:
    """``pending``: (request id, positions computed, prompt length) in admission order."""
    chunks: list[PrefillChunk] = []
    left = budget
    for rid, done, total in pending:
        if done >= total:
            continue
        if left is not None and left <= 0:
            break
        end = total if left is None else min(total, done + left)
        chunks.append(PrefillChunk(rid, done, end))
        if left is not None:
            left -= end - done
    return tuple(chunks)


@attrs.define
class PrefillCounters:
    """Engine-wide prefill figures (``Executor.stats()["prefill"]``)."""

    forwards: int = 0  # prefill forwards run
    mixed_forwards: int = 0  # of those, forwards that carried running requests' decode tokens too
    chunks: int = 0  # request chunks computed (a prompt prefilled whole is one chunk)
    continued_chunks: int = 0  # chunks that do not start their prompt: they read the earlier ones
    misses: int = 0  # rows prefill forwards swapped in host -> device (HiSparse)
    h2d_bytes: int = 0  # bytes those rows moved

    def record(
        self,
        items: list[tuple[object, int, int]],
        after: tuple[int, int, int],
        before: tuple[int, int, int],
        *,
        mixed: bool = False,
    ) -> None:
        """One forward over ``items`` (request, start, end); the prefill's swap-in totals after and
        before it; ``mixed``: the forward carried decode tokens too."""
        self.forwards += 1
        self.mixed_forwards += mixed
        self.chunks += len(items)
        self.continued_chunks += sum(1 for _, start, _ in items if start > 0)
        self.misses += after[1] - before[1]
        self.h2d_bytes += after[2] - before[2]

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)
