"""Chunked prefill: which positions of which prompts the next prefill forward computes.

Two bounds, as vLLM's ``long_prefill_token_threshold`` and ``max_num_batched_tokens`` (SGLang's
``chunked_prefill_size`` and prefill batch budget): a request's **chunk**, the most positions of one
prompt one forward computes (``EngineConfig.chunked_prefill_tokens``; with HiSparse it bounds the
device rows a prefilling request holds), and the forward's **budget**, the most prompt tokens it
carries over all its requests (``EngineConfig.prefill_batch_tokens``). Requests are served in
admission order; each gets its chunk, or what is left of the budget if that is less, so a long
prompt is computed over several forwards and short prompts share one. The head request always gets
a chunk (the budget is at least 1), so every forward makes progress. Without a chunk (None: whole
prompts) a prompt joins the head only if the whole of it fits in what is left of the budget; only
a budget smaller than the head's prompt (the engine's pacing, ``PrefillPace``) splits it. The
scheduling core and ``driver.prefill_whole`` both plan with this one rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from pipeline.messages import PrefillChunk


def plan_chunks(
    pending: Iterable[tuple[str, int, int]], budget: int | None, chunk: int | None = None
) -> tuple[PrefillChunk, ...]:
    """``pending``: (request id, positions computed, prompt length) in admission order; ``budget``:
    the forward's prompt tokens (None: no bound); ``chunk``: one request's (None: whole prompts)."""
    chunks: list[PrefillChunk] = []
    left = budget
    for rid, done, total in pending:
        if done >= total:
            continue
        if left is not None and left <= 0:
            break
        size = total - done if chunk is None else min(total - done, chunk)
        if left is not None and size > left:
            if chunk is None and chunks:  # a whole prompt that does not fit waits for the next forward
                break
            size = left
        chunks.append(PrefillChunk(rid, done, done + size))
        if left is not None:
            left -= size
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
        items: Sequence[tuple[object, int, int]],
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
