"""Launched ranks: one engine over processes that ``torchrun`` started, on one machine or several.

::

    node 0                                           node 1
    torchrun agent: hosts the store  ◄─────────────  torchrun agent
      rank 0: hispec serve / generate                  rank 2: follow()
              Engine -> DistributedExecutor            rank 3: follow()
      rank 1: follow()

Every process runs the same command line; ``torchrun`` (or any launcher) tells each which it is
through torch.distributed's variables (read in ``environment.py``, re-exported here). Rank 0 is the
engine: it reads the options, runs start-up's checks and publishes its ``RankSetup`` in the store;
every other rank (``follow``) reads that setup, loads its shard from the checkpoint path on its own
machine and answers rank 0's commands until rank 0 says stop. So rank 0's configuration is the one every rank
uses, whatever options the others were given.

The store. Under ``torchrun`` the agent of node 0 hosts a store at ``MASTER_ADDR:MASTER_PORT`` and
every rank connects to it (``TORCHELASTIC_USE_AGENT_STORE=True``); launched otherwise, rank 0 hosts
it there. hispec's keys live under their own prefix, one per restart of the workers, so they never
meet the agent's nor an earlier attempt's.

Where a rank runs. ``GROUP_RANK`` (the node) and ``LOCAL_WORLD_SIZE`` when the launcher sets them;
otherwise every rank publishes its ``LOCAL_RANK`` and each derives its node from them all: a node's
ranks are consecutive and numbered from 0 on it, as ``torchrun`` starts them (``locate``).

Lost ranks. A follower that dies makes rank 0's next collective fail (``WorkerLost``); rank 0 that
dies or stops answering makes a follower's wait for the next command fail (``GroupLost``), within
the group's timeout: the follower exits non-zero. A follower ignores SIGINT and SIGTERM: the group
stops when rank 0 says so (its own shutdown) or breaks.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pipeline.distributed.environment import (
    LaunchEnv,
    check_size,
    ignore_stop_signals,
    is_follower,
    launch_env,
    place,
    tensor_parallel_size,
)
from pipeline.distributed.group import DEFAULT_TIMEOUT_S, GroupLost
from pipeline.errors import ConfigError, EngineError

__all__ = [  # the environment's functions too: an application needs this one module
    "GroupLost", "LaunchEnv", "check_size", "follow", "is_follower", "launch_env", "locate",
    "open_launch_store", "place", "publish_setup", "read_setup", "tensor_parallel_size",
]  # fmt: skip

if TYPE_CHECKING:
    import torch.distributed as dist

    from pipeline.distributed.worker import RankSetup

SETUP_KEY = "setup"  # rank 0's RankSetup, pickled (or why it could not start, a str)


def open_launch_store(env: LaunchEnv, timeout_s: float) -> dist.Store:
    """The group's store, under hispec's prefix: a client of the agent's under ``torchrun``, else
    hosted by rank 0 at ``MASTER_ADDR:MASTER_PORT`` (the others connect, waiting up to
    ``timeout_s`` for it)."""
    import torch.distributed as dist

    hosting = env.rank == 0 and not env.agent_store
    try:
        store = dist.TCPStore(
            env.master_addr, env.master_port, env.world_size, hosting,
            timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
        )  # fmt: skip
    except (RuntimeError, OSError) as exc:
        where = f"{env.master_addr}:{env.master_port} (MASTER_ADDR:MASTER_PORT)"
        doing = "host the store at" if hosting else "reach the store at"
        raise EngineError(f"rank {env.rank} could not {doing} {where}: {exc}") from None
    return dist.PrefixStore(f"hispec/{env.attempt}", store)


def locate(env: LaunchEnv, store: dist.Store) -> tuple[int, int, int]:
    """``(node, local_rank, local_size)`` of this rank; the ranks exchange their ``LOCAL_RANK``
    through ``store`` when the launcher did not give ``GROUP_RANK`` and ``LOCAL_WORLD_SIZE``."""
    if env.node is not None and env.local_world_size is not None:
        return env.node, env.local_rank, env.local_world_size
    store.set(f"local_rank/{env.rank}", str(env.local_rank))
    local_ranks = [int(store.get(f"local_rank/{r}")) for r in range(env.world_size)]
    node, local_size = place(local_ranks, env.rank)
    return node, env.local_rank, local_size


def publish_setup(store: dist.Store, setup: RankSetup | str) -> None:
    """Rank 0: what every follower builds its executor from, or why rank 0 could not start."""
    payload = pickle.dumps(setup, protocol=pickle.HIGHEST_PROTOCOL)
    store.set(SETUP_KEY, payload)  # type: ignore[arg-type]  # bytes are stored as they are; the stub says str


def read_setup(store: dist.Store, env: LaunchEnv, timeout_s: float) -> RankSetup:
    """A follower: rank 0's setup, waiting up to ``timeout_s`` (the store's timeout) for it."""
    try:
        payload = store.get(SETUP_KEY)
    except RuntimeError:
        raise GroupLost(
            f"rank {env.rank}: rank 0 published no configuration within {timeout_s:g}s "
            f"(store at {env.master_addr}:{env.master_port})"
        ) from None
    setup = pickle.loads(payload)
    if isinstance(setup, str):
        raise GroupLost(f"rank {env.rank}: rank 0 could not start: {setup}")
    return setup


def follow(environ: Mapping[str, str] | None = None, *, timeout_s: float | None = None) -> None:
    """Be one of the ranks that follow rank 0: join the launched group, load this rank's shard of
    the model rank 0 names, answer its commands, and return once rank 0 stops the engine.

    What every rank but 0 calls under ``torchrun`` (rank 0 builds the ``Engine``). It prints
    nothing; warnings and errors go to stderr. ``GroupLost`` when rank 0 could not start, is gone
    or stopped answering for longer than the group's timeout; ``ConfigError`` naming the variable
    when the launcher's environment is wrong."""
    import structlog
    import torch

    from pipeline.distributed.group import TensorGroup
    from pipeline.distributed.worker import follow_commands
    from pipeline.logs import configure_logging

    env = launch_env(environ)
    if env is None or not env.is_follower:
        rank = None if env is None else env.rank
        raise ConfigError("RANK", rank, "only a launched rank other than 0 follows; rank 0 builds the Engine")
    ignore_stop_signals()  # rank 0 decides when the group stops
    configure_logging(level="warning")
    structlog.contextvars.bind_contextvars(rank=env.rank)
    join_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    store = open_launch_store(env, join_s)
    setup = read_setup(store, env, join_s)
    torch.set_num_threads(setup.config.num_threads or 1)
    try:
        node, local_rank, local_size = locate(env, store)
        group = TensorGroup(
            store, env.rank, env.world_size, timeout_s=setup.timeout_s,
            device=torch.device(setup.config.device), node=node, local_rank=local_rank, local_size=local_size,
        )  # fmt: skip
    except RuntimeError as exc:  # a rank that never joined: the store's wait timed out
        raise GroupLost(f"rank {env.rank} could not join the group: {exc}") from None
    why = follow_commands(setup, group)
    if why is not None:
        raise GroupLost(f"rank {env.rank}: the group could not start: {why}")
