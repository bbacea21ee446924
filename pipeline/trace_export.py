"""Request lifecycles, read from a JSON-lines log, for other tools: Chrome/Perfetto trace-event JSON
and OpenTelemetry spans (OTLP over HTTP).

* ``write_perfetto``: the JSON object format of the Chrome trace-event format, which Perfetto's UI
  (ui.perfetto.dev), its trace processor and ``chrome://tracing`` open. Process "requests": one
  thread (a track) per request, one complete slice (``ph: "X"``) per stretch in one state, an
  instant event where it ended and one where it was demoted or promoted (dynamic residency).
  Process "executor": the device commands the log's step figures describe (one slice per command,
  on one track), ending when their events were logged and lasting their ``device_ms``.
* ``export_otlp``: each request as a span (``hispec.request``) with one child span per stretch in
  one state, an event where it was demoted or promoted and one where it ended, sent to an OTLP/HTTP
  collector; ``LiveSpans`` does the same while a server runs, as a structlog processor (``hispec
  serve --otlp-traces-endpoint``). Needs the ``otel`` extra (``opentelemetry-sdk``,
  ``opentelemetry-exporter-otlp-proto-http``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Collection, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import attrs
import structlog

from pipeline.logs import SUBMITTED, is_lifecycle, record_time
from pipeline.stretches import TERMINAL_STATES, Mark, Row, build_rows

# --- the executor's commands ---------------------------------------------------------------------------

# lifecycle event -> the command whose result it reports (the events that carry the step's figures)
COMMAND_OF = {"ChunkDone": "prefill", "PrefillDone": "prefill", "StepDone": "decode", "Verified": "verify"}
FIGURES = ("step_hits", "step_misses", "step_h2d_bytes")
KINDS = ("prefill", "decode", "verify")


@attrs.frozen
class ExecutorCommand:
    """One device command, as the lifecycle events reporting its result describe it."""

    kind: str  # "prefill", "decode", "verify"; "prefill+decode" for a mixed step
    start: float  # seconds since the epoch: ``end`` less the command's wall time
    end: float  # when the first of its events was logged
    device_ms: float
    batch_size: int
    request_ids: tuple[str, ...]  # the requests whose events name it (those that ended with it do not)
    figures: dict[str, int] = attrs.field(factory=dict, eq=False)  # the step's HiSparse figures


def executor_commands(records: Iterable[dict[str, Any]]) -> list[ExecutorCommand]:
    """The commands of a log, in the order they ended, laid out on one track.

    A command's events are logged one after the other by the stage that issued it, each with the
    same figures (``device_ms``, ``batch_size``, the HiSparse counters): a run of such events for
    distinct requests is one command. Times come from the log, taken after the command: where an
    estimated start overlaps the command before, the start moves to that command's end (the executor
    runs one command at a time), except for the two parts of a mixed step (one forward, the same
    ``device_ms``), which become one command."""
    groups: list[tuple[tuple, float, list[str]]] = []
    for record in records:
        if not is_lifecycle(record) or "device_ms" not in record or record.get("event") not in COMMAND_OF:
            continue
        t = record_time(record)
        if t is None:
            continue
        key = (
            record.get("stage"),
            COMMAND_OF[record["event"]],
            record["device_ms"],
            record.get("batch_size"),
            *(record.get(f) for f in FIGURES),
        )
        rid = str(record["request_id"])
        if groups and groups[-1][0] == key and rid not in groups[-1][2]:
            groups[-1][2].append(rid)
        else:
            groups.append((key, t, [rid]))
    commands: list[ExecutorCommand] = []
    for key, end, rids in sorted(groups, key=lambda g: g[1]):
        _stage, kind, device_ms, batch_size, *figures = key
        seconds = float(device_ms) / 1e3
        command = ExecutorCommand(
            kind, end - seconds, end, float(device_ms), int(batch_size or len(rids)), tuple(rids),
            {f: int(v) for f, v in zip(FIGURES, figures) if v is not None},
        )
        if commands and command.start < commands[-1].end:
            before = commands[-1]
            if before.device_ms == command.device_ms and before.kind != command.kind:  # a mixed step
                kinds = "+".join(sorted({*before.kind.split("+"), command.kind}, key=KINDS.index))
                commands[-1] = attrs.evolve(
                    before, kind=kinds, end=max(before.end, command.end),
                    batch_size=before.batch_size + command.batch_size,
                    request_ids=before.request_ids + command.request_ids,
                )
                continue
            command = attrs.evolve(command, start=before.end)
        commands.append(command)
    return commands


# --- Perfetto / Chrome trace-event JSON ------------------------------------------------------------------

REQUESTS_PID, EXECUTOR_PID = 1, 2


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def _times(start: float, end: float, t0: float) -> dict[str, float]:
    """``ts`` and ``dur`` (microseconds) such that a slice ending where the next starts meets it."""
    ts = _us(start, t0)
    return {"ts": ts, "dur": round(_us(end, t0) - ts, 3)}


def _mark_args(row: Row, mark: Mark) -> dict[str, Any]:
    return {"request_id": row.request_id, "state": mark.state, mark.bytes_field: mark.num_bytes}


def _metadata(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


def perfetto_trace(rows: Sequence[Row], commands: Sequence[ExecutorCommand] = (), source: str = "") -> dict:
    """The trace-event JSON object (``json.dump`` it): times in microseconds since the first event."""
    starts = [r.start for r in rows if r.start is not None] + [c.start for c in commands]
    t0 = min(starts) if starts else 0.0
    events: list[dict[str, Any]] = [
        _metadata("process_name", REQUESTS_PID, 0, name="requests"),
        _metadata("process_sort_index", REQUESTS_PID, 0, sort_index=1),
    ]
    for tid, row in enumerate(rows, start=1):
        events.append(_metadata("thread_name", REQUESTS_PID, tid, name=row.request_id))
        events.append(_metadata("thread_sort_index", REQUESTS_PID, tid, sort_index=tid))
        for band in row.bands:
            args = {"request_id": row.request_id, "events": band.events, "entered_by": band.entered_by}
            events.append(
                {
                    "ph": "X", "name": band.state, "cat": "lifecycle", "pid": REQUESTS_PID, "tid": tid,
                    **_times(band.start, band.end, t0), "args": args,
                }
            )
        for mark in row.marks:
            events.append(
                {
                    "ph": "i", "s": "t", "name": mark.kind, "cat": "residency", "pid": REQUESTS_PID,
                    "tid": tid, "ts": _us(mark.at, t0), "args": _mark_args(row, mark),
                }
            )
        if row.end is not None:
            ended: dict[str, Any] = {"request_id": row.request_id, "reason": row.reason}
            if row.output_tokens is not None:
                ended["output_tokens"] = row.output_tokens
            events.append(
                {
                    "ph": "i", "s": "t", "name": row.final, "cat": "lifecycle", "pid": REQUESTS_PID,
                    "tid": tid, "ts": _us(row.end, t0), "args": ended,
                }
            )
    if commands:
        events += [
            _metadata("process_name", EXECUTOR_PID, 0, name="executor"),
            _metadata("process_sort_index", EXECUTOR_PID, 0, sort_index=0),
            _metadata("thread_name", EXECUTOR_PID, 1, name="commands"),
        ]
    for c in commands:
        events.append(
            {
                "ph": "X", "name": c.kind, "cat": "executor", "pid": EXECUTOR_PID, "tid": 1,
                **_times(c.start, c.end, t0),
                "args": {"device_ms": c.device_ms, "batch_size": c.batch_size,
                         "requests": ", ".join(c.request_ids), **c.figures},
            }
        )
    other = {"producer": "hispec trace", "t0_utc": datetime.fromtimestamp(t0, UTC).isoformat()}
    if source:
        other["log"] = source
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_perfetto(
    path: Path, rows: Sequence[Row], records: Sequence[dict[str, Any]], keep: Collection[str] | None = None
) -> dict:
    """Write ``rows`` and the log's executor commands (those naming a request of ``keep``, when given)
    as trace-event JSON; returns the object written."""
    commands = executor_commands(records)
    if keep is not None:
        commands = [c for c in commands if set(c.request_ids) & set(keep)]
    trace = perfetto_trace(rows, commands, Path(path).name)
    Path(path).write_text(json.dumps(trace, separators=(",", ":")), encoding="utf-8")
    return trace


# --- OpenTelemetry ---------------------------------------------------------------------------------------

OTEL_EXTRA = "the `otel` extra is not installed (pip install 'hispec[otel]')"
SPAN_BATCH = 512  # spans per OTLP request


class OtelMissing(RuntimeError):
    """The OpenTelemetry packages are not installed."""


class OtlpExportError(RuntimeError):
    """The collector did not take the spans."""


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP traces URL: a bare ``http://host:4318`` gets the standard ``/v1/traces`` path."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http(s) URL: {endpoint!r}")
    return endpoint.rstrip("/") + "/v1/traces" if parts.path in ("", "/") else endpoint


def _sdk() -> Any:
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    except ImportError as exc:
        raise OtelMissing(OTEL_EXTRA) from exc
    return SimpleNamespace(
        trace=trace, exporter=OTLPSpanExporter, resource=Resource, provider=TracerProvider,
        batch=BatchSpanProcessor, simple=SimpleSpanProcessor, memory=InMemorySpanExporter,
    )


def _ns(t: float) -> int:
    return round(t * 1e9)


def emit_request(sdk: Any, tracer: Any, row: Row) -> int:
    """Start and end ``row``'s spans on ``tracer``: the request, then one child per stretch; returns
    how many."""
    start, last = row.start, row.last
    if start is None or last is None:
        return 0
    attributes: dict[str, Any] = {"hispec.request_id": row.request_id, "hispec.final_state": row.final}
    if row.reason:
        attributes["hispec.finish_reason"] = row.reason
    if row.output_tokens is not None:
        attributes["hispec.output_tokens"] = row.output_tokens
    root = tracer.start_span("hispec.request", start_time=_ns(start), attributes=attributes)
    context = sdk.trace.set_span_in_context(root)
    for band in row.bands:
        child = tracer.start_span(
            band.state, context=context, start_time=_ns(band.start),
            attributes={"hispec.state": band.state, "hispec.events": band.events,
                        "hispec.entered_by": band.entered_by},
        )
        child.end(end_time=_ns(band.end))
    for mark in row.marks:
        root.add_event(
            mark.kind,
            {"hispec.state": mark.state, f"hispec.{mark.bytes_field}": mark.num_bytes},
            timestamp=_ns(mark.at),
        )
    if row.end is not None:
        root.add_event(row.final, {"hispec.finish_reason": row.reason}, timestamp=_ns(row.end))
        if row.final == "failed":
            root.set_status(sdk.trace.Status(sdk.trace.StatusCode.ERROR, row.reason or "failed"))
    root.end(end_time=_ns(last))
    return 1 + len(row.bands)


def _resource(sdk: Any, service_name: str) -> Any:
    return sdk.resource.create({"service.name": service_name})


def export_otlp(
    rows: Iterable[Row], endpoint: str, *, service_name: str = "hispec", timeout: float = 10.0
) -> int:
    """Send every row's spans to the OTLP/HTTP collector at ``endpoint``; returns how many were sent.
    Raises ``OtelMissing`` without the ``otel`` extra, ``OtlpExportError`` when the collector did not
    take them."""
    sdk = _sdk()
    from opentelemetry.sdk.trace.export import SpanExportResult

    url = traces_url(endpoint)
    memory = sdk.memory()
    provider = sdk.provider(resource=_resource(sdk, service_name))
    provider.add_span_processor(sdk.simple(memory))
    tracer = provider.get_tracer("hispec.trace")
    try:
        for row in rows:
            emit_request(sdk, tracer, row)
    finally:
        provider.shutdown()
    spans = memory.get_finished_spans()
    exporter = sdk.exporter(endpoint=url, timeout=timeout)
    try:
        for i in range(0, len(spans), SPAN_BATCH):
            if exporter.export(spans[i : i + SPAN_BATCH]) is not SpanExportResult.SUCCESS:
                raise OtlpExportError(f"the collector at {url} did not take the spans")
    finally:
        exporter.shutdown()
    return len(spans)


LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
          "critical": logging.CRITICAL}


class LiveSpans:
    """A structlog processor (``configure_logging(processors=[...])``) that sends each request's
    spans to an OTLP/HTTP collector when its lifecycle ends (in the background, in batches).

    It reads the lifecycle events' ``timestamp``, so it comes after the time stamper (where
    ``configure_logging`` puts its ``processors``). ``drop_below``: events under this level are read
    and then dropped, for a configuration that lets info events through only for this processor.
    ``close()`` sends what is left."""

    def __init__(self, endpoint: str, *, service_name: str = "hispec", drop_below: str | None = None) -> None:
        self._sdk = _sdk()
        self.url = traces_url(endpoint)
        self._provider = self._sdk.provider(resource=_resource(self._sdk, service_name))
        self._provider.add_span_processor(self._sdk.batch(self._sdk.exporter(endpoint=self.url)))
        self._tracer = self._provider.get_tracer("hispec.serve")
        self._open: dict[str, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._drop_below = LEVELS[drop_below] if drop_below else None
        self.sent = 0  # spans started and ended (handed to the batch exporter)

    def __call__(self, logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        rid = event_dict.get("request_id")
        lifecycle = is_lifecycle(event_dict)
        if rid is not None and (lifecycle or event_dict.get("event") == SUBMITTED):
            with self._lock:
                records = self._open.setdefault(str(rid), [])
                records.append(dict(event_dict))
                if lifecycle and event_dict.get("state") in TERMINAL_STATES:
                    rows = build_rows(self._open.pop(str(rid)))
                    self.sent += sum(emit_request(self._sdk, self._tracer, row) for row in rows)
        if self._drop_below is not None:
            level = LEVELS.get(str(event_dict.get("level", method_name)).lower(), logging.INFO)
            if level < self._drop_below:
                raise structlog.DropEvent
        return event_dict

    def flush(self, timeout_s: float = 30.0) -> bool:
        return bool(self._provider.force_flush(int(timeout_s * 1e3)))

    def close(self) -> None:
        self._provider.shutdown()
