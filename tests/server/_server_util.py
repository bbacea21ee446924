"""A real server on 127.0.0.1 for the tests: ``HttpServer`` on an event loop in a background thread.

The engine serves an injected random tiny model. ``FlakyEngine`` makes a request go wrong on demand,
by its ``seed``, through the public API only (closing the real stream aborts the real request):

* ``FAIL_SEED``: its stream raises ``RequestFailed`` after the first delta (it failed in the engine);
* ``CRASH_SEED``: its stream raises an unexpected error after the first delta;
* ``BROKEN_SEED``: ``generate`` itself raises an unexpected error;
* ``STALL_SEED``: its stream never goes past the first delta (until it is closed or cancelled).

The raw-socket helpers speak HTTP/1.1 by hand, for what an HTTP client cannot do: hold a request
half sent, open a connection and send nothing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import aclosing
from pathlib import Path

import anyio
import anyio.from_thread
import httpx

from pipeline import Engine, EngineConfig, HiSparseConfig, RequestFailed, SpeculativeConfig
from pipeline.server import HttpServer

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-test"
FAIL_SEED = 666
CRASH_SEED = 90_100  # far apart: choice i of a request samples with seed + i (n <= 16)
BROKEN_SEED = 90_200
STALL_SEED = 90_300
SECRET = "secret internal detail"  # the message of the unexpected errors: never in a response
MAX_CONTEXT = 256
HANG_S = 60  # a socket read that waits longer: the server is stuck (a hang guard, not a timing assertion)


def server_config(max_running_requests: int = 32) -> EngineConfig:
    return EngineConfig(
        dtype="float64",
        page_size=8,
        max_context_len=MAX_CONTEXT,
        max_running_requests=max_running_requests,
        device_pool_tokens=1024,
        hisparse=HiSparseConfig(device_buffer_size=16, host_to_device_ratio=4),
        # rounds for small batches on a CPU too; not timed: which turns are rounds (the counters the
        # metrics tests read, a seeded sampled request's tokens) never depends on how busy the machine is
        speculative=SpeculativeConfig(num_steps=2, max_batch_size=8, timed=False),
    )


class FlakyEngine(Engine):
    def generate(self, prompt, params=None, *, request_id=None):
        seed = None if params is None else params.seed
        if seed == BROKEN_SEED:
            raise RuntimeError(SECRET)
        stream = super().generate(prompt, params, request_id=request_id)
        if seed in (FAIL_SEED, CRASH_SEED, STALL_SEED):
            return self._after_first(stream, request_id, seed)
        return stream

    @staticmethod
    async def _after_first(stream, request_id, seed):
        async with aclosing(stream) as deltas:
            async for delta in deltas:
                yield delta
                if seed == FAIL_SEED:
                    raise RequestFailed(request_id, "injected fault", delta.token_ids)
                if seed == CRASH_SEED:
                    raise RuntimeError(SECRET)
                await anyio.sleep_forever()


class RunningServer:
    """Starts ``HttpServer`` (port 0) in a blocking portal's event loop; ``stop()`` drains it."""

    def __init__(
        self,
        model,
        cfg: EngineConfig | None = None,
        *,
        on_exit: str = "abort",
        engine_class: type[Engine] = FlakyEngine,
        **http: object,
    ) -> None:
        """``http``: more ``HttpServer`` arguments (``api_key``, ``access_log``)."""
        self.engine = engine_class(cfg or server_config(), model=model)
        self.server = HttpServer(
            self.engine, host="127.0.0.1", port=0, served_model_name=MODEL_NAME, on_exit=on_exit, **http
        )
        self._portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
        self.portal = self._portal_cm.__enter__()
        try:
            self._done, _ = self.portal.start_task(self.server.run, name="hispec-test-server")
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self.url = self.server.url
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def call(self, fn, *args):
        """Run ``fn(*args)`` on the server's event loop (awaited if it is a coroutine function)."""
        return self.portal.call(fn, *args)

    def stats(self) -> dict:
        return self.call(self.engine.stats)

    def wait_idle(self) -> None:
        self.call(self.engine.wait_idle)

    def pool_counts(self) -> dict[str, int]:
        return self.call(self.engine.executor.pool_counts)

    def stop(self) -> None:
        self.client.close()
        try:
            self.call(self.server.shutdown)
            self._done.result(timeout=120)
        finally:
            self._portal_cm.__exit__(None, None, None)


def scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` parsed by prometheus_client's parser: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def connect(url: str) -> socket.socket:
    """A raw TCP connection to the server at ``url`` (reads time out after ``HANG_S``)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=HANG_S)
    return sock


def request_head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of the one response the server sends on ``sock`` (its
    ``Content-Length`` bytes, or everything up to the end of the connection)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"the connection ended before a response's head: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    length = int(headers["content-length"]) if "content-length" in headers else None
    while length is None or len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body


def wait_closed(sock: socket.socket) -> bytes:
    """Read until the server ends the connection (or resets it); what it sent before."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def sse_data(lines) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent event stream's lines, as they come."""
    return (line.removeprefix("data: ") for line in lines if line.startswith("data: "))


def start_cli_server(
    log_path: Path, on_exit: str = "abort", extra: Sequence[str] = (), env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """``python -m pipeline.cli serve`` on any free port, logging JSON to ``log_path``: (process, url)
    once its ready line is out. ``extra``: more options; ``env``: more environment variables."""
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
        *extra,
    ]
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    guard = threading.Timer(
        300, proc.kill
    )  # a hang guard: a stuck server fails the test instead of hanging it
    guard.daemon = True
    guard.start()
    for line in proc.stdout:
        if "listening on" in line:
            return proc, line.split("listening on ")[1].split()[0]
    raise AssertionError(f"the server did not start: {proc.wait()} {proc.stderr.read()}")
