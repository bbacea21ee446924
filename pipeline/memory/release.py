"""A release that a fault can interrupt and a later call resume (both memory layers use it).

A memory layer's ``_give_back(row, tokens)`` frees what a row still owns, each step done once however
often it runs (what the row owns is what the allocators say it owns), and forgets the row last.
``release`` runs it; when a step fails, the row stays in ``leaving`` (no longer live, still holding
memory), the failure is logged with the row, and the release is tried again from where it stopped,
then by every later ``reclaim`` (the layers call it at each admission, release and close, and before
the pools are counted)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

log = structlog.get_logger("hispec.memory")

GiveBack = Callable[[int, Sequence[int] | None], None]


def release(
    row: int, tokens: Sequence[int] | None, leaving: set[int], give_back: GiveBack, layer: str
) -> None:
    """Release ``row`` (``tokens``: what its pages may leave to the prefix cache); never raises."""
    reclaim(leaving, give_back, layer)
    leaving.add(row)
    try:
        give_back(row, tokens)
    except Exception:
        log.error(f"{layer}.release_failed", row=row, exc_info=True)
        reclaim(leaving, give_back, layer)


def reclaim(leaving: set[int], give_back: GiveBack, layer: str) -> int:
    """Finish the releases a fault interrupted (without the cache); returns how many rows still hold
    memory."""
    for row in sorted(leaving):
        try:
            give_back(row, None)
        except Exception:
            log.error(f"{layer}.release_deferred", row=row, exc_info=True)
    return len(leaving)
