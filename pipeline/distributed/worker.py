"""A rank of the tensor-parallel group: what it is built from, the messages rank 0 sends, the answers.

Rank 0 (``DistributedExecutor``) and the other ranks answer every message with the same function,
``answer``, over their own ``Executor``; the others (``follow_commands``: the processes rank 0
spawned, ``worker_main``, or launched ones, ``launch.follow``) loop until ``Stop``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import structlog
import torch

from pipeline.config import EngineConfig
from pipeline.distributed.environment import ignore_stop_signals
from pipeline.distributed.group import START_TIMEOUT_S, GroupLost, TensorGroup, open_store
from pipeline.distributed.loading import StateDictSource, build_shard, load_shard
from pipeline.distributed.readiness import AgreedReadiness
from pipeline.distributed.shared_pool import (
    SharedHostPool,
    host_map_digest,
    host_pool_figures,
    shares_host_pool,
)
from pipeline.executor import Executor
from pipeline.messages import CollectReady, Command, Outcome
from pipeline.model.checkpoint import parse_dtype
from pipeline.model.config import ModelConfig

if TYPE_CHECKING:
    from pipeline.model.tokenizer import Tokenizer


@attrs.frozen
class RankSetup:
    """What every rank needs to build its executor: rank 0's, pickled to the processes it spawns or
    published in a launched group's store."""

    config: EngineConfig
    timeout_s: float  # the bound on every collective of the group
    tensors: dict[str, torch.Tensor] | None  # the full model's tensors (an injected model), or None: load
    model_config: ModelConfig | None  # the injected model's configuration
    tokenizer: Tokenizer | None  # an injected tokenizer, or None: the checkpoint's (byte-level for tensors)
    transfer: dict[int, Callable] = attrs.Factory(dict)  # rank -> transfer stream factory (tests)


@attrs.frozen
class RunCommand:
    command: Command
    idle: bool


@attrs.frozen
class Inspect:
    """A question every rank answers from its executor: ``"pools"``, ``"integrity"``, ``"wait_staging"``."""

    what: str
    states: dict | None = None
    data: bool = True


@attrs.frozen
class Stop:
    pass


@attrs.frozen
class Ping:
    """Rank 0 is idle, and alive: every rank answers None (so a rank lost while idle is noticed)."""


@attrs.frozen
class Reply:
    outcome: Outcome
    stats: dict | None  # the rank's statistics, when they may have moved (else None: unchanged)


def build_rank_executor(setup: RankSetup, group: TensorGroup, trace_path: str | None = None) -> Executor:
    """This rank's executor: its shard of the model, its memory with the agreed ready set."""
    from pipeline.model.tokenizer import tokenizer_for_model

    config = setup.config
    dtype, device = parse_dtype(config.dtype), torch.device(config.device)
    # the node's ranks hold one host pool between them (its rows in shared memory)
    shared = SharedHostPool(group) if shares_host_pool(config, group) else None
    try:
        if setup.tensors is not None:
            assert setup.model_config is not None, "an injected model's tensors come with its configuration"
            model = build_shard(setup.model_config, dtype, device, group, StateDictSource(setup.tensors))
        else:
            model = load_shard(config.model, dtype, device, group)
        tokenizer = setup.tokenizer
        if tokenizer is None:
            path = None if setup.tensors is not None else config.model
            cfg = model.cfg
            tokenizer = tokenizer_for_model(path, vocab_size=cfg.vocab_size, eos_token_id=cfg.eos_token_id)
        streams = {"transfer": setup.transfer[group.rank]} if group.rank in setup.transfer else {}
        # every rank's memory was checked against the machine before the ranks were spawned
        executor = Executor(config, model=model, tokenizer=tokenizer, trace_path=trace_path,
                            check_machine=False, host_rows=shared, **streams)
    except BaseException as exc:
        if shared is not None:  # the node's other ranks, waiting for the pool's name, are told why
            shared.abandon(f"{type(exc).__name__}: {exc}")
            shared.close()  # its name, if this rank was the one to remove it
        raise
    executor.memory = AgreedReadiness(executor.memory, group)
    return executor


def answer(executor: Executor, group: TensorGroup, message: RunCommand | Inspect) -> object:
    """What one rank replies to one message (rank 0 and the workers alike)."""
    if isinstance(message, RunCommand):
        outcome = executor.run(message.command, idle=message.idle)
        # fresh statistics when anything changed, and after every CollectReady (its agreement
        # counters move even when nobody became ready)
        fresh = outcome.changed or isinstance(message.command, CollectReady)
        return Reply(outcome, rank_stats(executor, group) if fresh else None)
    if message.what == "pools":
        return executor.pool_counts()
    if message.what == "wait_staging":
        executor.wait_staging()
        return None
    try:
        executor.check_integrity(data=message.data, states=message.states)
    except AssertionError as exc:
        problem: str | None = f"AssertionError: {exc}"
    else:
        problem = None
    # the ranks' host maps agree (what lets them share the rows): one gather, on every rank alike
    digests = group.all_gather_object(host_map_digest(executor.memory))
    if problem is None and digests[group.rank] != digests[0]:
        problem = "AssertionError: this rank's host map (req_to_host, free host pages) differs from rank 0's"
    return problem


def rank_stats(executor: Executor, group: TensorGroup) -> dict[str, object]:
    stats = executor.stats()
    memory = executor.memory
    stats["readiness"] = memory.figures() if isinstance(memory, AgreedReadiness) else None
    stats["host_pool"] = pool = host_pool_figures(memory, group)
    kv_cache = stats.get("kv_cache")
    if pool is not None and isinstance(kv_cache, dict):  # ``/metrics``: kv_cache_bytes{memory="host_node"}
        stats["kv_cache"] = {**kv_cache, "host_node_bytes": pool["bytes_per_node"]}
    stats["collectives"] = group.figures()
    return stats


def worker_main(rank: int, port: int, setup: RankSetup) -> None:
    """A process rank 0 spawned: join the group at ``port`` on this machine, then follow rank 0's
    commands until it says stop (exit status 1 when the group breaks first).

    Its events repeat rank 0's (the same commands run everywhere), so it logs warnings and errors
    only, on stderr, each bound to its rank."""
    from pipeline.logs import configure_logging

    ignore_stop_signals()  # rank 0 decides when the group stops (it says Stop)
    configure_logging(level="warning")
    structlog.contextvars.bind_contextvars(rank=rank)
    torch.set_num_threads(setup.config.num_threads or 1)
    store = open_store(port, setup.config.tensor_parallel_size, host=False, timeout_s=setup.timeout_s)
    size, device = setup.config.tensor_parallel_size, torch.device(setup.config.device)
    group = TensorGroup(store, rank, size, timeout_s=setup.timeout_s, device=device)
    try:
        follow_commands(setup, group)  # a start that failed: rank 0 raises it
    except GroupLost as exc:
        structlog.get_logger(__name__).error("tp.group_lost", reason=str(exc))
        raise SystemExit(1) from None


def follow_commands(setup: RankSetup, group: TensorGroup) -> str | None:
    """A rank other than 0: build its executor, tell every rank whether it started, then answer rank
    0's messages until ``Stop``. None once stopped, or why the group could not start (this rank's
    reason or another's). ``GroupLost`` when a collective fails: rank 0 (or another rank) is gone."""
    executor: Executor | None = None
    started: dict[str, object] | str  # every rank sends its statistics, or why it could not start
    try:
        executor = build_rank_executor(setup, group)
    except Exception as exc:  # reported to rank 0, which raises it
        started = f"{type(exc).__name__}: {exc}"
    else:
        started = rank_stats(executor, group)
    try:
        # every rank waits here for the slowest to load its shard
        answers = group.all_gather_object(started, timeout_s=max(START_TIMEOUT_S, setup.timeout_s))
        failures = [f"rank {r}: {why}" for r, why in enumerate(answers) if isinstance(why, str)]
        if executor is None or failures:
            return failures[0] if failures else str(started)
        while True:
            match group.broadcast_object():
                case Stop():
                    return None
                case Ping():
                    group.all_gather_object(None)
                case RunCommand() | Inspect() as message:
                    group.all_gather_object(answer(executor, group, message))
                case other:
                    raise TypeError(f"rank 0 sent {other!r}")
    except RuntimeError:
        if group.broken is None:  # not the group's failure: this rank's own
            raise
        lost = f"rank {group.rank}: lost the tensor-parallel group (rank 0 or another rank is gone or hung)"
        raise GroupLost(f"{lost}: {group.broken}") from None
    finally:
        if executor is not None:
            executor.close()
