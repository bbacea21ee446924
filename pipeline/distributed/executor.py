"""The distributed executor: one command protocol, SPMD over ``tensor_parallel_size`` ranks.

::

    engine process (rank 0)                              the other ranks (1..N-1)
    pipeline -> DistributedExecutor.run(command)
                  broadcast (command, idle) ───────────► follow_commands(): receive
                  local Executor.run(command)            local Executor.run(command)   <- the same code,
                     model collectives  ◄──────────────►    model collectives            each rank over
                     ready-set MIN      ◄──────────────►    ready-set MIN                its shard
                  all-gather outcomes ◄─────────────────  its outcome (+ its stats when they changed)
                  merge -> Outcome

Rank 0 is the engine's own process. It spawns the other ranks (``torch.multiprocessing``, spawn) and
stops them in ``close``; or, launched (``torchrun``, ``launch.py``), it finds them already started on
one machine or several, and publishes its setup for them to build from (they load the checkpoint on
their own machines; an injected model cannot travel). Every rank runs an unchanged ``Executor`` over
its shard of the model (``sharding.py``) with its own memory (each rank holds the whole MLA latent
KV, see ``sharding.py``, in its own HiSparse device buffers; the host pool's rows once per node,
``shared_pool.py``) wrapped in ``AgreedReadiness`` (``readiness.py``).

Identical decisions. Every rank gets the same commands in the same order, the same all-gathered
logits and the same seeded per-request generators, so each samples, drafts and accepts exactly as
the others do: speculative rounds are computed identically on every rank, not broadcast (as SGLang's
TP workers each sample). ``merge`` checks it: ranks whose results differ raise ``RanksDiverged``; a
request that failed on one rank (a staging copy) is failed on all (its ``Release`` reaches all).

A lost rank. Collectives carry the group's timeout and a broken group fails every later call at
once, so a dead or hung worker makes the command raise ``WorkerLost`` within ``timeout_s``; the
executor actor's crash then stops the engine, which fails every live request. While the engine is
idle, rank 0 sends a ``Ping`` every quarter of the timeout: the other ranks, each waiting for the
next message no longer than the timeout, know rank 0 is alive, and a rank lost meanwhile is known
before the next command. A forward that raises on some ranks only (a fault not shared by all) is
not isolated under tensor parallelism: the ranks' collectives no longer match, the group times out,
and the engine stops the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import structlog
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.config import EngineConfig
from pipeline.distributed.environment import LaunchEnv, check_size
from pipeline.distributed.group import DEFAULT_TIMEOUT_S, START_TIMEOUT_S, TensorGroup, open_store
from pipeline.distributed.launch import locate, open_launch_store, publish_setup
from pipeline.distributed.worker import (
    Inspect,
    Ping,
    RankSetup,
    RunCommand,
    Stop,
    answer,
    build_rank_executor,
    rank_stats,
    worker_main,
)
from pipeline.errors import ConfigError, EngineError
from pipeline.messages import (
    CollectReady,
    Command,
    Mixed,
    MixedResult,
    Outcome,
    ReadyResult,
    Release,
    SwapCounts,
)
from pipeline.startup import preflight

if TYPE_CHECKING:
    from pipeline.executor import Executor, Sequence
    from pipeline.memory.interface import KVMemory
    from pipeline.model import DeepseekV32
    from pipeline.model.tokenizer import Tokenizer
    from pipeline.sampling import SamplingParams
    from statemachines.request import State

log = structlog.get_logger(__name__)

_EXIT_GRACE_S = 1.0  # after a failed collective: how long a rank that is exiting gets to be seen gone


class WorkerLost(EngineError):
    """A rank died, hung past the group's timeout, or left the group: the engine cannot go on."""


class RanksDiverged(EngineError):
    """Ranks answered one command differently: their states no longer agree."""


class DistributedExecutor:
    """Rank 0's executor: the ``CommandExecutor`` interface (``pipeline/executor_interface.py``) the
    engine and the drivers use, over every rank.

    ``transfer``: rank -> transfer stream factory (tests inject staging delays on one rank).
    ``timeout_s``: the bound on any collective, hence on noticing a lost rank.
    ``launch``: the launched group this process is rank 0 of (``launch.launch_env()``), or None:
    spawn the other ranks on this machine.
    ``ping_s``: how long the group may idle before rank 0 pings the others (default: a quarter of
    ``timeout_s``).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        model=None,
        tokenizer=None,
        trace_path: str | None = None,
        transfer: dict[int, Callable] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        launch: LaunchEnv | None = None,
        ping_s: float | None = None,
    ) -> None:
        self._procs: list = []  # the processes this one spawned (none when launched)
        self._lock = threading.Lock()  # one exchange at a time over the group
        self._broken: str | None = None
        self._stopped = False  # Stop was sent: no message follows
        self._last_exchange = time.monotonic()
        if launch is None:
            store, setup, where = self._spawn(config, model, tokenizer, transfer, timeout_s)
        else:
            store, setup, where = _lead(config, launch, model, tokenizer, transfer, timeout_s)
        try:
            node, local_rank, local_size = where
            self.group = TensorGroup(
                store, 0, config.tensor_parallel_size, timeout_s=timeout_s,
                device=torch.device(config.device), node=node, local_rank=local_rank, local_size=local_size,
            )  # fmt: skip
            local: Executor | None = None
            error: Exception | None = None
            started: dict[str, object] | str  # every rank sends its statistics, or why it could not start
            try:
                local = build_rank_executor(setup, self.group, trace_path)
            except Exception as exc:
                error, started = exc, f"{type(exc).__name__}: {exc}"
            else:
                started = rank_stats(local, self.group)
            answers = self.group.all_gather_object(started, timeout_s=max(START_TIMEOUT_S, timeout_s))
        except BaseException as exc:
            self._stop_workers()
            if isinstance(exc, RuntimeError):  # a rank that never joined, or left while starting
                raise WorkerLost(f"the tensor-parallel ranks did not all start: {exc}") from None
            raise
        failures = [(rank, why) for rank, why in enumerate(answers) if isinstance(why, str)]
        if local is None or failures:
            if local is not None:
                local.close()
            self._stop_workers()
            if error is not None:
                raise error
            rank, why = failures[0]
            raise EngineError(f"tensor-parallel rank {rank} could not start: {why}")
        self.local = local
        # no failures: every rank sent its statistics
        self._rank_stats: list[dict] = [stats for stats in answers if not isinstance(stats, str)]
        self.config = self.local.config
        self.plan = self.local.plan  # every rank made the same plan from the same config and model
        self._closing = threading.Event()
        self._ping_s = timeout_s / 4 if ping_s is None else ping_s
        self._pinger = threading.Thread(target=self._keep_alive, name="hispec-tp-ping", daemon=True)
        self._pinger.start()

    def _spawn(
        self, config: EngineConfig, model, tokenizer, transfer, timeout_s: float
    ) -> tuple[dist.Store, RankSetup, tuple[int, int, int]]:
        """Ranks 1..N-1 as processes of this machine: (the store rank 0 hosts, the setup they were
        handed, this rank's node, local rank and local size)."""
        preflight(config, model=model)  # start-up's checks, before any rank is spawned
        size = config.tensor_parallel_size
        store = open_store(0, size, host=True, timeout_s=timeout_s)
        tensors = None if model is None else {name: t.detach() for name, t in model.state_dict().items()}
        cfg = None if model is None else model.cfg
        setup = RankSetup(config, timeout_s, tensors, cfg, tokenizer, dict(transfer or {}))
        ctx = mp.get_context("spawn")
        self._procs = [
            ctx.Process(target=worker_main, args=(r, store.port, setup), name=f"hispec-tp{r}", daemon=True)
            for r in range(1, size)
        ]
        for proc in self._procs:
            proc.start()
        return store, setup, (0, 0, size)

    # --- the CommandExecutor interface --------------------------------------------------------------

    @property
    def lost(self) -> str | None:
        """Why the group is unusable (a rank died, hung or left), or None while it works."""
        return self._broken

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of ranks 1..N-1 (this process is rank 0)."""
        return [proc.pid for proc in self._procs if proc.pid is not None]

    @property
    def tokenizer(self) -> Tokenizer:
        return self.local.tokenizer

    @property
    def model(self) -> DeepseekV32:
        return self.local.model

    @property
    def memory(self) -> KVMemory:
        return self.local.memory

    @property
    def seqs(self) -> dict[str, Sequence]:
        return self.local.seqs

    @property
    def num_steps(self) -> int:
        return self.local.num_steps

    @property
    def speculative(self) -> bool:
        return self.local.speculative

    @property
    def draft_tokens(self) -> int:
        return self.local.draft_tokens

    def validate(self, token_ids: list[int] | tuple[int, ...], params: SamplingParams) -> None:
        self.local.validate(token_ids, params)

    def run(self, command: Command, *, idle: bool = True) -> Outcome:
        """Run ``command`` on every rank; one merged outcome. Raises ``WorkerLost`` when a rank is
        gone and ``RanksDiverged`` when the ranks disagree (the engine stops on either)."""
        replies = self._exchange(RunCommand(command, idle))
        for rank, reply in enumerate(replies):
            if reply.stats is not None:
                self._rank_stats[rank] = reply.stats
        return merge(command, [r.outcome for r in replies])

    def release(self, request_id: str, *, keep_sampling_state: bool = False) -> None:
        if self._broken is not None:  # the workers are gone: what this process holds goes back
            self.local.release(request_id, keep_sampling_state=keep_sampling_state)
            return
        self.run(Release((request_id,), keep_sampling_state))

    def wait_staging(self) -> None:
        self._exchange(Inspect("wait_staging"))

    def check_integrity(self, *, data: bool = True, states: dict[str, State] | None = None) -> None:
        for rank, problem in enumerate(self._exchange(Inspect("integrity", states, data))):
            assert problem is None, f"rank {rank}: {problem}"

    def pool_counts(self) -> dict[str, int]:
        """Rank 0's free counts, then every other rank's as ``rank{r}.{pool}``."""
        if self._broken is not None:
            return self.local.pool_counts()
        counts = self._exchange(Inspect("pools"))
        out = dict(counts[0])
        for rank, rank_counts in enumerate(counts[1:], start=1):
            out.update({f"rank{rank}.{k}": v for k, v in rank_counts.items()})
        return out

    def stats(self) -> dict[str, object]:
        """Rank 0's statistics with HiSparse counters summed over the ranks, and per rank (as of
        each rank's last command that changed anything, or its last ``CollectReady``): pools,
        HiSparse counters, ready-set agreement and time in collectives."""
        ranks = list(self._rank_stats)
        ranks[0] = self._stats()
        out = dict(ranks[0])
        out["hisparse"] = sum_counters([r["hisparse"] for r in ranks])
        per_rank = ("pools", "hisparse", "readiness", "collectives", "live_requests")
        out["tensor_parallel"] = {"size": self.size, "ranks": [{k: r[k] for k in per_rank} for r in ranks]}
        return out

    def close(self) -> None:
        """Stop every rank (a clean stop when the group still works), then reap the processes."""
        self._closing.set()
        try:
            with self._lock:
                if self._broken is None and not self._stopped:
                    self._stopped = True
                    self.group.broadcast_object(Stop())
        except Exception:  # a rank went away meanwhile: the processes are reaped below all the same
            log.warning("tp.stop_failed", exc_info=True)
        finally:
            try:
                self.local.close()
            finally:
                self._stop_workers()

    # --- helpers ------------------------------------------------------------------------------------

    def _stats(self) -> dict[str, object]:
        return rank_stats(self.local, self.group)

    def _keep_alive(self) -> None:
        """Until ``close``: a ``Ping`` whenever no message went out for ``_ping_s`` (the engine is
        idle). A lost rank it finds is recorded; the next command raises ``WorkerLost``."""
        while not self._closing.wait(self._ping_s / 2):
            with self._lock:
                due = time.monotonic() - self._last_exchange >= self._ping_s
                if not due or self._stopped or self._broken is not None or self._closing.is_set():
                    continue
                try:
                    self._exchange_locked(Ping())
                except WorkerLost:
                    return

    def _exchange(self, message: RunCommand | Inspect) -> list:
        """Send ``message`` to every rank, answer it here, gather every answer (rank order)."""
        with self._lock:
            return self._exchange_locked(message)

    def _exchange_locked(self, message: RunCommand | Inspect | Ping) -> list:
        if self._stopped:
            raise WorkerLost("the tensor-parallel group was stopped")
        self._check_alive()
        self._last_exchange = time.monotonic()
        try:
            self.group.broadcast_object(message)
            mine = None if isinstance(message, Ping) else answer(self.local, self.group, message)
            return self.group.all_gather_object(mine)
        except Exception as exc:
            for proc in self._procs:  # a killed rank's connection closes before its exit is seen
                proc.join(_EXIT_GRACE_S)
                if not proc.is_alive():
                    break
            self._check_alive()
            self._lose(f"a tensor-parallel rank is gone or hung: {type(exc).__name__}: {exc}")

    def _check_alive(self) -> None:
        if self._broken is not None:
            raise WorkerLost(self._broken)
        for rank, proc in enumerate(self._procs, start=1):
            if not proc.is_alive():
                self._lose(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")

    def _lose(self, why: str) -> NoReturn:
        self._broken = why
        self.group.broken = self.group.broken or why
        log.error("tp.worker_lost", reason=why)
        raise WorkerLost(why)

    def _stop_workers(self, timeout_s: float = 10.0) -> None:
        for proc in self._procs:
            proc.join(timeout_s)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout_s)


def check_launched(config: EngineConfig, launch: LaunchEnv, model) -> None:
    """What rank 0 of a launched group may build: every rank loads the checkpoint (an injected
    model stays in this process), and the tensor-parallel size is the launcher's ``WORLD_SIZE``."""
    if launch.rank != 0:
        follow = "pipeline.distributed.launch.follow()"
        raise ConfigError("RANK", launch.rank, f"only rank 0 builds the engine; the others call {follow}")
    if model is not None:
        raise ConfigError(
            "model", type(model).__name__,
            "an injected model cannot be used under a launcher: every rank loads the checkpoint named by "
            "config.model on its own machine",
        )  # fmt: skip
    check_size(config.tensor_parallel_size, launch)


def _lead(
    config: EngineConfig, launch: LaunchEnv, model, tokenizer, transfer, timeout_s: float
) -> tuple[dist.Store, RankSetup, tuple[int, int, int]]:
    """Rank 0 of a launched group: (the group's store, the setup published there for the others,
    this rank's node, local rank and local size). A start-up check that fails is published too, so
    that the other ranks exit at once rather than wait for a setup."""
    if launch.rank != 0 or model is not None:
        check_launched(config, launch, model)  # a misuse: raised before the others are told anything
    store = open_launch_store(launch, timeout_s)
    try:
        check_launched(config, launch, model)
        preflight(config)  # this node's checks; the other ranks check theirs as they build
    except Exception as exc:
        publish_setup(store, f"{type(exc).__name__}: {exc}")
        raise
    setup = RankSetup(config, timeout_s, None, None, tokenizer, dict(transfer or {}))
    publish_setup(store, setup)
    try:
        return store, setup, locate(launch, store)
    except RuntimeError as exc:  # a rank that never published its place
        raise WorkerLost(f"the tensor-parallel ranks did not all join: {exc}") from None


def merge(command: Command, outcomes: list[Outcome]) -> Outcome:
    """One outcome from every rank's: results and residency events must agree (``CollectReady``: a
    request failed on any rank is failed; ``Mixed``: each part merged on its own), swap-in counts
    are summed, the time is rank 0's."""
    first = outcomes[0]
    swaps = SwapCounts(
        *(sum(getattr(o.swaps, f) for o in outcomes) for f in ("hits", "misses", "h2d_bytes"))
    )
    changed = any(o.changed for o in outcomes)
    errors = [o.error for o in outcomes]
    if any(errors):
        if not all(errors):
            rank = next(r for r, e in enumerate(errors) if e)
            raise RanksDiverged(f"{type(command).__name__} failed on rank {rank} only: {errors[rank]}")
        return Outcome(None, swaps, changed, first.error, first.seconds, mixed=first.mixed)
    result = first.result
    if isinstance(command, Mixed):
        parts = [o.result_as(MixedResult) for o in outcomes]
        decode = merge(command.decode, [p.decode for p in parts])
        result = MixedResult(decode, merge(command.prefill, [p.prefill for p in parts]))
    elif isinstance(command, CollectReady):
        collected = [o.result_as(ReadyResult) for o in outcomes]
        failed = {rid: why for c in reversed(collected) for rid, why in c.failed.items()}
        ready = tuple(rid for rid in collected[0].ready if rid not in failed)
        for rank, c in enumerate(collected):
            if tuple(rid for rid in c.ready if rid not in failed) != ready:
                raise RanksDiverged(f"ranks 0 and {rank} collected different ready sets despite agreeing")
        result = ReadyResult(ready, collected[0].waited, failed)
    else:
        for rank, o in enumerate(outcomes[1:], start=1):
            if o.result != result:
                name = type(command).__name__
                raise RanksDiverged(f"{name}: rank {rank} answered {o.result!r}, rank 0 {result!r}")
    for rank, o in enumerate(outcomes[1:], start=1):
        if o.residency != first.residency:  # every rank's memory makes the same moves
            name = type(command).__name__
            raise RanksDiverged(f"{name}: rank {rank} moved {o.residency!r}, rank 0 {first.residency!r}")
    return Outcome(result, swaps, changed, None, first.seconds, mixed=first.mixed, residency=first.residency)


def sum_counters(per_rank: list[dict | None]) -> dict | None:
    """HiSparse counters summed over ranks, layer by layer (hit rates recomputed)."""
    present = [c for c in per_rank if c]
    if not present:
        return per_rank[0]
    out: dict[str, object] = {}
    for key, value in present[0].items():
        if isinstance(value, list) and key != "hit_rate":
            out[key] = [sum(c[key][i] for c in present) for i in range(len(value))]
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = sum(c[key] for c in present)
        else:
            out[key] = value
    hits, misses = out.get("hits"), out.get("misses")
    if isinstance(hits, list) and isinstance(misses, list):  # per layer
        out["hit_rate"] = [round(h / (h + m), 4) if h + m else 1.0 for h, m in zip(hits, misses)]
    return out
