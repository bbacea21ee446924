"""Data-parallel replicas behind one server, over HTTP: the same greedy text as one engine, a shared
prefix served by the replica that holds it, per-replica metrics, and a replica killed mid-load
failing only its own requests."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import anyio
import httpx
import pytest
from _server_util import HANG_S, MODEL_NAME, ROOT, RunningServer, scrape, server_config, sse_data

from pipeline import Engine, EngineError
from pipeline.sampling import SamplingParams
from pipeline.server.replica_worker import ReplicaSetup, serve_replica
from pipeline.server.replicas import ReplicatedEngine

SYSTEM = [(7 * i) % 200 + 1 for i in range(48)]  # a "system prompt": six whole pages of 8 tokens


class ThreadReplica:
    """A replica in a thread of this process (the same protocol and engine as a replica process,
    without the start-up of one); ``kill`` cuts its connection, as a dead process's would be."""

    def __init__(self, setup: ReplicaSetup, sock: socket.socket) -> None:
        self.exitcode: int | None = None
        self._sock = sock
        self._thread = threading.Thread(target=self._run, args=(setup,), name=f"replica{setup.index}")
        self._thread.start()

    def _run(self, setup: ReplicaSetup) -> None:
        try:
            anyio.run(serve_replica, setup, self._sock)
            self.exitcode = 0
        except BaseException:
            self.exitcode = 1

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def kill(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)


def start(model, policy: str = "cache_aware", *, threads: bool = False) -> RunningServer:
    engine_class = functools.partial(
        ReplicatedEngine, num_replicas=2, policy=policy, launch=ThreadReplica if threads else None
    )
    return RunningServer(model, engine_class=engine_class)  # type: ignore[arg-type]


def complete(client: httpx.Client, prompt: list[int], max_tokens: int = 8, **extra: object) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return client.post("/v1/completions", json=body)


def prefix_hits(samples: dict) -> dict[str, float]:
    return {
        dict(labels)["replica"]: value
        for (name, labels), value in samples.items()
        if name == "hispec:prefix_cache_hits_total"
    }


@pytest.mark.parametrize(
    "threads", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["threads", "processes"]
)
def test_two_replicas_serve_the_same_greedy_text_as_one_engine_and_route_a_shared_prefix(tiny_model, threads):
    prompts = [[*SYSTEM, 200 + i, 201 + i, 202 + i] for i in range(4)] + [[3, 1, 4, 1, 5, 9, 2, 6] * 3]
    running = start(tiny_model, threads=threads)
    try:
        texts = []
        for p in prompts:
            response = complete(running.client, p)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
        health = running.client.get("/health")
        assert health.status_code == 200
        assert health.json() == {"status": "ready", "replicas": {"0": "serving", "1": "serving"}}
        samples = scrape(running.client)
        stats = running.stats()
        engine = running.engine
        assert isinstance(engine, ReplicatedEngine)
        assert running.call(engine.flush_prefix_cache) > 0  # both replicas' caches...
        assert all(len(tree) == 0 for tree in engine.router.trees)  # ...and the router's record of them
    finally:
        running.stop()
    assert running.server.pools_restored

    async def one_engine() -> tuple[list[str], int]:
        async with Engine(server_config(), model=tiny_model) as engine:
            results = [
                await engine.generate_text(p, SamplingParams(temperature=0, max_new_tokens=8))
                for p in prompts
            ]
            return [r.text for r in results], engine.stats()["prefix_cache"]["hit_tokens"]

    one_texts, one_hits = anyio.run(one_engine)
    assert texts == one_texts
    # every request of the shared prompt went to one replica: it found as much of the prompt in its
    # cache as the one engine did, the other replica nothing
    assert one_hits > 0
    hits = prefix_hits(samples)
    assert sorted([hits["0"], hits["1"]]) == [0, one_hits]
    assert hits["all"] == one_hits == stats["prefix_cache"]["hit_tokens"]
    assert samples[("hispec:replica_up", (("replica", "0"),))] == 1
    assert sorted(s["throughput"]["requests_finished"] for s in stats["replicas"]) == [1, 4]
    layouts = {
        dict(labels)["replica"]: {k: v for k, v in labels if k != "replica"}
        for name, labels in samples
        if name == "hispec:cache_config_info"
    }
    assert layouts["all"] == layouts["0"] == layouts["1"]  # a KV row's bytes: one engine's, not a sum


def test_the_sum_of_the_replicas_figures_adds_amounts_and_keeps_what_describes_one_engine():
    from pipeline.server.metrics import sum_stats

    def one(tokens: int, hits: int) -> dict:
        return {
            "throughput": {"tokens_generated": tokens, "uptime_s": float(tokens)},
            "kv_cache": {"dtype": "auto", "row_bytes": 192, "key_bytes": 128, "device_bytes": 1000},
            "tensor_parallel": {"size": 2},
            "prefix_cache": {"queried_tokens": 10, "hit_tokens": hits, "hit_rate": hits / 10},
        }

    total = sum_stats([one(5, 1), one(7, 9)])
    assert total["throughput"] == {"tokens_generated": 12, "uptime_s": 7.0}
    assert total["kv_cache"] == {"dtype": "auto", "row_bytes": 192, "key_bytes": 128, "device_bytes": 2000}
    assert total["tensor_parallel"] == {"size": 2}
    assert total["prefix_cache"]["hit_rate"] == 0.5  # recomputed from the sums, not 0.1 + 0.9


def stream_lines(client: httpx.Client, prompt: list[int], out: list, first: threading.Event) -> None:
    """A streamed completion's events into ``out`` (``first`` set at the first text)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with client.stream("POST", "/v1/completions", json=body) as response:
        out.append(response.status_code)
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
                first.set()
    first.set()


def wait_for(condition, what: str) -> None:
    """Poll ``condition`` until it holds (a ceiling against hangs only)."""
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


@pytest.mark.slow
def test_a_killed_replica_fails_only_its_requests_and_the_others_keep_serving(tiny_model):
    running = start(tiny_model, policy="least_load")  # requests alternate: 0, 1, 0, 1
    engine = running.engine
    assert isinstance(engine, ReplicatedEngine)
    victim = engine.replicas[1].process
    clients = [httpx.Client(base_url=running.url, timeout=HANG_S) for _ in range(4)]
    try:
        streamed: list[list] = [[], []]
        firsts = [threading.Event(), threading.Event()]
        threads = []
        for i in range(2):  # A -> replica 0, B -> replica 1, each seen streaming
            t = threading.Thread(
                target=stream_lines, args=(clients[i], [10 + i] * 12, streamed[i], firsts[i])
            )
            t.start()
            threads.append(t)
            assert firsts[i].wait(HANG_S)
        # both replicas stopped: A and B cannot finish, so C and D alternate too, and D is never read
        for replica in engine.replicas:
            os.kill(replica.process.pid, signal.SIGSTOP)
        plain: list[httpx.Response | None] = [None, None]

        def post(i: int) -> None:
            plain[i] = complete(clients[2 + i], [20 + i] * 12, max_tokens=200, ignore_eos=True)

        for i in range(2):  # C -> replica 0, D -> replica 1
            t = threading.Thread(target=post, args=(i,))
            t.start()
            threads.append(t)
            wait_for(lambda i=i: running.call(lambda: sum(engine.router.loads)) == 3 + i, "routed")
        assert running.call(lambda: list(engine.router.loads)) == [2, 2]
        os.kill(victim.pid, signal.SIGKILL)
        os.kill(engine.replicas[0].process.pid, signal.SIGCONT)
        for t in threads:
            t.join(HANG_S)
            assert not t.is_alive()

        a, b = streamed
        assert a[0] == 200 and b[0] == 200
        assert a[-1]["choices"][0]["finish_reason"] == "length"
        assert "replica 1" in b[-1]["error"]["message"] and b[-1]["error"]["code"] == "replica_lost"
        c, d = plain
        assert c is not None and c.status_code == 200
        assert d is not None and d.status_code == 503
        assert "replica 1" in d.json()["error"]["message"]

        assert complete(running.client, [30] * 12).status_code == 200  # replica 0 serves on
        health = running.client.get("/health").json()
        assert health["replicas"] == {"0": "serving", "1": "lost"}
        samples = scrape(running.client)
        assert samples[("hispec:replica_up", (("replica", "1"),))] == 0
        assert ("hispec:generation_tokens_total", (("replica", "1"),)) not in samples
    finally:
        for client in clients:
            client.close()
        for replica in engine.replicas:  # whatever happened above, the server can stop them
            if replica.process.is_alive():
                os.kill(replica.process.pid, signal.SIGCONT)
        running.stop()
    assert running.server.pools_restored is False  # replica 1 never reported its pools back


def test_a_replica_lost_mid_stream_fails_that_stream_and_frees_its_load(tiny_model):
    running = start(tiny_model, policy="least_load", threads=True)
    engine = running.engine
    assert isinstance(engine, ReplicatedEngine)
    try:
        streamed: list = []
        first = threading.Event()
        reader = threading.Thread(target=stream_lines, args=(running.client, [40] * 12, streamed, first))
        reader.start()
        assert first.wait(HANG_S)
        assert running.call(lambda: list(engine.router.loads)) == [1, 0]  # on replica 0
        engine.replicas[0].process.kill()
        reader.join(HANG_S)
        assert not reader.is_alive()
        assert streamed[0] == 200
        error = streamed[-1]["error"]
        assert error["code"] == "replica_lost" and "replica 0" in error["message"]
        assert running.call(lambda: list(engine.router.loads)) == [0, 0]
        assert running.call(lambda: dict(engine._pending)) == {}
        assert complete(running.client, [41] * 12).status_code == 200  # replica 1 serves on
    finally:
        running.stop()


def test_a_lost_replica_is_taken_out_of_routing_and_the_server_says_so(tiny_model):
    running = start(tiny_model, threads=True)
    engine = running.engine
    assert isinstance(engine, ReplicatedEngine)
    try:
        assert complete(running.client, SYSTEM).status_code == 200  # replica 0 holds the prefix now
        before = scrape(running.client)
        engine.replicas[0].process.kill()
        wait_for(lambda: running.call(lambda: engine.replicas[0].status.value) == "lost", "replica 0 lost")
        for i in range(3):  # the prefix's holder is gone: replica 1 serves everything
            response = complete(running.client, [*SYSTEM, i])
            assert response.status_code == 200, response.text
        health = running.client.get("/health")
        assert health.status_code == 200 and health.json()["replicas"] == {"0": "lost", "1": "serving"}
        samples = scrape(running.client)
        assert samples[("hispec:replica_up", (("replica", "0"),))] == 0
        assert prefix_hits(samples) == {
            "all": samples[("hispec:prefix_cache_hits_total", (("replica", "1"),))],
            "1": samples[("hispec:prefix_cache_hits_total", (("replica", "1"),))],
        }
        assert running.call(lambda: list(engine.router.alive)) == [1]
        # the total's counters keep what the lost replica counted (a total that fell would read as a
        # counter reset), its gauges count the replicas serving
        tokens = "hispec:generation_tokens_total"
        assert before[(tokens, (("replica", "0"),))] > 0
        assert samples[(tokens, (("replica", "all"),))] == (
            before[(tokens, (("replica", "0"),))] + samples[(tokens, (("replica", "1"),))]
        )
        running_now = "hispec:num_requests_running"
        assert samples[(running_now, (("replica", "all"),))] == samples[(running_now, (("replica", "1"),))]
    finally:
        running.stop()
    assert running.server.pools_restored is False  # replica 0 never reported its pools back


@pytest.mark.slow
@pytest.mark.parametrize("split", [["--dp", "2"], ["--tp", "2"]], ids=["replicas", "tensor-parallel-ranks"])
def test_ctrl_c_reaches_the_replicas_too_and_the_server_still_decides_how_they_stop(split):
    """SIGINT to the whole process group (Ctrl-C in a terminal): the replicas (or tensor-parallel
    ranks) ignore it, the server drains them with ``--on-exit finish``, the stream in flight
    finishes and the pools come back."""
    command = [sys.executable, "-m", "pipeline.cli", "serve", "--port", "0", "--max-context-len", "256",
               "--max-running-requests", "4", "--threads", "1", *split,
               "--on-exit", "finish"]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    guard = threading.Timer(300, os.killpg, (proc.pid, signal.SIGKILL))  # a hang guard only
    guard.daemon = True
    guard.start()
    try:
        assert proc.stdout is not None
        url = next(line.split("listening on ")[1].split()[0] for line in proc.stdout if "on http" in line)
        body = {"model": "tiny", "prompt": [3] * 12, "max_tokens": 40, "ignore_eos": True, "temperature": 0,
                "stream": True}  # fmt: skip
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=HANG_S) as response:
            events = sse_data(response.iter_lines())
            first = next(events)
            os.killpg(proc.pid, signal.SIGINT)
            rest = list(events)
        out, err = proc.communicate(timeout=HANG_S)
    finally:
        guard.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length", rest[-2]
    assert len([first, *rest[:-1]]) > 1
    assert proc.returncode == 0, err
    assert "memory pools restored" in out and "KeyboardInterrupt" not in err


def test_the_routing_benchmark_conversations_share_system_prompts_and_grow_by_turn():
    import argparse

    from pipeline.benchmarks.serve_routing import context_len, conversations

    args = argparse.Namespace(
        system_prompts=2, system_len=16, conversations=4, turns=3, user_len=4, max_tokens=2
    )
    chats = conversations(args, seed=0)
    assert len(chats) == 4 and all(len(turns) == 3 for turns in chats)
    assert chats[0][0][:16] == chats[2][0][:16] != chats[1][0][:16]  # conversation c: system c % 2
    for turns in chats:
        assert [len(t) for t in turns] == [20, 26, 32]
        assert turns[1][:20] == turns[0] and turns[2][:26] == turns[1]
    assert context_len(args) >= 32 + args.max_tokens
    assert conversations(args, seed=0) == chats != conversations(args, seed=1)


class DeadOnArrival:
    """A replica whose process ended before it served (its socket closed, exit status 1)."""

    def __init__(self, setup: ReplicaSetup, sock: socket.socket) -> None:
        sock.close()
        self.exitcode = 1

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        pass


def test_a_replica_that_does_not_start_fails_the_start_naming_it_and_stops_the_others(tiny_model):
    started: list[ThreadReplica] = []

    def launch(setup: ReplicaSetup, sock: socket.socket):
        if setup.index == 1:
            return DeadOnArrival(setup, sock)
        started.append(ThreadReplica(setup, sock))
        return started[-1]

    async def enter() -> None:
        engine = ReplicatedEngine(server_config(), num_replicas=2, model=tiny_model, launch=launch)
        with pytest.raises(EngineError, match="replica 1 did not start: its process exited with status 1"):
            async with engine:
                pass

    anyio.run(enter)
    assert not started[0].is_alive()  # replica 0 was stopped, not left running


def test_a_replica_that_cannot_be_launched_fails_the_start_and_stops_those_launched_before(tiny_model):
    started: list[ThreadReplica] = []

    def launch(setup: ReplicaSetup, sock: socket.socket):
        if setup.index == 1:
            raise OSError("no more processes")
        started.append(ThreadReplica(setup, sock))
        return started[-1]

    async def enter() -> None:
        engine = ReplicatedEngine(server_config(), num_replicas=2, model=tiny_model, launch=launch)
        with pytest.raises(OSError, match="no more processes"):
            async with engine:
                pass

    anyio.run(enter)
    assert len(started) == 1 and not started[0].is_alive()  # replica 0 was stopped, not left loading


def test_on_cuda_each_replica_gets_devices_of_its_own(monkeypatch):
    import torch

    from pipeline.errors import ConfigError
    from pipeline.server.replicas import replica_cuda_devices, visible_cuda_devices

    assert replica_cuda_devices(2, 1, ["0", "1"]) == ["0", "1"]
    assert replica_cuda_devices(2, 2, ["4", "5", "6", "7", "8"]) == ["4,5", "6,7"]
    with pytest.raises(ConfigError, match=r"data_parallel_size=2: 2 replicas of 2 .* need 4 CUDA devices, 3"):
        replica_cuda_devices(2, 2, ["0", "1", "2"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_cuda_devices() == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,GPU-x")  # the third is not a device torch counts
    assert visible_cuda_devices() == ["3", "5"]
