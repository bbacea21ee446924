"""Graceful shutdown with requests in flight.

* ``python -m pipeline.cli serve`` in a subprocess gets SIGTERM (SIGINT in the slow variant) while
  streams run: it exits 0, each stream ends as ``--on-exit`` says (an ``aborted`` error event, or
  its whole text), and the JSON log holds every request's terminal state and one access line per
  HTTP request.
* In process, ``HttpServer.shutdown()`` with ``on_exit="finish"`` lets the streams finish.
* Shutdown never waits on a client: a request body held half sent does not delay a SIGTERM exit, and
  a second ``shutdown()`` (a second signal) ends a drain that waits on a request that never ends.
"""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest
from _server_util import (
    HANG_S,
    MODEL_NAME,
    STALL_SEED,
    RunningServer,
    connect,
    request_head,
    sse_data,
    start_cli_server,
    wait_closed,
)

from pipeline.logs import read_json_lines, replay
from statemachines.request import State

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
    # the access log: one line per HTTP request, written once its response ended
    access = [(r["method"], r["path"], r["status"]) for r in records if r.get("event") == "server.access"]
    assert sorted(access) == sorted(
        [("GET", "/health", 200)] + [("POST", "/v1/completions", 200)] * (NUM_STREAMS + 1)
    )


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


def test_a_half_sent_body_does_not_hold_sigterm(tmp_path):
    proc, url = start_cli_server(tmp_path / "serve.jsonl")
    try:
        held = connect(url)
        head = {"Content-Type": "application/json", "Content-Length": "1000"}
        held.sendall(request_head("POST", "/v1/completions", head) + b'{"model": ')  # 10 of 1000 bytes
        # answered after the held request's head reached the server (sent before, on the same loop)
        assert httpx.get(url + "/health", timeout=HANG_S).status_code == 200
        idle = connect(url)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=HANG_S / 2) == 0, proc.stderr.read()  # 5 s at most, in practice
        assert wait_closed(held) == b"" and wait_closed(idle) == b""
        held.close()
        idle.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "memory pools restored" in proc.stdout.read()


def test_a_second_shutdown_ends_a_drain_that_waits_on_a_request(tiny_model):
    running = RunningServer(tiny_model, on_exit="finish", shutdown_timeout=HANG_S * 10)
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 8, "seed": STALL_SEED, "stream": True}
    started = threading.Event()
    events: list[str] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=HANG_S) as response:
                for data in sse_data(response.iter_lines()):
                    events.append(data)
                    started.set()
        except httpx.TransportError:  # the forced shutdown closed the connection
            pass

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    try:
        assert started.wait(timeout=HANG_S)
        running.call(running.server.shutdown)  # finish: the stalled request would be waited on forever
        running.call(running.server.shutdown)  # the second: abort it, close its connection
        running._done.result(timeout=HANG_S)
    finally:
        running.stop()
    client.join(timeout=HANG_S)
    assert not client.is_alive()
    assert "[DONE]" not in events  # cut off, not finished
    assert running.server.pools_restored
    assert running.engine.final_pool_counts == running.engine.initial_pool_counts


@pytest.mark.slow
def test_a_second_sigterm_ends_the_process(tmp_path):
    proc, url = start_cli_server(tmp_path / "serve.jsonl", "finish", extra=["--shutdown-timeout", "600"])
    body = {"model": "tiny", "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
    started = threading.Event()
    ended: list[bool] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=HANG_S) as response:
                for _ in response.iter_lines():
                    started.set()
        except httpx.TransportError:  # cut off: the connection was closed, not left hanging
            pass
        ended.append(True)

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    log_path = tmp_path / "serve.jsonl"
    try:
        assert started.wait(timeout=HANG_S)
        proc.send_signal(signal.SIGTERM)  # finish: the drain waits for the stream
        for _ in range(HANG_S * 20):  # the first signal is handled (two pending signals are one)
            if any(r.get("event") == "server.draining" for r in read_json_lines(log_path)):
                break
            threading.Event().wait(0.05)
        proc.send_signal(signal.SIGTERM)  # the stream is aborted, or the server stopped already
        assert proc.wait(timeout=HANG_S) == 0, proc.stderr.read()
        client.join(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert ended == [True]
    assert "memory pools restored" in proc.stdout.read()
