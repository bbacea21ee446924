"""A request's life read back from a JSON-lines log as stretches of time, one state each: what
``hispec trace`` draws and ``pipeline.trace_export`` exports.

A stretch is time spent in one live state without a break: the lifecycle events that keep a request
in its state (a decode step, a further prompt chunk) extend it, and the wait between submission
(``request.submitted``) and the first event is the first stretch. A demotion or a promotion (dynamic
residency: the request's KV outside its hot buffer left the device, or came back) keeps the state
too, so it extends the stretch as well; each is also a mark at its moment, for the timeline's
markers and the exports' instant events.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from pipeline.logs import SUBMITTED, arrivals, by_request, record_time

LIVE_STATES = ("queued", "prefill", "staging", "ready", "decode", "draft", "verify")
TERMINAL_STATES = ("finished", "aborted", "failed")
# lifecycle events drawn as marks: event -> (the mark's kind, the event's field with its bytes)
MARK_EVENTS = {"Demoted": ("demoted", "freed_bytes"), "Promoted": ("promoted", "copied_bytes")}
MARK_KINDS = tuple(kind for kind, _ in MARK_EVENTS.values())


@attrs.frozen
class Span:
    """A stretch of time a request spent in one live state, without a break: consecutive lifecycle
    events that stay in the state (a decode stretch's steps) extend it."""

    state: str
    start: float  # seconds since the epoch
    end: float
    events: int = 1  # the lifecycle events logged in it (0 for the wait before admission)
    entered_by: str = ""  # the event that entered the state (``request.submitted`` for the wait)


@attrs.frozen
class Mark:
    """A moment that left the request in its state: a demotion (its KV outside the hot buffer left
    the device) or a promotion (its whole context back on the device)."""

    kind: str  # one of MARK_KINDS
    at: float  # seconds since the epoch
    state: str  # the state it happened in
    num_bytes: int  # device bytes freed (demoted), bytes copied host -> device (promoted)

    @property
    def bytes_field(self) -> str:
        """The lifecycle event's name for ``num_bytes`` (``freed_bytes``, ``copied_bytes``)."""
        return next(field for kind, field in MARK_EVENTS.values() if kind == self.kind)


@attrs.frozen
class Row:
    request_id: str
    bands: tuple[Span, ...]  # live states
    end: float | None  # when it reached its terminal state
    final: str  # the last state logged
    reason: str  # finish reason, or "" while live
    output_tokens: int | None
    marks: tuple[Mark, ...] = ()  # demotions and promotions, in log order

    @property
    def start(self) -> float | None:
        return self.bands[0].start if self.bands else self.end

    @property
    def last(self) -> float | None:
        """The last time the log says anything of it."""
        return self.end if self.end is not None else (self.bands[-1].end if self.bands else None)

    def visited(self) -> set[str]:
        return {b.state for b in self.bands} | {self.final}

    def count(self, kind: str) -> int:
        """How many marks of ``kind`` (``demoted``, ``promoted``) it has."""
        return sum(1 for m in self.marks if m.kind == kind)


def _spans(
    events: list[dict[str, Any]], arrival: float | None
) -> tuple[list[Span], tuple[dict, float] | None]:
    """One request's stretches, and its terminal record with its time (None while live)."""
    stamped = [(r, t) for r in events if (t := record_time(r)) is not None]
    spans: list[Span] = []
    if arrival is not None and stamped:
        spans.append(Span(stamped[0][0]["from_state"], arrival, stamped[0][1], 0, SUBMITTED))
    terminal = None
    for (record, t), following in zip(stamped, [*stamped[1:], None]):
        state = record["state"]
        if state not in LIVE_STATES:
            terminal = (record, t)
            break
        if following is None:  # still live when the log ends: the stretch has no end
            break
        end = following[1]
        if spans and spans[-1].state == state and spans[-1].end == t and record["from_state"] == state:
            spans[-1] = attrs.evolve(spans[-1], end=end, events=spans[-1].events + 1)
        else:
            spans.append(Span(state, t, end, 1, str(record["event"])))
    return spans, terminal


def _marks(events: list[dict[str, Any]]) -> tuple[Mark, ...]:
    found = []
    for record in events:
        if record["event"] in MARK_EVENTS and (t := record_time(record)) is not None:
            kind, field = MARK_EVENTS[record["event"]]
            found.append(Mark(kind, t, str(record["state"]), int(record.get(field) or 0)))
    return tuple(found)


def build_rows(records: list[dict]) -> list[Row]:
    """One row per request of the log, in order of first appearance."""
    arrived = arrivals(records)
    rows = []
    for rid, events in by_request(records).items():
        spans, terminal = _spans(events, arrived.get(rid))
        last = events[-1]
        rows.append(
            Row(
                request_id=rid,
                bands=tuple(spans),
                end=terminal[1] if terminal else None,
                final=last["state"],
                reason=str(last.get("reason", "")) if terminal else "",
                output_tokens=last.get("output_tokens"),
                marks=_marks(events),
            )
        )
    return rows


def select(
    rows: Iterable[Row],
    request_ids: Sequence[str] = (),
    states: Sequence[str] = (),
    marks: Sequence[str] = (),
) -> list[Row]:
    """The rows whose id matches one of ``request_ids`` (exact or a shell pattern: ``chatcmpl-1*``),
    that were in one of ``states`` at some point (a terminal state: ended in it) and that have a mark
    of one of the kinds in ``marks`` (``demoted``, ``promoted``); each filter given must hold, no
    filter keeps every row."""
    kept = []
    for row in rows:
        if request_ids and not any(fnmatch.fnmatchcase(row.request_id, p) for p in request_ids):
            continue
        if states and not row.visited() & set(states):
            continue
        if marks and not {m.kind for m in row.marks} & set(marks):
            continue
        kept.append(row)
    return kept
