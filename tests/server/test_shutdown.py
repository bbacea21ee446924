"""Graceful shutdown with requests in flight.

* ``python -m pipeline.cli serve`` in a subprocess gets SIGTERM (SIGINT in the slow variant) while
  streams run: it exits 0, each stream ends as ``--on-exit`` says (an ``aborted`` error event, or
  its whole text), and the JSON log holds every request's terminal state.
* In process, ``HttpServer.shutdown()`` with ``on_exit="finish"`` lets the streams finish.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from _server_util import MODEL_NAME, RunningServer, sse_data

from pipeline.logs import read_json_lines, replay
from statemachines.request import State

ROOT = Path(__file__).resolve().parents[2]
NUM_STREAMS = 4


class Streams:
    """``NUM_STREAMS`` streaming completions in threads; ``started`` once each has its first chunk."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        self.events: dict[int, list[str]] = {}
        self.started = threading.Barrier(NUM_STREAMS + 1)
        self.body = {
            "model": model,
            "prompt": "def main():",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        self.url = url
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(NUM_STREAMS)
        ]
        for thread in self.threads:
            thread.start()
        self.started.wait(timeout=120)  # a hang guard, not a timing assertion

    def _run(self, i: int) -> None:
        events = self.events.setdefault(i, [])
        with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as response:
            for data in sse_data(response.iter_lines()):
                events.append(data)
                if len(events) == 1:
                    self.started.wait(timeout=120)

    def join(self) -> dict[int, list[str]]:
        for thread in self.threads:
            thread.join(timeout=120)
        return self.events


def start_cli_server(log_path: Path, on_exit: str) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "serve",
        "--port",
        "0",
        "--log-json",
        str(log_path),
        "--on-exit",
        on_exit,
        "--max-context-len",
        "512",
        "--max-running-requests",
        "8",
        "--threads",
        "1",
    ]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    guard = threading.Timer(
        300, proc.kill
    )  # a hang guard: a stuck server fails the test instead of hanging it
    guard.daemon = True
    guard.start()
    for line in proc.stdout:
        if "listening on" in line:
            return proc, line.split("listening on ")[1].split()[0]
    raise AssertionError(f"the server did not start: {proc.wait()} {proc.stderr.read()}")


@pytest.mark.parametrize(
    ("signum", "on_exit"),
    [(signal.SIGTERM, "abort"), pytest.param(signal.SIGINT, "finish", marks=pytest.mark.slow)],
    ids=["sigterm-abort", "sigint-finish"],
)
def test_signal_with_requests_in_flight(tmp_path, signum, on_exit):
    log_path = tmp_path / "serve.jsonl"
    proc, url = start_cli_server(log_path, on_exit)
    try:
        assert httpx.get(url + "/health").json() == {"status": "ready"}
        done = httpx.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3}, timeout=60
        )
        assert done.status_code == 200
        streams = Streams(url, "tiny", max_tokens=300 if on_exit == "abort" else 40)
        proc.send_signal(signum)
        events = streams.join()
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "memory pools restored" in proc.stdout.read()
    for stream in events.values():
        assert stream[-1] == "[DONE]"
        last = json.loads(stream[-2])
        if on_exit == "abort":
            assert last["error"]["code"] == "aborted"
        else:
            assert last["choices"][0]["finish_reason"] == "length"
            assert "".join(json.loads(e)["choices"][0]["text"] for e in stream[:-1])
    # the log: every request reaches a terminal state, and the server logged how each one ended
    records = read_json_lines(log_path)
    final = replay(records)
    ended = {r["request_id"]: r for r in records if r.get("event") == "server.request_ended"}
    assert len(final) == NUM_STREAMS + 1 and set(ended) == set(final)
    expected = State.ABORTED if on_exit == "abort" else State.FINISHED
    assert sorted(s.value for s in final.values()) == sorted(["finished"] + [expected.value] * NUM_STREAMS)
    assert sorted(r["outcome"] for r in ended.values()) == sorted(
        ["finished"] + [expected.value] * NUM_STREAMS
    )
    stopped = [r for r in records if r.get("event") == "server.stopped"]
    assert len(stopped) == 1 and stopped[0]["pools_restored"] is True


def test_shutdown_lets_streams_finish_with_on_exit_finish(tiny_model):
    running = RunningServer(tiny_model, on_exit="finish")
    try:
        streams = Streams(running.url, MODEL_NAME, max_tokens=30)
        running.call(running.server.shutdown)
        events = streams.join()
        assert running.server.state.draining
    finally:
        running.stop()
    for stream in events.values():
        assert stream[-1] == "[DONE]"
        assert json.loads(stream[-2])["choices"][0]["finish_reason"] == "length"
    assert running.server.pools_restored
    assert running.engine.final_pool_counts == running.engine.initial_pool_counts
