"""One engine over ranks a launcher started: torchrun, or torch.distributed's variables by hand.

* the launcher's environment read into a rank's place (node, local rank), each bad variable named;
  ``--tp`` omitted takes ``WORLD_SIZE``, a different one is one line; an injected model is refused;
  a rank 0 that could not start tells its followers, which stop at once (no processes: fast);
* an idle group: rank 0's pings keep the other ranks waiting (spawned ranks);
* two torchrun launches on this machine, as two nodes over loopback (gloo on CPU), run
  ``hispec generate`` to the text of one process and of TP 2 spawned; so do two processes given
  the plain variables (rank 0 hosts the store, the nodes derived from ``LOCAL_RANK``);
* a follower killed mid-generation: rank 0 exits 1 with one line; rank 0 killed: the follower
  exits 1 with one line; neither hangs;
* ``hispec serve`` under torchrun answers a request; SIGTERM to rank 0 stops both nodes, status 0.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import attrs
import pytest
import torch.distributed as dist
from _engine_util import config

from pipeline import cli, generate
from pipeline.distributed import launch
from pipeline.distributed.executor import DistributedExecutor
from pipeline.distributed.group import GroupLost
from pipeline.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CEILING_S = 240  # against a hang only: a launch that has not ended by then is killed

TORCHRUN_RANK_1 = {  # what torchrun gives rank 1 of two nodes of one rank each
    "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RESTART_COUNT": "2",
}  # fmt: skip
PLAIN_RANK_0 = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}


# --- the environment, without processes -------------------------------------------------------------


def test_torchruns_variables_give_the_ranks_place():
    env = launch.launch_env(TORCHRUN_RANK_1)
    assert env == launch.LaunchEnv(
        rank=1, world_size=2, local_rank=0, local_world_size=1, node=1, master_addr="10.0.0.1",
        master_port=29500, agent_store=True, attempt=2,
    )  # fmt: skip
    assert env.is_follower and launch.is_follower(TORCHRUN_RANK_1)
    plain = launch.launch_env(PLAIN_RANK_0)
    assert plain is not None and not plain.is_follower
    assert (plain.agent_store, plain.node, plain.local_world_size, plain.attempt) == (False, None, None, 0)


@pytest.mark.parametrize("environ", [{}, {"WORLD_SIZE": "1", "RANK": "0"}], ids=["unset", "one"])
def test_one_process_is_not_a_launched_group(environ):
    assert launch.launch_env(environ) is None
    assert not launch.is_follower(environ)
    assert launch.tensor_parallel_size(None, environ) == 1
    assert launch.tensor_parallel_size(3, environ) == 3


@pytest.mark.parametrize(
    "change, name",
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"RANK": None}, "RANK"),
        ({"RANK": "2"}, "RANK"),
        ({"LOCAL_RANK": None}, "LOCAL_RANK"),
        ({"LOCAL_RANK": "1"}, "LOCAL_RANK"),  # LOCAL_WORLD_SIZE is 1
        ({"LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE"),
        ({"GROUP_RANK": "-1"}, "GROUP_RANK"),
        ({"MASTER_ADDR": " "}, "MASTER_ADDR"),
        ({"MASTER_PORT": None}, "MASTER_PORT"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
    ],
)
def test_a_bad_variable_is_named(change, name):
    environ = {k: v for k, v in {**TORCHRUN_RANK_1, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as info:
        launch.launch_env(environ)
    assert info.value.field == name


@pytest.mark.parametrize(
    "local_ranks, places",
    [
        ([0, 1, 0, 1, 2], [(0, 2), (0, 2), (1, 3), (1, 3), (1, 3)]),
        ([0, 0], [(0, 1), (1, 1)]),
        ([0, 1, 2, 3], [(0, 4)] * 4),
    ],
)
def test_nodes_are_derived_from_every_ranks_local_rank(local_ranks, places):
    assert [launch.place(local_ranks, r) for r in range(len(local_ranks))] == places


@pytest.mark.parametrize("local_ranks", [[1, 0], [0, 2], [0, 1, 1]])
def test_local_ranks_out_of_order_are_refused(local_ranks):
    with pytest.raises(ConfigError, match="LOCAL_RANK"):
        launch.place(local_ranks, 0)


def test_the_tensor_parallel_size_is_world_size():
    assert launch.tensor_parallel_size(None, TORCHRUN_RANK_1) == 2
    assert launch.tensor_parallel_size(2, TORCHRUN_RANK_1) == 2
    with pytest.raises(ConfigError, match="WORLD_SIZE=2") as info:
        launch.tensor_parallel_size(4, TORCHRUN_RANK_1)
    assert info.value.field == "tensor_parallel_size"


def test_a_tp_other_than_world_size_is_one_line(monkeypatch, capsys):
    for name, value in PLAIN_RANK_0.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["generate", "--tp", "3", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tensor_parallel_size=3" in err and "WORLD_SIZE=2" in err


def test_data_parallel_replicas_are_refused_under_a_launcher(monkeypatch, capsys):
    for name, value in PLAIN_RANK_0.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["serve", "--data-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hispec serve: --data-parallel-size:")


def test_a_follower_with_a_bad_variable_is_one_line(monkeypatch, capsys):
    for name, value in {**TORCHRUN_RANK_1, "MASTER_PORT": "port"}.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hispec serve: MASTER_PORT='port'")


def test_an_injected_model_is_refused_under_a_launcher(tiny_model):
    env = launch.launch_env(PLAIN_RANK_0)
    with pytest.raises(ConfigError, match="injected model") as info:
        DistributedExecutor(attrs.evolve(config(), tensor_parallel_size=2), model=tiny_model, launch=env)
    assert info.value.field == "model"
    follower = attrs.evolve(env, rank=1)
    with pytest.raises(ConfigError, match=r"launch\.follow\(\)") as info:
        DistributedExecutor(attrs.evolve(config(), tensor_parallel_size=2), launch=follower)
    assert info.value.field == "RANK"


def test_a_rank_0_that_could_not_start_stops_its_followers_at_once():
    """What rank 0 publishes instead of its setup when a start-up check fails: a follower reading it
    raises at once (the CLI's one line, status 1), rather than waiting for a setup."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    env = launch.launch_env(TORCHRUN_RANK_1)
    launch.publish_setup(store, "ConfigError: device_memory_bytes=1: too small")
    with pytest.raises(GroupLost, match="rank 0 could not start: ConfigError: device_memory_bytes=1"):
        launch.read_setup(store, env, 30)


@pytest.mark.slow
def test_an_idle_group_keeps_its_ranks(tiny_model):
    """While no command runs, rank 0 pings the others (each waits for a message no longer than the
    group's timeout): the pings go out with nothing to run, and the group still works after them."""
    from _engine_util import make_prompts

    from pipeline import SamplingParams
    from pipeline.driver import SyncDriver

    cfg = attrs.evolve(config(), tensor_parallel_size=2)
    executor = DistributedExecutor(cfg, model=tiny_model, ping_s=0.05)
    try:
        start = executor.group.num_collectives
        give_up = time.monotonic() + CEILING_S
        while executor.group.num_collectives < start + 6:  # three pings: a broadcast and a gather each
            assert time.monotonic() < give_up, "no ping came"
            threading.Event().wait(0.01)
        driver = SyncDriver(executor)
        driver.submit(make_prompts([9], seed=1)[0], SamplingParams(max_new_tokens=3, ignore_eos=True))
        driver.run()
        assert executor.lost is None
    finally:
        executor.close()
    assert not any(p.is_alive() for p in executor._procs)


# --- launched processes -----------------------------------------------------------------------------

PROMPTS = ["the quick brown fox", "hello world"]
GENERATE = ["generate", "--model", "tiny", "--max-new-tokens", "24", "--ignore-eos", *PROMPTS]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(node: int, port: int, args: list[str]) -> subprocess.Popen:
    """One node of two, one rank each: ``torchrun ... -m pipeline.cli ARGS``."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
        "-m", "pipeline.cli", *args,
    ]  # fmt: skip
    return _popen(command, os.environ)


def plain(rank: int, port: int, args: list[str]) -> subprocess.Popen:
    """Rank ``rank`` of two, given the plain variables only (no agent: rank 0 hosts the store, each
    process its own node as far as ``LOCAL_RANK`` tells)."""
    environ = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    return _popen([sys.executable, "-m", "pipeline.cli", *args], environ)


def _popen(command: list[str], environ) -> subprocess.Popen:
    """``command`` in a session of its own: a hang guard kills it with what it started (torchrun's
    workers), so a stuck launch fails the test instead of hanging it."""
    proc = subprocess.Popen(
        command, cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    guard = threading.Timer(CEILING_S, _kill_session, args=(proc,))
    guard.daemon = True
    guard.start()
    return proc


def _kill_session(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """Every process's (status, stdout, stderr) once it has ended."""
    ended = [p.communicate(timeout=CEILING_S) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, ended)]


def texts(stdout: str) -> dict[str, str]:
    """``hispec generate``'s text of each request (prompt and generated text)."""
    found = re.findall(r"--- (req-\d+) ---\n(.*?)\n--- \1 \(length, 24 tokens\) ---", stdout, re.DOTALL)
    return dict(found)


@pytest.fixture(scope="module")
def one_process() -> dict[str, str]:
    """The text of TP 1 and of TP 2 spawned by the engine (they agree: checked here)."""
    outputs = []
    for tp in ("1", "2"):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert generate.main([*GENERATE[1:], "--tp", tp]) == 0
        outputs.append(texts(buffer.getvalue()))
    assert outputs[0] == outputs[1] and len(outputs[0]) == len(PROMPTS)
    return outputs[0]


@pytest.mark.slow
def test_two_torchrun_nodes_generate_the_text_of_one_process(one_process):
    port = free_port()
    (status0, out0, err0), (status1, out1, err1) = finish([torchrun(n, port, GENERATE) for n in (0, 1)])
    assert (status0, status1) == (0, 0), err0 + err1
    assert texts(out0) == one_process
    assert out1 == ""  # a follower prints nothing


@pytest.mark.slow
def test_the_plain_variables_launch_the_same_group(one_process):
    port = free_port()
    (status0, out0, err0), (status1, out1, err1) = finish([plain(r, port, GENERATE) for r in (0, 1)])
    assert (status0, status1) == (0, 0), err0 + err1
    assert texts(out0) == one_process
    assert out1 == "" and err1 == ""


@pytest.mark.parametrize(
    "victim", [1, pytest.param(0, marks=pytest.mark.slow)], ids=["follower", "rank0"]
)  # the first in CI: a launch over the plain variables, end to end, in two processes
def test_a_killed_rank_ends_the_other_with_one_line(victim):
    """Mid-generation (rank 0 has started printing), one rank is killed: the other exits 1 with one
    line saying the group was lost, within the group's timeout (a closed connection: at once)."""
    port = free_port()
    args = ["generate", "--model", "tiny", "--max-new-tokens", "1500", "--ignore-eos", "hello"]
    procs = [plain(r, port, args) for r in (0, 1)]
    assert procs[0].stdout.readline() == "--- req-0 ---\n"  # the engine runs on both ranks
    procs[victim].send_signal(signal.SIGKILL)
    survivor = procs[1 - victim]
    _, err = survivor.communicate(timeout=CEILING_S)
    procs[victim].communicate(timeout=CEILING_S)
    assert survivor.returncode == 1
    lines = [line for line in err.splitlines() if line.startswith("hispec generate:")]
    assert len(lines) == 1 and "Traceback" not in err
    assert ("tensor-parallel rank is gone" if victim == 1 else "lost the tensor-parallel group") in lines[0]


def worker_of(agent: subprocess.Popen) -> int:
    """The pid of the worker torchrun's agent started (``pipeline.cli`` on its command line)."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    for pid in children:
        if b"pipeline.cli" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return int(pid)
    raise AssertionError(f"no worker among {children}")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds torchrun's worker through /proc")
def test_serve_under_torchrun_answers_and_stops_both_nodes():
    port = free_port()
    args = ["serve", "--model", "tiny", "--port", "0", "--max-context-len", "256", "--threads", "1"]
    nodes = [torchrun(n, port, args) for n in (0, 1)]
    ready = next((line for line in nodes[0].stdout if "listening on" in line), "")
    assert ready, finish(nodes)
    url = ready.split("listening on ")[1].split()[0]
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=CEILING_S) as response:
        answer = json.load(response)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 8
    os.kill(worker_of(nodes[0]), signal.SIGTERM)  # the server drains, then stops its followers
    (status0, out0, err0), (status1, out1, err1) = finish(nodes)
    assert (status0, status1) == (0, 0), err0 + err1
    assert "memory pools restored" in out0 and out1 == ""
