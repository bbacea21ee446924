"""A real server on 127.0.0.1 for the tests: ``HttpServer`` on an event loop in a background thread.

The engine serves an injected random tiny model. ``FlakyEngine`` makes a request fail inside the
engine on demand (its ``seed`` is ``FAIL_SEED``), through the public API only: its stream raises
``RequestFailed`` after the first delta, and closing the real stream aborts the real request.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import aclosing

import anyio
import anyio.from_thread
import httpx

from pipeline import Engine, EngineConfig, HiSparseConfig, RequestFailed, SpeculativeConfig
from pipeline.server import HttpServer

MODEL_NAME = "tiny-test"
FAIL_SEED = 666
MAX_CONTEXT = 256


def server_config(max_running_requests: int = 32) -> EngineConfig:
    return EngineConfig(
        dtype="float64",
        page_size=8,
        max_context_len=MAX_CONTEXT,
        max_running_requests=max_running_requests,
        device_pool_tokens=1024,
        hisparse=HiSparseConfig(device_buffer_size=16, host_to_device_ratio=4),
        speculative=SpeculativeConfig(num_steps=2, max_batch_size=8),  # rounds for small batches on a CPU too
    )


class FlakyEngine(Engine):
    def generate(self, prompt, params=None, *, request_id=None):
        stream = super().generate(prompt, params, request_id=request_id)
        if params is not None and params.seed == FAIL_SEED:
            return self._fail_after_first(stream, request_id)
        return stream

    @staticmethod
    async def _fail_after_first(stream, request_id):
        async with aclosing(stream) as deltas:
            async for delta in deltas:
                yield delta
                raise RequestFailed(request_id, "injected fault", delta.token_ids)


class RunningServer:
    """Starts ``HttpServer`` (port 0) in a blocking portal's event loop; ``stop()`` drains it."""

    def __init__(self, model, cfg: EngineConfig | None = None, *, on_exit: str = "abort") -> None:
        self.engine = FlakyEngine(cfg or server_config(), model=model)
        self.server = HttpServer(
            self.engine, host="127.0.0.1", port=0, served_model_name=MODEL_NAME, on_exit=on_exit
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


def sse_data(lines) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent event stream's lines, as they come."""
    return (line.removeprefix("data: ") for line in lines if line.startswith("data: "))
