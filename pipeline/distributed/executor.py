"""The distributed executor: one command protocol, SPMD over ``tensor_parallel_size`` ranks.

::

    engine process (rank 0)                              worker processes (ranks 1..N-1)
    pipeline -> DistributedExecutor.run(command)
                  broadcast (command, idle) ───────────► serve(): receive
                  local Executor.run(command)            local Executor.run(command)   <- the same code,
                     model collectives  ◄──────────────►    model collectives            each rank over
                     ready-set MIN      ◄──────────────►    ready-set MIN                its shard
                  all-gather outcomes ◄─────────────────  its outcome (+ its stats when they changed)
                  merge -> Outcome

Rank 0 is the engine's own process; it spawns the other ranks (``torch.multiprocessing``, spawn) and
stops them in ``close``. Every rank runs an unchanged ``Executor`` over its shard of the model
(``sharding.py``) with its own memory (each rank holds the whole MLA latent KV, see ``sharding.py``,
in its own HiSparse device buffers and host pool) wrapped in ``AgreedReadiness`` (``readiness.py``).

Identical decisions. Every rank gets the same commands in the same order, the same all-gathered
logits and the same seeded per-request generators, so each samples, drafts and accepts exactly as
the others do: speculative rounds are computed identically on every rank, not broadcast (as SGLang's
TP workers each sample). ``merge`` checks it: ranks whose results differ raise ``RanksDiverged``; a
request that failed on one rank (a staging copy) is failed on all (its ``Release`` reaches all).

A lost rank. Collectives carry the group's timeout and a broken group fails every later call at
once, so a dead or hung worker makes the command raise ``WorkerLost`` within ``timeout_s``; the
executor actor's crash then stops the engine, which fails every live request. A forward that raises
on some ranks only (a fault not shared by all) is not isolated under tensor parallelism: the ranks'
collectives no longer match, the group times out, and the engine stops the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import structlog
import torch
import torch.multiprocessing as mp

from pipeline.config import EngineConfig
from pipeline.distributed.group import TensorGroup, open_store
from pipeline.distributed.worker import (
    Inspect,
    RankSetup,
    RunCommand,
    Stop,
    answer,
    build_rank_executor,
    rank_stats,
    worker_main,
)
from pipeline.errors import EngineError
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

DEFAULT_TIMEOUT_S = 60.0
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
    ) -> None:
        preflight(config, model=model)  # start-up's checks, before any rank is spawned
        size = config.tensor_parallel_size
        store = open_store(0, size, host=True, timeout_s=timeout_s)
        tensors = None if model is None else {name: t.detach() for name, t in model.state_dict().items()}
        cfg = None if model is None else model.cfg
        setup = RankSetup(config, store.port, timeout_s, tensors, cfg, tokenizer, dict(transfer or {}))
        ctx = mp.get_context("spawn")
        self._procs = [
            ctx.Process(target=worker_main, args=(rank, setup), name=f"hispec-tp{rank}", daemon=True)
            for rank in range(1, size)
        ]
        for proc in self._procs:
            proc.start()
        self._lock = threading.Lock()  # one exchange at a time over the group
        self._broken: str | None = None
        try:
            self.group = TensorGroup(store, 0, size, timeout_s=timeout_s, device=torch.device(config.device))
            local: Executor | None = None
            error: Exception | None = None
            started: dict[str, object] | str  # every rank sends its statistics, or why it could not start
            try:
                local = build_rank_executor(setup, self.group, trace_path)
            except Exception as exc:
                error, started = exc, f"{type(exc).__name__}: {exc}"
            else:
                started = rank_stats(local, self.group)
            answers = self.group.all_gather_object(started)
        except BaseException:
            self._stop_workers()
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

    # --- the CommandExecutor interface --------------------------------------------------------------

    @property
    def lost(self) -> str | None:
        """Why the group is unusable (a rank died, hung or left), or None while it works."""
        return self._broken

    @property
    def size(self) -> int:
        return self.group.size

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
        try:
            if self._broken is None:
                with self._lock:
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

    def _exchange(self, message: RunCommand | Inspect) -> list:
        """Send ``message`` to every rank, answer it here, gather every answer (rank order)."""
        with self._lock:
            self._check_alive()
            try:
                self.group.broadcast_object(message)
                mine = answer(self.local, self.group, message)
                return self.group.all_gather_object(mine)
            except Exception as exc:
                for proc in self._procs:  # a killed rank's connection closes before its exit is seen
                    proc.join(_EXIT_GRACE_S)
                    if not proc.is_alive():
                        break
                self._check_alive()
                self._lose(f"a collective failed: {type(exc).__name__}: {exc}")

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
