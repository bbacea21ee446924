"""What a client cannot hold: connections, idle time, header and body sizes.

* ``--max-connections``: a connection past the limit gets a 503 and is closed at once;
* ``--timeout-keep-alive``: a connection that sends nothing, or whose request headers are not all in
  by then (however slowly they trickle), is closed; so is a kept-alive connection left idle;
* request headers over their limit are a 431, a body over ``--max-request-bytes`` a 413, answered
  without reading the rest;
* running out of file descriptors (``accept`` failing with EMFILE) writes one warning, not a
  traceback per try, and the server serves again once descriptors are free.

Every wait here is for an event (a response, the server closing a connection); the time limits are
hang guards only.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading

import httpx
import pytest
from _server_util import (
    HANG_S,
    MODEL_NAME,
    RunningServer,
    connect,
    read_response,
    request_head,
    start_cli_server,
    wait_closed,
)

from pipeline.server.connections import MAX_HEADER_BYTES, default_max_connections

MAX_CONNECTIONS = 8
MAX_BODY = 4096


def health_when_served(url: str) -> int:
    """Ask ``/health`` until the server takes the connection (it may still be counting connections
    the client has just closed, and refuse this one); the status it answered."""
    for _ in range(HANG_S * 20):
        try:
            response = httpx.get(url + "/health", timeout=HANG_S)
        except httpx.TransportError:  # refused: closed before the request was read
            response = None
        if response is not None and "too_many_connections" not in response.text:
            return response.status_code
        threading.Event().wait(0.05)
    raise AssertionError("the server stayed full")


def assert_refused(data: bytes) -> None:
    """A connection past the limit: a 503 with OpenAI's error body, or closed before it could be sent."""
    if not data:
        return
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), data
    assert json.loads(body)["error"]["code"] == "too_many_connections"


def test_a_connection_past_the_limit_gets_a_503(tiny_model):
    running = RunningServer(tiny_model, max_connections=MAX_CONNECTIONS, timeout_keep_alive=HANG_S * 10)
    try:
        idle = [connect(running.url) for _ in range(MAX_CONNECTIONS)]
        extra = connect(running.url)
        status, headers, body = read_response(extra)
        assert status == 503 and headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "too_many_connections"
        assert wait_closed(extra) == b""
        # the connections held are untouched: one of them is served
        idle[0].sendall(request_head("GET", "/health", {}))
        assert read_response(idle[0])[0] == 200
        for sock in [*idle, extra]:
            sock.close()
        assert health_when_served(running.url) == 200
    finally:
        running.stop()


def trickle_until_closed(sock: socket.socket) -> None:
    """Send a request head one byte at a time, never ending it, until the server closes the
    connection (a hang guard bounds the wait)."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    for _ in range(HANG_S * 10):
        readable, _, _ = select.select([sock], [], [], 0.1)
        if readable:
            assert wait_closed(sock) == b""
            return
        try:
            sock.sendall(b"a")
        except (BrokenPipeError, ConnectionResetError):
            return
    raise AssertionError("a request head trickling in held its connection open")


def test_idle_and_slow_connections_are_closed(tiny_model):
    running = RunningServer(tiny_model, max_connections=MAX_CONNECTIONS, timeout_keep_alive=1)
    try:
        silent = connect(running.url)  # sends nothing at all
        partial = connect(running.url)  # half a request head, then nothing
        partial.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        kept = connect(running.url)  # one request, then idle on a kept-alive connection
        kept.sendall(request_head("GET", "/health", {}))
        assert read_response(kept)[0] == 200
        trickle = connect(running.url)  # a request head sent one byte at a time
        flood = [connect(running.url) for _ in range(2 * MAX_CONNECTIONS)]
        trickle_until_closed(trickle)
        for sock in (silent, partial, kept):
            assert wait_closed(sock) == b""
        for sock in flood:
            assert_refused(wait_closed(sock))  # idle under the limit (closed), or past it (a 503)
        for sock in [silent, partial, kept, trickle, *flood]:
            sock.close()
        # every connection above was closed by the server: nothing is left to count against the limit
        response = httpx.get(running.url + "/health", timeout=HANG_S)
        assert response.status_code == 200
    finally:
        running.stop()


@pytest.fixture(scope="module")
def limited(tiny_model):
    running = RunningServer(tiny_model, max_request_bytes=MAX_BODY)
    yield running
    running.stop()
    assert running.server.pools_restored


def test_request_headers_over_the_limit_are_a_431(limited):
    for end in (b"\r\n\r\n", b""):  # headers that end, and headers that never end
        sock = connect(limited.url)
        big = b"a" * 2 * MAX_HEADER_BYTES
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + big + end)
        status, headers, body = read_response(sock)
        assert status == 431 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
        wait_closed(sock)
        sock.close()
    assert limited.client.get("/health").status_code == 200


def assert_too_large(sock: socket.socket) -> None:
    status, headers, body = read_response(sock)
    assert status == 413 and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert str(MAX_BODY) in error["message"]
    wait_closed(sock)
    sock.close()


def test_a_body_over_the_limit_is_a_413_without_reading_it(limited):
    # 50 MB announced, a few bytes sent: the answer comes without the rest
    sock = connect(limited.url)
    head = {"Content-Type": "application/json", "Content-Length": str(50_000_000)}
    sock.sendall(request_head("POST", "/v1/completions", head) + b'{"model": "' + b"a" * 1000)
    assert_too_large(sock)
    # a chunked body is counted as it comes
    sock = connect(limited.url)
    head = {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}
    chunk = b"400\r\n" + b" " * 1024 + b"\r\n"
    sock.sendall(request_head("POST", "/v1/completions", head) + chunk * (2 * MAX_BODY // 1024))
    assert_too_large(sock)
    # a body within the limit is served
    body = {"model": MODEL_NAME, "prompt": "x = ", "max_tokens": 2, "user": "u" * (MAX_BODY // 2)}
    assert limited.client.post("/v1/completions", json=body).status_code == 200
    # and so is one sent in chunks
    payload = json.dumps(body).encode()
    response = limited.client.post(
        "/v1/completions",
        content=iter([payload[:100], payload[100:]]),
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 200, response.text


def test_the_api_key_check_comes_before_the_body_limit(tiny_model):
    running = RunningServer(tiny_model, max_request_bytes=MAX_BODY, api_key="sesame")
    try:
        sock = connect(running.url)
        sock.sendall(request_head("POST", "/v1/completions", {"Content-Length": str(50_000_000)}))
        status, _, body = read_response(sock)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        sock.close()
    finally:
        running.stop()


def test_the_default_connection_limit_leaves_file_descriptors_free():
    assert default_max_connections(1024) < 1024 // 2 + 1
    assert default_max_connections(1_000_000) == 512
    assert default_max_connections(64) >= 1


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(__import__("resource"), "prlimit"),
    reason="lowers a running process's descriptor limit (prlimit) and counts /proc/PID/fd",
)
def test_running_out_of_file_descriptors_is_one_warning_not_a_traceback_per_try(tmp_path):
    import resource

    log_path = tmp_path / "serve.jsonl"
    proc, url = start_cli_server(log_path, extra=["--max-connections", "100000"])
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
    reader.start()  # a flood of tracebacks must not fill the pipe and block the server
    held: list[socket.socket] = []
    try:
        assert httpx.get(url + "/health", timeout=HANG_S).status_code == 200
        in_use = len(os.listdir(f"/proc/{proc.pid}/fd"))
        _, hard = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (in_use + 16, hard))
        held = [connect(url) for _ in range(48)]  # past the descriptors left: accept fails (EMFILE)
        for sock in held[:8]:  # the first ones were accepted: they are served
            sock.sendall(request_head("GET", "/health", {}))
        for sock in held[:8]:
            assert read_response(sock)[0] == 200
        for sock in held:
            sock.close()
        held = []
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (hard, hard))
        for _ in range(HANG_S * 20):  # accept is retried once descriptors are free
            try:
                if httpx.get(url + "/health", timeout=HANG_S).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            threading.Event().wait(0.05)
        else:
            raise AssertionError("the server did not serve again")
        proc.terminate()
        assert proc.wait(timeout=HANG_S) == 0
    finally:
        for sock in held:
            sock.close()
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=HANG_S)
    assert not any("Traceback" in line for line in stderr), "".join(stderr[:40])
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    warnings = [r for r in records if r.get("event") == "server.accept_failed"]
    # one warning per run of failures (a run ends when a connection is accepted), not one per try
    assert 1 <= len(warnings) <= 48 and "exception" not in warnings[0]
