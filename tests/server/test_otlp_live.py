"""``hispec serve --otlp-traces-endpoint``: each request's lifecycle reaches an OTLP/HTTP collector
(in the test) as a span with one child span per state, agreeing with the server's own JSON log."""

from __future__ import annotations

import signal

import httpx
import pytest
from _server_util import HANG_S, start_cli_server
from otlp_collector import Collector, check_request_spans

from pipeline.logs import read_json_lines


@pytest.fixture
def collector(monkeypatch):
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    c = Collector()
    yield c
    c.close()


@pytest.mark.slow  # a server subprocess; the live exporter itself runs in CI in test_trace_scale.py
def test_serve_sends_each_request_as_spans(collector, tmp_path):
    log = tmp_path / "serve.jsonl"
    proc, url = start_cli_server(log, extra=["--otlp-traces-endpoint", collector.url],
                                 env={"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"})
    try:
        with httpx.Client(base_url=url, timeout=HANG_S) as client:
            for prompt in ("def f(x):", "hello"):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "n": 2}
                assert client.post("/v1/completions", json=body).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=HANG_S) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    records = read_json_lines(log)
    ids = {r["request_id"] for r in records if r.get("event") == "request.submitted"}
    assert len(ids) == 4  # two choices each
    children = check_request_spans(collector.spans, records)  # sent as they ended, or at the exit
    assert set(children) == ids
    assert all(states[:2] == ["queued", "prefill"] and "decode" in states for states in children.values())
