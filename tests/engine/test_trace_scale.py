"""``hispec trace`` on long logs: idle time drawn narrow, filters, per-state duration percentiles,
Perfetto trace-event JSON and OpenTelemetry spans (OTLP over HTTP, to a collector in the test).

Most tests read a synthetic server log (requests arriving in bursts with idle minutes between, plain
and speculative decoding, chunked prefill, a retraction, an abort and a failure) written with the
same fields ``Request.apply`` logs; one reads a log the tiny model's ``generate`` wrote.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime

import pytest
from otlp_collector import Collector, check_request_spans, state_changes

from pipeline.cli import main as cli
from pipeline.logs import read_json_lines, replay
from pipeline.timeline import (
    LIVE_STATES,
    WHOLE,
    build_rows,
    percentile,
    select,
    state_durations,
    time_axis,
)
from pipeline.trace_export import executor_commands, perfetto_trace
from statemachines.request import TERMINAL

T0 = 1_800_000_000.0  # the synthetic log's first second (since the epoch)


class LogWriter:
    """Records as ``Request.apply`` and the engine write them, at chosen times."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.state: dict[str, str] = {}

    def _stamp(self, t: float) -> str:
        return datetime.fromtimestamp(T0 + t, UTC).isoformat().replace("+00:00", "Z")

    def submit(self, rid: str, t: float) -> None:
        self.state[rid] = "queued"
        self.records.append(
            {"request_id": rid, "state": "queued", "prompt_tokens": 7, "event": "request.submitted",
             "level": "info", "timestamp": self._stamp(t)}
        )

    def apply(self, rid: str, t: float, event: str, state: str, stage: str = "decode", **fields) -> None:
        record = {"request_id": rid, "from_state": self.state[rid], "state": state, **fields, "event": event,
                  "stage": stage, "level": "info", "timestamp": self._stamp(t)}
        self.records.append(record)
        self.state[rid] = state

    def other(self, t: float, event: str) -> None:
        self.records.append({"event": event, "level": "info", "timestamp": self._stamp(t)})

    def write(self, path) -> None:
        path.write_text("".join(json.dumps(r) + "\n" for r in self.records))


def step(device_ms: float, batch: int, hits: int = 10) -> dict:
    return {"batch_size": batch, "step_hits": hits, "step_misses": 1, "step_h2d_bytes": 64,
            "device_ms": device_ms}


def server_log() -> LogWriter:
    """Three bursts of requests with idle stretches of 30 s and 40 s between them.

    Burst 1 (t = 0..0.5): a and b, plain decode in one batch (4 steps each), both finish.
    Burst 2 (t = 30..30.6): c speculative (2 rounds; a chunked prefill first), d aborted while queued.
    Burst 3 (t = 70.6..71.2): e retracted from decode and admitted again, then failed.
    """
    log = LogWriter()
    log.other(-1.0, "server.ready")
    log.submit("a", 0.0)
    log.submit("b", 0.01)
    log.apply("a", 0.02, "Admitted", "prefill", "admission", batch_size=2, queued=0, cached_tokens=0)
    log.apply("b", 0.02, "Admitted", "prefill", "admission", batch_size=2, queued=0, cached_tokens=0)
    log.apply("a", 0.10, "PrefillDone", "staging", "prefill", prefill_tokens=7, **step(70, 2))
    log.apply("b", 0.10, "PrefillDone", "staging", "prefill", prefill_tokens=7, **step(70, 2))
    for rid in "ab":
        log.apply(rid, 0.11, "StagingDone", "ready", "staging")
        log.apply(rid, 0.12, "JoinedBatch", "decode", batch_size=2)
    t = 0.12
    for n in range(4):
        t += 0.05
        for rid in "ab":
            log.apply(rid, t, "StepDone", "decode", **step(40 + n, 2, hits=n))
    log.apply("a", 0.45, "Finished", "finished", reason="length", output_tokens=5)
    log.apply("b", 0.50, "Finished", "finished", reason="stop", output_tokens=5)
    # burst 2
    log.submit("c", 30.0)
    log.submit("d", 30.05)
    log.apply("c", 30.1, "Admitted", "prefill", "admission", batch_size=1, queued=1, cached_tokens=0)
    log.apply("c", 30.2, "ChunkDone", "prefill", "prefill", start=0, end=4, **step(90, 1))
    log.apply("d", 30.25, "AbortRequested", "aborted", "admission", reason="abort")
    log.apply("c", 30.3, "PrefillDone", "staging", "prefill", prefill_tokens=7, **step(95, 1))
    log.apply("c", 30.32, "StagingDone", "ready", "staging")
    log.apply("c", 30.33, "JoinedBatch", "decode", batch_size=1)
    t = 30.33
    for n in range(2):
        log.apply("c", t + 0.02, "DraftStarted", "draft")
        log.apply("c", t + 0.06, "DraftDone", "verify", num_steps=2)
        t += 0.12
        if n == 0:
            log.apply("c", t, "Verified", "decode", accepted=3, **step(55, 1))
    log.apply("c", t, "Finished", "finished", reason="length", output_tokens=7)
    # burst 3 (the idle stretch before it: 30.57 .. 70.6)
    log.submit("e", 70.6)
    log.apply("e", 70.62, "Admitted", "prefill", "admission", batch_size=1, queued=0, cached_tokens=0)
    log.apply("e", 70.70, "PrefillDone", "staging", "prefill", prefill_tokens=7, **step(75, 1))
    log.apply("e", 70.71, "StagingDone", "ready", "staging")
    log.apply("e", 70.72, "JoinedBatch", "decode", batch_size=1)
    log.apply("e", 70.76, "StepDone", "decode", **step(38, 1))
    log.apply("e", 70.80, "Retracted", "queued", reason="memory")
    log.apply("e", 70.90, "Admitted", "prefill", "admission", batch_size=1, queued=0, cached_tokens=0)
    log.apply("e", 71.20, "Crashed", "failed", "prefill", reason="a test fault")
    return log


@pytest.fixture
def log_path(tmp_path):
    path = tmp_path / "server.jsonl"
    server_log().write(path)
    return path


def test_the_synthetic_log_replays():
    final = replay(server_log().records)
    assert {k: v.value for k, v in final.items()} == {
        "a": "finished", "b": "finished", "c": "finished", "d": "aborted", "e": "failed"
    }


def test_a_stretch_in_one_state_is_one_band():
    rows = {r.request_id: r for r in build_rows(server_log().records)}
    a = rows["a"]
    assert [b.state for b in a.bands] == ["queued", "prefill", "staging", "ready", "decode"]
    assert a.bands[-1].events == 5 and a.bands[-1].entered_by == "JoinedBatch"  # joined + 4 steps
    assert a.bands[0].entered_by == "request.submitted" and a.bands[0].events == 0
    assert [b.state for b in rows["c"].bands] == [
        "queued", "prefill", "staging", "ready", "decode", "draft", "verify", "decode", "draft", "verify"
    ]
    assert rows["c"].bands[1].events == 2  # the chunk and the rest of the prompt
    assert [b.state for b in rows["e"].bands] == ["queued", "prefill", "staging", "ready", "decode",
                                                  "queued", "prefill"]
    assert (rows["d"].final, rows["d"].reason) == ("aborted", "abort")
    for row in rows.values():
        assert all(x.end == y.start for x, y in zip(row.bands, row.bands[1:]))  # no gap, no overlap
        assert row.end == pytest.approx(row.bands[-1].end)


def test_idle_stretches_are_drawn_narrow_and_busy_time_to_scale():
    rows = build_rows(server_log().records)
    axis = time_axis(rows, idle_gap=1.0)
    idle = axis.idle
    assert len(idle) == 2
    assert idle[0].start == pytest.approx(T0 + 0.5) and idle[0].end == pytest.approx(T0 + 30.0)
    assert idle[1].start == pytest.approx(T0 + 30.57) and idle[1].end == pytest.approx(T0 + 70.6)
    busy = 0.5 + 0.57 + 0.6
    assert axis.span < busy * 1.1  # 71.2 s of log over 1.7 s of busy time
    assert all(seg.width < 0.05 * busy for seg in idle)
    for row in rows:  # every band keeps its length on the axis, and the axis keeps the order
        for band in row.bands:
            assert axis(band.end) - axis(band.start) == pytest.approx(band.end - band.start)
    times = sorted({b.start for r in rows for b in r.bands} | {r.end for r in rows if r.end})
    drawn = [axis(t) for t in times]
    assert drawn == sorted(drawn) and len(set(drawn)) == len(drawn)
    # ticks fall in busy time only, labelled in real seconds since the first event
    ticks = axis.ticks(0, axis.span)
    assert ticks and all(axis.real(x) is not None for x, _ in ticks)
    assert any(label.startswith("71.") for _, label in ticks)
    # no narrowing: the axis is real time; a threshold above every gap: none narrowed either
    assert time_axis(rows, None).span == pytest.approx(71.2)
    assert time_axis(rows, idle_gap=100).idle == []


def test_filters_by_request_and_state():
    rows = build_rows(server_log().records)
    assert [r.request_id for r in select(rows, request_ids=["a", "e"])] == ["a", "e"]
    assert [r.request_id for r in select(rows, request_ids=["[b-d]"])] == ["b", "c", "d"]
    assert [r.request_id for r in select(rows, states=["verify"])] == ["c"]
    assert [r.request_id for r in select(rows, states=["aborted", "failed"])] == ["d", "e"]
    assert [r.request_id for r in select(rows, request_ids=["a", "c"], states=["draft"])] == ["c"]
    assert select(rows, request_ids=["zzz"]) == []


def test_per_state_duration_percentiles():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    stats = {s.state: s for s in state_durations(build_rows(server_log().records))}
    assert list(stats) == [*LIVE_STATES, WHOLE]
    queued = stats["queued"]  # a 0.02, b 0.01, c 0.1, d 0.2, e 0.02 and again 0.1 after its retraction
    assert (queued.stretches, queued.requests) == (6, 5)
    assert queued.percentiles[0] == pytest.approx(0.06)
    assert queued.max == pytest.approx(0.2) and queued.total == pytest.approx(0.45)
    assert stats["draft"].stretches == 2 and stats["draft"].percentiles[0] == pytest.approx(0.04, abs=1e-5)
    assert stats[WHOLE].requests == 5 and stats[WHOLE].max == pytest.approx(0.6)


def test_cli_on_a_long_log_without_matplotlib(log_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert cli(["trace", str(log_path)]) == 0
    out, err = capsys.readouterr()
    assert "matplotlib is not installed" in err and not log_path.with_suffix(".png").exists()
    assert out.splitlines()[0].split()[:3] == ["state", "stretches", "requests"]
    assert any(line.split()[:3] == ["queued", "6", "5"] for line in out.splitlines())
    page = log_path.with_suffix(".html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "2 idle stretches" in page and 'class="idle"' in page
    assert "Time in each state" in page and "<td>verify</td>" in page and 'id="axis-segments"' in page
    segments = json.loads(page.split('id="axis-segments">')[1].split("</script>")[0])
    assert [s[4] for s in segments] == [False, True, False, True, False]

    html = tmp_path / "some.html"
    assert cli(["trace", str(log_path), "--state", "aborted", "--request", "a", "--request", "d",
                "--out-html", str(html)]) == 0
    page = html.read_text()
    assert "1 of 5 requests" in page and ">d</text>" in page and ">a</text>" not in page
    assert cli(["trace", str(log_path), "--keep-idle", "--out-html", str(html)]) == 0
    assert 'class="idle"' not in html.read_text()
    assert cli(["trace", str(log_path), "--request", "nobody"]) == 1
    assert "matches the filters" in capsys.readouterr().out


def test_the_png_draws_the_narrowed_axis(log_path, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    assert cli(["trace", str(log_path), "--out-png", str(png), "--out-html", str(tmp_path / "t.html")]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- Perfetto ---------------------------------------------------------------------------------------------

PHASES = {"X", "B", "E", "i", "I", "M", "C"}
METADATA = {"process_name", "process_sort_index", "thread_name", "thread_sort_index", "process_labels"}


def check_trace_events(doc: dict) -> list[dict]:
    """The Chrome trace-event format's rules for the JSON object format (what Perfetto's JSON importer
    and chrome://tracing read): returns the complete slices."""
    assert set(doc) >= {"traceEvents"} and doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    named_processes, named_threads, slices, open_begins = set(), set(), [], {}
    for e in doc["traceEvents"]:
        assert e["ph"] in PHASES, e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str), e
        if e["ph"] == "M":
            assert e["name"] in METADATA and isinstance(e["args"], dict), e
            if e["name"] == "process_name":
                named_processes.add(e["pid"])
            if e["name"] == "thread_name":
                assert isinstance(e["args"]["name"], str) and e["args"]["name"]
                named_threads.add((e["pid"], e["tid"]))
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        assert isinstance(e.get("args", {}), dict)
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
            slices.append(e)
        elif e["ph"] == "i":
            assert e.get("s", "t") in ("g", "p", "t"), e
        elif e["ph"] == "B":
            open_begins.setdefault((e["pid"], e["tid"]), []).append(e)
        elif e["ph"] == "E":
            assert open_begins[(e["pid"], e["tid"])].pop()["ts"] <= e["ts"]
        if e["ph"] != "C":
            assert e["pid"] in named_processes and (e["pid"], e["tid"]) in named_threads, e
    assert not any(open_begins.values()), "a B event without its E"
    tracks: dict[tuple[int, int], list[dict]] = {}
    for s in slices:
        tracks.setdefault((s["pid"], s["tid"]), []).append(s)
    for track in tracks.values():  # slices on one track nest or follow each other, never cross
        track.sort(key=lambda s: (s["ts"], -s["dur"]))
        stack: list[float] = []
        for s in track:
            while stack and s["ts"] >= stack[-1] - 1e-3:
                stack.pop()
            assert not stack or s["ts"] + s["dur"] <= stack[-1] + 1e-3, f"crossing slices: {s}"
            stack.append(s["ts"] + s["dur"])
    return slices


def test_perfetto_json_has_a_track_per_request_and_a_slice_per_state_change(log_path, tmp_path, capsys):
    out = tmp_path / "server.perfetto.json"
    assert cli(["trace", str(log_path), "--perfetto", str(out), "--out-html", str(tmp_path / "t.html")]) == 0
    doc = json.loads(out.read_text())
    slices = check_trace_events(doc)
    records = read_json_lines(log_path)
    lifecycle = [s for s in slices if s["cat"] == "lifecycle"]
    ended = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    submitted = sum(1 for r in records if r["event"] == "request.submitted")
    # a slice per state entered (the wait after submission included), an instant where a request ended
    assert len(lifecycle) + len(ended) == state_changes(records) + submitted
    assert sorted(e["name"] for e in ended) == ["aborted", "failed", "finished", "finished", "finished"]
    threads = {e["args"]["name"]: e["tid"] for e in doc["traceEvents"] if e["name"] == "thread_name"
               and e["pid"] == 1}
    assert sorted(threads) == ["a", "b", "c", "d", "e"]
    c = [s["name"] for s in lifecycle if s["tid"] == threads["c"]]
    assert c == ["queued", "prefill", "staging", "ready", "decode", "draft", "verify", "decode", "draft",
                 "verify"]
    assert lifecycle[0]["ts"] == 0  # microseconds since the first event
    decode_a = next(s for s in lifecycle if s["tid"] == threads["a"] and s["name"] == "decode")
    assert decode_a["dur"] == pytest.approx(0.33e6) and decode_a["args"]["events"] == 5
    executor = [s for s in slices if s["cat"] == "executor"]
    assert {s["pid"] for s in executor} == {2} and len({s["tid"] for s in executor}) == 1
    # 1 prefill + 4 steps (a, b); a chunk, the prompt's end, a verify (c); a prefill, a step (e)
    assert [s["name"] for s in executor] == ["prefill", *["decode"] * 4, "prefill", "prefill", "verify",
                                             "prefill", "decode"]
    first = executor[0]
    assert first["dur"] == pytest.approx(70e3) and first["ts"] == pytest.approx(0.03e6)
    assert first["args"]["requests"] == "a, b" and first["args"]["batch_size"] == 2

    filtered = tmp_path / "c.json"
    assert cli(["trace", str(log_path), "--request", "c", "--perfetto", str(filtered),
                "--out-html", str(tmp_path / "t.html")]) == 0
    slices = check_trace_events(json.loads(filtered.read_text()))
    assert [s["name"] for s in slices if s["cat"] == "executor"] == ["prefill", "prefill", "verify"]


def test_executor_commands_of_a_mixed_step_are_one_slice():
    log = LogWriter()
    for rid in "ab":
        log.submit(rid, 0.0)
    log.apply("a", 0.01, "Admitted", "prefill", "admission", batch_size=1, queued=1, cached_tokens=0)
    log.apply("a", 0.10, "PrefillDone", "staging", "prefill", prefill_tokens=7, **step(80, 1))
    log.apply("a", 0.11, "StagingDone", "ready", "staging")
    log.apply("a", 0.12, "JoinedBatch", "decode", batch_size=1)
    log.apply("b", 0.13, "Admitted", "prefill", "admission", batch_size=1, queued=0, cached_tokens=0)
    # one forward: a's decode step and b's prompt, both reported with the forward's wall time
    log.apply("a", 0.200, "StepDone", "decode", **step(60, 1, hits=3))
    log.apply("b", 0.201, "PrefillDone", "staging", "prefill", prefill_tokens=7, **step(60, 1, hits=0))
    log.apply("a", 0.25, "StepDone", "decode", **step(40, 1, hits=4))
    commands = executor_commands(log.records)
    assert [c.kind for c in commands] == ["prefill", "prefill+decode", "decode"]
    mixed = commands[1]
    assert mixed.request_ids == ("a", "b") and mixed.batch_size == 2
    assert mixed.end - mixed.start == pytest.approx(0.061, abs=1e-5)
    assert commands[2].start == pytest.approx(mixed.end)  # a later estimate never crosses it
    check_trace_events(perfetto_trace(build_rows(log.records), commands))


def test_perfetto_json_of_a_generate_log(tiny_model, tmp_path, capsys):
    from pipeline.generate import main as generate

    log = tmp_path / "run.jsonl"
    argv = ["abc", "hello", "--max-new-tokens", "5", "--dtype", "float64", "--log-json", str(log)]
    assert generate(argv, model=tiny_model) == 0
    out = tmp_path / "run.json"
    assert cli(["trace", str(log), "--perfetto", str(out)]) == 0
    records = read_json_lines(log)
    slices = check_trace_events(json.loads(out.read_text()))
    lifecycle = [s for s in slices if s["cat"] == "lifecycle"]
    submitted = sum(1 for r in records if r["event"] == "request.submitted")
    final = replay(records)
    assert len(final) == 2 and all(s in TERMINAL for s in final.values())
    assert len(lifecycle) + len(final) == state_changes(records) + submitted
    assert any(s["cat"] == "executor" for s in slices)


# --- OpenTelemetry ---------------------------------------------------------------------------------------


@pytest.fixture
def collector(monkeypatch):
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    c = Collector()
    yield c
    c.close()


def test_otlp_spans_arrive_with_their_parents(collector, log_path, tmp_path, capsys):
    assert cli(["trace", str(log_path), "--otlp-traces-endpoint", collector.url,
                "--out-html", str(tmp_path / "t.html")]) == 0
    assert "sent 33 spans of 5 requests" in capsys.readouterr().out
    assert collector.paths and set(collector.paths) == {"/v1/traces"}
    assert collector.resources[0]["service.name"] == "hispec"
    children = check_request_spans(collector.spans, read_json_lines(log_path))
    assert children["c"] == ["queued", "prefill", "staging", "ready", "decode", "draft", "verify", "decode",
                             "draft", "verify"]
    e = next(s for s in collector.spans if s.name == "hispec.request"
             and any(a.key == "hispec.request_id" and a.value.string_value == "e" for a in s.attributes))
    assert e.status.code == 2 and e.status.message == "a test fault"  # STATUS_CODE_ERROR
    assert [ev.name for ev in e.events] == ["failed"]
    assert abs(e.end_time_unix_nano - round((T0 + 71.2) * 1e9)) < 10_000  # the log's microseconds


def test_live_spans_from_the_logging_chain(collector, log_path):
    """What ``hispec serve --otlp-traces-endpoint`` installs: a structlog processor that sends a
    request's spans when its lifecycle ends (here fed the synthetic log's events as they are logged)."""
    import io

    import structlog

    from pipeline.logs import configure_logging
    from pipeline.trace_export import LiveSpans

    live = LiveSpans(collector.url, drop_below="warning")
    stream = io.StringIO()
    configure_logging(json=True, level="info", stream=stream, processors=[live])
    logger = structlog.get_logger("hispec.lifecycle")
    records = read_json_lines(log_path)
    try:
        for record in records:
            fields = {k: v for k, v in record.items() if k not in ("event", "level", "timestamp")}
            logger.info(record["event"], **fields)
        logger.warning("server.something", detail=1)
        assert live.flush()
    finally:
        live.close()
    assert stream.getvalue().count("\n") == 1 and "server.something" in stream.getvalue()
    assert live.sent == len(collector.spans) == 33
    children = check_request_spans(collector.spans, records)
    assert children["a"] == ["queued", "prefill", "staging", "ready", "decode"]


def test_otlp_without_the_extra_is_one_line(log_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk", None)
    html = tmp_path / "t.html"
    assert cli(["trace", str(log_path), "--otlp-traces-endpoint", "http://127.0.0.1:9/v1/traces",
                "--out-html", str(html)]) == 2
    err = capsys.readouterr().err
    assert "`otel` extra is not installed" in err and html.exists()


@pytest.mark.asyncio
async def test_live_spans_of_an_engine_run_match_its_log(tiny_model, collector, tmp_path):
    """Speculative decoding with an abort, logged to a file while ``LiveSpans`` sends the spans: the
    spans agree with the log, and the log's Perfetto JSON is well formed."""
    from _engine_util import config, make_prompts

    from pipeline import Engine, SamplingParams
    from pipeline.logs import configure_logging
    from pipeline.trace_export import LiveSpans, write_perfetto

    path = tmp_path / "run.jsonl"
    live = LiveSpans(collector.url)
    sink = configure_logging(json=path, level="info", processors=[live])
    try:
        async with Engine(config(num_steps=2), model=tiny_model) as engine:
            ids = []
            for i, prompt in enumerate(make_prompts([9, 40, 17], seed=3)):
                rid = f"r{i}"
                ids.append(rid)
                async for delta in engine.generate(prompt, SamplingParams(max_new_tokens=12), request_id=rid):
                    if i == 1 and not delta.finished:
                        engine.abort(rid)
        assert live.flush()
    finally:
        sink.close()
        live.close()
    records = read_json_lines(path)
    assert {r["event"] for r in records} >= {"DraftStarted", "Verified", "AbortRequested"}
    children = check_request_spans(collector.spans, records)
    assert sorted(children) == ids and live.sent == len(collector.spans)
    rows = build_rows(records)
    assert [b.state for b in rows[0].bands] == children["r0"]
    slices = check_trace_events(write_perfetto(tmp_path / "run.json", rows, records))
    assert {s["name"] for s in slices if s["cat"] == "executor"} >= {"prefill", "verify"}


def test_spans_the_collector_refuses_are_an_error(collector, log_path, tmp_path, capsys):
    refusing = Collector(status=400)
    try:
        assert cli(["trace", str(log_path), "--otlp-traces-endpoint", refusing.url,
                    "--out-html", str(tmp_path / "t.html")]) == 1
    finally:
        refusing.close()
    assert "did not take the spans" in capsys.readouterr().err
    assert cli(["trace", str(log_path), "--otlp-traces-endpoint", "localhost:4318",
                "--out-html", str(tmp_path / "t.html")]) == 2
    assert "not an http(s) URL" in capsys.readouterr().err


# --- dynamic residency: demotions and promotions ------------------------------------------------------


def residency_log() -> LogWriter:
    """f is demoted while READY, promoted in decode, demoted again and finishes; g is never moved; h is
    demoted in decode and still live when the log ends."""
    log = LogWriter()
    for rid, t in (("f", 0.0), ("g", 0.0), ("h", 0.01)):
        log.submit(rid, t)
    for rid in "fgh":
        log.apply(rid, 0.02, "Admitted", "prefill", "admission", batch_size=3, queued=0, cached_tokens=0)
    for rid in "fgh":
        log.apply(rid, 0.10, "PrefillDone", "staging", "prefill", prefill_tokens=7, **step(70, 3))
        log.apply(rid, 0.11, "StagingDone", "ready", "staging")
    log.apply("f", 0.115, "Demoted", "ready", "admission", freed_bytes=4096)
    for rid in "fgh":
        log.apply(rid, 0.12, "JoinedBatch", "decode", batch_size=3)
    log.apply("f", 0.17, "StepDone", "decode", **step(40, 3))
    log.apply("g", 0.17, "StepDone", "decode", **step(40, 3))
    log.apply("h", 0.17, "StepDone", "decode", **step(40, 3))
    log.apply("f", 0.18, "Promoted", "decode", copied_bytes=8192)
    log.apply("h", 0.19, "Demoted", "decode", freed_bytes=2048)
    log.apply("f", 0.22, "StepDone", "decode", **step(40, 3))
    log.apply("g", 0.22, "StepDone", "decode", **step(40, 3))
    log.apply("f", 0.23, "Demoted", "decode", freed_bytes=6144)
    log.apply("g", 0.25, "Finished", "finished", reason="length", output_tokens=3)
    log.apply("f", 0.30, "Finished", "finished", reason="stop", output_tokens=3)
    log.apply("h", 0.31, "StepDone", "decode", **step(40, 1))
    return log


def test_demotions_and_promotions_replay_and_keep_the_stretch():
    records = residency_log().records
    final = {k: v.value for k, v in replay(records).items()}
    assert final == {"f": "finished", "g": "finished", "h": "decode"}
    rows = {r.request_id: r for r in build_rows(records)}
    f = rows["f"]
    assert [b.state for b in f.bands] == ["queued", "prefill", "staging", "ready", "decode"]
    ready, decode = f.bands[3], f.bands[4]
    assert ready.events == 2 and ready.end == pytest.approx(T0 + 0.12)  # staged, then demoted
    assert decode.events == 5 and decode.entered_by == "JoinedBatch"  # joined, 2 steps, 2 moves
    assert [(m.kind, m.state, m.num_bytes, m.bytes_field) for m in f.marks] == [
        ("demoted", "ready", 4096, "freed_bytes"),
        ("promoted", "decode", 8192, "copied_bytes"),
        ("demoted", "decode", 6144, "freed_bytes"),
    ]
    assert [m.at - T0 for m in f.marks] == pytest.approx([0.115, 0.18, 0.23])
    assert (f.count("demoted"), f.count("promoted")) == (2, 1)
    assert rows["g"].marks == ()
    h = rows["h"]  # live at the end of the log: the mark is kept though its stretch has no end yet
    assert [(m.kind, m.state) for m in h.marks] == [("demoted", "decode")] and h.end is None
    # the state filter still sees every state a moved request went through; the mark filter finds them
    ids = lambda kept: [r.request_id for r in kept]  # noqa: E731
    assert ids(select(rows.values(), states=["ready"])) == ["f", "g", "h"]
    assert ids(select(rows.values(), states=["finished"])) == ["f", "g"]
    assert ids(select(rows.values(), marks=["demoted"])) == ["f", "h"]
    assert ids(select(rows.values(), marks=["promoted"])) == ["f"]
    assert ids(select(rows.values(), states=["finished"], marks=["demoted"])) == ["f"]
    stats = {s.state: s for s in state_durations(list(rows.values()))}
    assert stats["ready"].stretches == stats["decode"].stretches == 3  # a move starts no stretch
    # generate's one-line trace: a move is no new entry either
    from pipeline.generate import compact_trace
    from pipeline.logs import by_request

    line = compact_trace(by_request(records)["f"], T0)
    assert "> ready +0.110s > decode +0.120s (3 steps) > finished" in line


def test_the_timeline_draws_a_marker_per_move(tmp_path, capsys, monkeypatch):
    path = tmp_path / "residency.jsonl"
    residency_log().write(path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "demoted: 3 times, 2 requests, 12288 bytes freed on the device" in out
    assert "promoted: 1 time, 1 request, 8192 bytes copied host -> device" in out
    page = path.with_suffix(".html").read_text()
    marks = page.count('<text class="mark"')
    assert marks == 4 and page.count("\u25bc<title>") == 3 and page.count("\u25b2<title>") == 1
    assert "f: promoted in decode at 0.1800s (copied_bytes 8192)" in page
    assert "f: demoted in ready at 0.1150s (freed_bytes 4096)" in page
    assert "<th>demoted</th><th>promoted</th>" in page
    html = tmp_path / "promoted.html"
    assert cli(["trace", str(path), "--mark", "promoted", "--out-html", str(html)]) == 0
    page = html.read_text()
    assert "1 of 3 requests" in page and "--mark promoted" in page and ">f</text>" in page
    assert ">h</text>" not in page
    assert cli(["trace", str(path), "--state", "finished", "--mark", "demoted", "--out-html", str(html)]) == 0
    assert "1 of 3 requests" in html.read_text()
    # a log without moves: no marker, no column, no summary
    plain = tmp_path / "plain.jsonl"
    server_log().write(plain)
    capsys.readouterr()
    assert cli(["trace", str(plain)]) == 0
    assert "demoted" not in capsys.readouterr().out
    page = plain.with_suffix(".html").read_text()
    assert 'class="mark"' not in page and "<th>demoted</th>" not in page


def test_the_png_draws_the_moves(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "residency.jsonl"
    residency_log().write(path)
    png = tmp_path / "t.png"
    assert cli(["trace", str(path), "--out-png", str(png), "--out-html", str(tmp_path / "t.html")]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_perfetto_instant_events_on_the_request_track(tmp_path):
    records = residency_log().records
    doc = perfetto_trace(build_rows(records), executor_commands(records))
    slices = check_trace_events(doc)
    threads = {e["args"]["name"]: e["tid"] for e in doc["traceEvents"] if e["name"] == "thread_name"
               and e["pid"] == 1}
    moves = [e for e in doc["traceEvents"] if e.get("cat") == "residency"]
    assert [(e["name"], e["tid"], e["args"]) for e in moves] == [
        ("demoted", threads["f"], {"request_id": "f", "state": "ready", "freed_bytes": 4096}),
        ("promoted", threads["f"], {"request_id": "f", "state": "decode", "copied_bytes": 8192}),
        ("demoted", threads["f"], {"request_id": "f", "state": "decode", "freed_bytes": 6144}),
        ("demoted", threads["h"], {"request_id": "h", "state": "decode", "freed_bytes": 2048}),
    ]
    assert all(e["ph"] == "i" and e["s"] == "t" and e["pid"] == 1 for e in moves)
    # microseconds since the first event (the first submission, at T0)
    assert [e["ts"] for e in moves] == pytest.approx([0.115e6, 0.18e6, 0.23e6, 0.19e6])
    lifecycle = [s for s in slices if s["cat"] == "lifecycle"]
    ended = [e for e in doc["traceEvents"] if e["ph"] == "i" and e["cat"] == "lifecycle"]
    submitted = sum(1 for r in records if r["event"] == "request.submitted")
    # the moves are no state change: a slice per state entered, as without them
    assert len(lifecycle) + len(ended) == state_changes(records) + submitted
    f_decode = next(s for s in lifecycle if s["tid"] == threads["f"] and s["name"] == "decode")
    assert f_decode["args"]["events"] == 5 and f_decode["dur"] == pytest.approx(0.18e6)


def test_otlp_span_events_on_the_request_span(collector, tmp_path, capsys):
    path = tmp_path / "residency.jsonl"
    residency_log().write(path)
    assert cli(["trace", str(path), "--otlp-traces-endpoint", collector.url,
                "--out-html", str(tmp_path / "t.html")]) == 0
    records = read_json_lines(path)
    children = check_request_spans(collector.spans, records)
    assert children["f"] == ["queued", "prefill", "staging", "ready", "decode"]
    roots = {
        next(a.value.string_value for a in s.attributes if a.key == "hispec.request_id"): s
        for s in collector.spans if s.name == "hispec.request"
    }

    def events(rid: str) -> list[tuple]:
        return [
            (ev.name, {a.key: (a.value.string_value or a.value.int_value) for a in ev.attributes},
             ev.time_unix_nano)
            for ev in roots[rid].events
        ]

    f = events("f")
    assert [(name, attributes) for name, attributes, _ in f] == [
        ("demoted", {"hispec.state": "ready", "hispec.freed_bytes": 4096}),
        ("promoted", {"hispec.state": "decode", "hispec.copied_bytes": 8192}),
        ("demoted", {"hispec.state": "decode", "hispec.freed_bytes": 6144}),
        ("finished", {"hispec.finish_reason": "stop"}),
    ]
    assert abs(f[1][2] - round((T0 + 0.18) * 1e9)) < 10_000
    assert [name for name, _, _ in events("g")] == ["finished"]
    assert [name for name, _, _ in events("h")] == ["demoted"]  # live: no end event
