"""32 concurrent streaming clients, some leaving mid-stream: the others get exactly their greedy
text, the ones that left are aborted in the engine (counted in the metrics), and every memory pool
is back at its initial count. A non-streamed request whose client leaves is aborted too."""

from __future__ import annotations

import functools
import json

import anyio
import httpx
import pytest
from _server_util import MODEL_NAME, scrape, sse_data

from pipeline import SamplingParams

NUM_CLIENTS = 32
LEAVERS = range(0, NUM_CLIENTS, 4)  # every fourth client disconnects after its first tokens
PROMPTS = ["import os\n", "def f(x):", "class A:", "# total = "]
MAX_TOKENS = 16


def counters(server) -> tuple[float, int]:
    """(client disconnects in the metrics, requests the engine ended by abort)."""
    disconnects = scrape(server.client)[("hispec:request_disconnects_total", ())]
    return disconnects, server.stats()["requests"]["ended"].get("abort", 0)


async def wait_idle(server) -> None:
    await anyio.to_thread.run_sync(server.wait_idle)


@pytest.mark.asyncio
async def test_streaming_clients_some_disconnecting(server):
    expected = {
        p: server.call(
            server.engine.generate_text, list(p.encode()), SamplingParams(max_new_tokens=MAX_TOKENS)
        ).text
        for p in PROMPTS
    }
    disconnects_before, aborts_before = counters(server)
    texts: dict[int, str] = {}
    left: set[int] = set()

    async def client_run(client: httpx.AsyncClient, i: int) -> None:
        leaves = i in LEAVERS
        body = {
            "model": MODEL_NAME,
            "prompt": PROMPTS[i % len(PROMPTS)],
            "temperature": 0,
            "stream": True,
            "max_tokens": 200 if leaves else MAX_TOKENS,
            "ignore_eos": leaves,
        }
        parts = []
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                for data in sse_data([line]):
                    if data == "[DONE]":
                        texts[i] = "".join(parts)
                        return
                    parts.append(json.loads(data)["choices"][0]["text"])
                    if leaves and "".join(parts):
                        left.add(i)
                        return  # leaving the block closes the connection mid-stream

    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8)
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client,
        anyio.create_task_group() as tg,
    ):
        for i in range(NUM_CLIENTS):
            tg.start_soon(client_run, client, i)
    await wait_idle(server)

    assert left == set(LEAVERS)
    assert texts == {i: expected[PROMPTS[i % len(PROMPTS)]] for i in range(NUM_CLIENTS) if i not in LEAVERS}
    disconnects, aborts = counters(server)
    assert disconnects - disconnects_before == len(LEAVERS)
    assert aborts - aborts_before == len(LEAVERS)
    assert server.pool_counts() == server.engine.initial_pool_counts


@pytest.mark.asyncio
async def test_a_non_streamed_request_is_aborted_when_its_client_leaves(server):
    disconnects_before, aborts_before = counters(server)
    state = server.server.state
    body = {"model": MODEL_NAME, "prompt": "while True:", "max_tokens": 200, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client, anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(client.post, "/v1/completions", json=body))
        with anyio.fail_after(60):  # a hang guard, not a timing assertion
            while not await anyio.to_thread.run_sync(server.call, lambda: len(state.in_flight)):
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()  # the client gives up: its connection closes
    await wait_idle(server)
    disconnects, aborts = counters(server)
    assert (disconnects - disconnects_before, aborts - aborts_before) == (1, 1)
    assert server.pool_counts() == server.engine.initial_pool_counts
