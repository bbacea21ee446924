"""Fault isolation: a batched step that raises is retried on halves of its batch until the requests
that make it fail are found, and only those fail.

The retries redo nothing that was committed: a step commits only after it returns, and everything
before the commit is idempotent. An item is a request (anything with a ``request_id``) or a tuple
whose first element is one, so the same bisection serves forwards over requests and over chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import structlog

log = structlog.get_logger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")


def reason(exc: BaseException) -> str:
    """How a request's failure is reported: the exception's type and message."""
    return f"{type(exc).__name__}: {exc}"


def isolate(
    items: list[Item], run: Callable[[list[Item]], list[Result]], what: str
) -> tuple[list[Result], dict[str, str]]:
    """``run(items)`` -> per-item results; when it raises, run halves until the items that fail
    alone are found. Returns (the results of the items that ran, {request id: reason})."""
    if not items:
        return [], {}
    try:
        return run(items), {}
    except Exception as exc:  # bisect to the culprit
        if len(items) == 1:
            rid = request_id(items[0])
            log.error("executor.request_failed", request_id=rid, step=what, error=reason(exc))
            return [], {rid: reason(exc)}
    half = len(items) // 2
    left, left_failed = isolate(items[:half], run, what)
    right, right_failed = isolate(items[half:], run, what)
    return left + right, {**left_failed, **right_failed}


def request_id(item: object) -> str:
    """The request an isolated item belongs to (a request, or a tuple starting with one)."""
    while isinstance(item, tuple):
        item = item[0]
    return item.request_id  # type: ignore[attr-defined]
