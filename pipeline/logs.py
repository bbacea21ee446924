"""Structured logs: configuring their output, and reading a request's life back from them.

Every state change of a request is one log event, written by ``Request.apply`` on the
``hispec.lifecycle`` logger: the event is named after the lifecycle event (``Admitted``,
``Verified``, ...) and carries ``request_id``, ``from_state``, ``state``, the event's own fields and
the step's figures (batch size, HiSparse hits and misses, accepted tokens). The stages bind
``request_id`` and ``stage`` with ``structlog.contextvars`` around each request they handle.

The library never configures structlog on import: the application does, or calls
``configure_logging`` (the CLI and the tests do). Unconfigured, structlog prints every event to
stdout.
"""

from __future__ import annotations

import json as jsonlib
import logging
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from os import PathLike
from pathlib import Path
from typing import Any, TextIO

import attrs
import structlog

from statemachines.request import EVENTS_BY_NAME, State, advance


def info_enabled() -> bool:
    """Whether info events get processed under the current configuration (cheap to ask)."""
    check = getattr(structlog.get_config()["wrapper_class"], "is_enabled_for", None)
    if check is None:
        return True
    try:
        return bool(check(None, logging.INFO))  # the filtering loggers' check ignores self
    except Exception:
        return True


def request_context(request_id: str, stage: str) -> AbstractContextManager[Any]:
    """Bind ``request_id`` and ``stage`` to every log line written inside the block (task-local)."""
    return structlog.contextvars.bound_contextvars(request_id=request_id, stage=stage)


@attrs.define(eq=False)
class LogSink:
    """What ``configure_logging`` opened; ``close()`` it when done (a no-op for a console)."""

    file: TextIO | None = None
    path: Path | None = None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _level_number(level: str | int) -> int:
    if isinstance(level, int):
        return level
    number = logging.getLevelName(level.upper())
    if not isinstance(number, int):
        raise ValueError(f"unknown log level {level!r}")
    return number


def configure_logging(
    json: bool | str | PathLike[str] = False,
    level: str | int = "info",
    *,
    stream: TextIO | None = None,
    processors: Sequence[Any] = (),
) -> LogSink:
    """Configure structlog for hispec's events (an application may configure it itself instead).

    * ``json=False``: human-readable lines on ``stream`` (default stderr);
    * ``json=True``: one JSON object per line on ``stream``;
    * ``json=<path>``: JSON lines written to that file (truncated first), for ``hispec trace``.

    Events below ``level`` are dropped before any processing. ``processors`` run after the
    timestamp and before rendering (a processor may raise ``structlog.DropEvent`` to keep an event
    from being written). Returns the sink to close.
    """
    sink = LogSink()
    if json is True or json is False:
        out = stream if stream is not None else sys.stderr
    else:
        sink.path = Path(json)
        out = sink.file = sink.path.open("w", buffering=1, encoding="utf-8")
    chain: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        *processors,
    ]
    if json is False:
        # Python's plain traceback: rich's (structlog's default when rich is installed) renders every
        # frame's locals, which here are tensors and request contents: slow (seconds an error) and
        # more than a log should carry
        colors = bool(getattr(out, "isatty", lambda: False)())
        plain = structlog.dev.plain_traceback
        chain.append(structlog.dev.ConsoleRenderer(colors=colors, exception_formatter=plain))
    else:
        chain += [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=chain,
        wrapper_class=structlog.make_filtering_bound_logger(_level_number(level)),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    return sink


# --- reading lifecycles back -----------------------------------------------------------------------


class LogReplayError(Exception):
    """A log's lifecycle events disagree with the state machine."""


def read_json_lines(path: str | PathLike[str]) -> list[dict[str, Any]]:
    """Every JSON object of a JSON-lines file (lines that are not JSON objects are skipped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            records.append(jsonlib.loads(line))
        except ValueError:
            continue
    return records


def is_lifecycle(record: dict[str, Any]) -> bool:
    return record.get("event") in EVENTS_BY_NAME and "from_state" in record and "request_id" in record


def record_time(record: dict[str, Any]) -> float | None:
    """The record's timestamp in seconds since the epoch (None if it has none)."""
    stamp = record.get("timestamp")
    if isinstance(stamp, (int, float)):
        return float(stamp)
    if isinstance(stamp, str):
        return datetime.fromisoformat(stamp).timestamp()
    return None


def by_request(records: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Lifecycle records grouped by request id, in log order (requests in order of first event)."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if is_lifecycle(record):
            grouped.setdefault(str(record["request_id"]), []).append(record)
    return grouped


def _event_of(record: dict[str, Any]):
    cls = EVENTS_BY_NAME[record["event"]]
    names = [a.name for a in attrs.fields(cls)]
    return cls(**{n: record[n] for n in names if n in record})


def replay(records: Iterable[dict[str, Any]]) -> dict[str, State]:
    """Run every request's logged events through ``advance`` from QUEUED; returns the final states.

    Raises ``IllegalTransition`` for an illegal event, ``LogReplayError`` when a logged state
    disagrees with the replayed one.
    """
    final: dict[str, State] = {}
    for rid, events in by_request(records).items():
        state = State.QUEUED
        for record in events:
            if record["from_state"] != state.value:
                raise LogReplayError(
                    f"{rid}: logged from_state {record['from_state']}, replayed {state.value}"
                )
            state = advance(state, _event_of(record))
            if record["state"] != state.value:
                raise LogReplayError(f"{rid}: logged state {record['state']}, replayed {state.value}")
        final[rid] = state
    return final


@attrs.frozen
class Band:
    """A stretch of time a request spent in one state."""

    state: str
    start: float  # seconds since the epoch
    end: float | None  # None for the terminal state (it has no end)


SUBMITTED = "request.submitted"  # logged by the engine when a request enters the queue (not a state change)


def arrivals(records: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Request id -> the time it was submitted, from ``request.submitted`` records."""
    found = {}
    for record in records:
        if record.get("event") == SUBMITTED and "request_id" in record:
            stamp = record_time(record)
            if stamp is not None:
                found[str(record["request_id"])] = stamp
    return found


def bands(events: list[dict[str, Any]], arrival: float | None = None) -> Iterator[Band]:
    """The states one request went through: from ``arrival`` (if known) in its first from_state, then
    one band per logged event."""
    first = record_time(events[0]) if events else None
    if arrival is not None and first is not None:
        yield Band(events[0]["from_state"], arrival, first)
    for record, following in zip(events, [*events[1:], None]):
        start = record_time(record)
        if start is None:
            continue
        end = record_time(following) if following is not None else None
        yield Band(record["state"], start, end)
