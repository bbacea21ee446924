"""The launcher's environment: where this process sits in a group ``torchrun`` (or any launcher
setting torch.distributed's variables) started, read and checked before anything else is done.

Each variable missing or out of range is a ``ConfigError`` naming it. What the ranks do with it is
``launch.py``'s.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Mapping, Sequence

import attrs

from pipeline.errors import ConfigError


@attrs.frozen
class LaunchEnv:
    """This process's place in a launched group, as the launcher's environment gives it."""

    rank: int  # RANK: 0 is the engine, the others follow
    world_size: int  # WORLD_SIZE: the tensor-parallel size (more than 1)
    local_rank: int  # LOCAL_RANK: this rank's index on its machine, hence its CUDA device
    local_world_size: int | None  # LOCAL_WORLD_SIZE: ranks on this machine (None: derived)
    node: int | None  # GROUP_RANK: this machine's index (None: derived from every LOCAL_RANK)
    master_addr: str  # MASTER_ADDR: where the store listens
    master_port: int  # MASTER_PORT
    agent_store: bool  # TORCHELASTIC_USE_AGENT_STORE: torchrun's agent hosts the store
    attempt: int = 0  # TORCHELASTIC_RESTART_COUNT: which start of the workers this is

    @property
    def is_follower(self) -> bool:
        return self.rank != 0


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """This process's place in a launched group, or None when it was not launched as one of several
    (no ``WORLD_SIZE``, or 1). A variable missing or out of range is a ``ConfigError`` naming it."""
    env = os.environ if environ is None else environ
    if env.get("WORLD_SIZE") is None:
        return None
    world = _integer(env, "WORLD_SIZE", low=1)
    if world == 1:
        return None
    rank = _integer(env, "RANK", low=0, high=world)
    addr = env.get("MASTER_ADDR", "").strip()
    if not addr:
        raise ConfigError("MASTER_ADDR", env.get("MASTER_ADDR"), "must name the host of the store")
    local_size = _optional_integer(env, "LOCAL_WORLD_SIZE", low=1, high=world + 1)
    return LaunchEnv(
        rank=rank,
        world_size=world,
        local_rank=_integer(env, "LOCAL_RANK", low=0, high=local_size or world),
        local_world_size=local_size,
        node=_optional_integer(env, "GROUP_RANK", low=0, high=world),
        master_addr=addr,
        master_port=_integer(env, "MASTER_PORT", low=1, high=65536),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        attempt=_optional_integer(env, "TORCHELASTIC_RESTART_COUNT", low=0) or 0,
    )


def is_follower(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a launched rank other than 0 (it should ``follow``)."""
    env = launch_env(environ)
    return env is not None and env.is_follower


def tensor_parallel_size(given: int | None, environ: Mapping[str, str] | None = None) -> int:
    """The tensor-parallel size: ``given`` (``--tp``), which under a launcher must equal
    ``WORLD_SIZE`` or be omitted (None: ``WORLD_SIZE``, else 1)."""
    env = launch_env(environ)
    if env is None:
        return 1 if given is None else given
    if given is not None:
        check_size(given, env)
    return env.world_size


def check_size(size: int, env: LaunchEnv) -> None:
    """The tensor-parallel size of a launched group is the number of processes the launcher started."""
    if size != env.world_size:
        raise ConfigError(
            "tensor_parallel_size", size,
            f"the launcher started WORLD_SIZE={env.world_size} processes: it must equal that (or be omitted)",
        )  # fmt: skip


def place(local_ranks: Sequence[int], rank: int) -> tuple[int, int]:
    """``(node, ranks on that node)`` of ``rank`` from every rank's ``LOCAL_RANK`` in rank order: a
    node's ranks are consecutive and numbered 0, 1, ... on it::

        LOCAL_RANK  0 1 0 1 2     ->  nodes 0 0 1 1 1, two ranks on node 0, three on node 1
    """
    for r, local in enumerate(local_ranks):
        previous = local_ranks[r - 1] if r else -1
        if local not in (0, previous + 1):
            raise ConfigError(
                "LOCAL_RANK", local,
                f"rank {r}'s: a node's ranks must be consecutive and numbered from 0 on it "
                f"(every rank's: {list(local_ranks)})",
            )  # fmt: skip
    node = sum(1 for local in local_ranks[: rank + 1] if local == 0) - 1
    first = rank - local_ranks[rank]
    last = rank
    while last + 1 < len(local_ranks) and local_ranks[last + 1] != 0:
        last += 1
    return node, last - first + 1


def _integer(env: Mapping[str, str], name: str, *, low: int, high: int | None = None) -> int:
    """``env[name]``, which must be set, as a whole number in ``[low, high)``."""
    value = _optional_integer(env, name, low=low, high=high)
    if value is None:
        raise ConfigError(name, env.get(name), "must be set by the launcher (torch.distributed's variables)")
    return value


def _optional_integer(env: Mapping[str, str], name: str, *, low: int, high: int | None = None) -> int | None:
    """``env[name]`` as a whole number in ``[low, high)``, or None when it is not set."""
    text = env.get(name)
    if text is None or not text.strip():
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(name, text, "must be a whole number") from None
    if value < low or (high is not None and value >= high):
        bound = f"from {low} to {high - 1}" if high is not None else f"at least {low}"
        raise ConfigError(name, text, f"must be {bound}")
    return value


def ignore_stop_signals() -> None:
    """Ignore SIGINT and SIGTERM in a process whose lifetime another decides: a tensor-parallel rank,
    a launched follower, a data-parallel replica. Ctrl-C in a terminal reaches every process of the
    foreground group; the one that leads (rank 0, the server) drains or aborts its requests, then
    stops the others, and one that is gone ends them through their group or socket. Only the main
    thread may set handlers: from another (an application's) this does nothing."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
