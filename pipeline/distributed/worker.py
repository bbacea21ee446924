"""A rank of the tensor-parallel group: what it is built from, the messages rank 0 sends, the answers.

Rank 0 (``DistributedExecutor``) and the worker processes (``worker_main``) answer every message
with the same function, ``answer``, over their own ``Executor``; a worker loops until ``Stop``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import structlog
import torch

from pipeline.config import EngineConfig
from pipeline.distributed.group import TensorGroup, open_store
from pipeline.distributed.loading import StateDictSource, build_shard, load_shard
from pipeline.distributed.readiness import AgreedReadiness
from pipeline.executor import Executor
from pipeline.messages import CollectReady, Command, Outcome
from pipeline.model.checkpoint import parse_dtype
from pipeline.model.config import ModelConfig

if TYPE_CHECKING:
    from pipeline.model.tokenizer import Tokenizer


@attrs.frozen
class RankSetup:
    """What every rank needs to build its executor (pickled to the worker processes)."""

    config: EngineConfig
    port: int  # the group's rendezvous on this machine (rank 0 hosts it)
    timeout_s: float
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
class Reply:
    outcome: Outcome
    stats: dict | None  # the rank's statistics, when they may have moved (else None: unchanged)


def build_rank_executor(setup: RankSetup, group: TensorGroup, trace_path: str | None = None) -> Executor:
    """This rank's executor: its shard of the model, its memory with the agreed ready set."""
    from pipeline.model.tokenizer import tokenizer_for_model

    config = setup.config
    dtype, device = parse_dtype(config.dtype), torch.device(config.device)
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
                        check_machine=False, **streams)
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
        return f"AssertionError: {exc}"
    return None


def rank_stats(executor: Executor, group: TensorGroup) -> dict[str, object]:
    stats = executor.stats()
    memory = executor.memory
    stats["readiness"] = memory.figures() if isinstance(memory, AgreedReadiness) else None
    stats["collectives"] = group.figures()
    return stats


def worker_main(rank: int, setup: RankSetup) -> None:
    """A worker process: join the group, build the executor, answer rank 0 until it says stop.

    Its events repeat rank 0's (the same commands run everywhere), so it logs warnings and errors
    only, on stderr, each bound to its rank."""
    from pipeline.logs import configure_logging

    configure_logging(level="warning")
    structlog.contextvars.bind_contextvars(rank=rank)
    torch.set_num_threads(setup.config.num_threads or 1)
    store = open_store(setup.port, setup.config.tensor_parallel_size, host=False, timeout_s=setup.timeout_s)
    size, device = setup.config.tensor_parallel_size, torch.device(setup.config.device)
    group = TensorGroup(store, rank, size, timeout_s=setup.timeout_s, device=device)
    executor: Executor | None = None
    started: dict[str, object] | str  # every rank sends its statistics, or why it could not start
    try:
        executor = build_rank_executor(setup, group)
    except Exception as exc:  # reported to rank 0, which raises it
        started = f"{type(exc).__name__}: {exc}"
    else:
        started = rank_stats(executor, group)
    answers = group.all_gather_object(started)
    if executor is None or any(isinstance(why, str) for why in answers):
        if executor is not None:
            executor.close()
        return
    try:
        while True:
            match group.broadcast_object():
                case Stop():
                    break
                case RunCommand() | Inspect() as message:
                    group.all_gather_object(answer(executor, group, message))
                case other:
                    raise TypeError(f"rank 0 sent {other!r}")
    finally:
        executor.close()
