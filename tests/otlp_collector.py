"""An OTLP/HTTP traces collector on a local port for the tests, and the checks of the spans
``pipeline.trace_export`` sends (one span per request, one child per stretch in one state)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pipeline.logs import is_lifecycle
from pipeline.stretches import TERMINAL_STATES


def state_changes(records: list[dict]) -> int:
    """Lifecycle events that change the state (a decode step, a further prompt chunk do not)."""
    return sum(1 for r in records if is_lifecycle(r) and r["from_state"] != r["state"])


class Collector:
    """An OTLP/HTTP traces collector on a free local port: keeps the spans of every POST."""

    def __init__(self, status: int = 200) -> None:
        """``status``: what every POST is answered with (400: the collector refuses the spans)."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        spans, paths = self.spans, self.paths = [], []
        resources = self.resources = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                message = ExportTraceServiceRequest()
                message.ParseFromString(body)
                paths.append(self.path)
                for resource_spans in message.resource_spans:
                    attributes = resource_spans.resource.attributes
                    resources.append({a.key: a.value.string_value for a in attributes})
                    for scope_spans in resource_spans.scope_spans:
                        spans.extend(scope_spans.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=30)


def check_request_spans(spans, records) -> dict:
    """One root span per request, one child per stretch under it, in its trace; returns the children's
    state names by request id."""
    attrs_of = lambda s: {a.key: a.value for a in s.attributes}  # noqa: E731
    roots = {attrs_of(s)["hispec.request_id"].string_value: s for s in spans if s.name == "hispec.request"}
    assert all(not r.parent_span_id for r in roots.values())
    children: dict[str, list[str]] = {rid: [] for rid in roots}
    by_id = {r.span_id: rid for rid, r in roots.items()}
    for span in sorted(spans, key=lambda s: s.start_time_unix_nano):
        if span.name == "hispec.request":
            continue
        rid = by_id[span.parent_span_id]  # every child's parent is a request's span
        root = roots[rid]
        assert span.trace_id == root.trace_id
        assert root.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano
        assert span.end_time_unix_nano <= root.end_time_unix_nano
        assert attrs_of(span)["hispec.state"].string_value == span.name
        children[rid].append(span.name)
    assert len({r.trace_id for r in roots.values()}) == len(roots)  # a trace per request
    submitted = sum(1 for r in records if r["event"] == "request.submitted")
    ended = sum(1 for r in roots.values() if any(e.name in TERMINAL_STATES for e in r.events))
    assert sum(map(len, children.values())) + ended == state_changes(records) + submitted
    return children
