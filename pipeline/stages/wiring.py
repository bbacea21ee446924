"""Builds the actor pipeline around one executor: the core's parts, the streams, the stages.

Stream ends and their owners (each closes what it owns when it ends)::

    admission inbox  <- engine (submissions, retractions' end, waker)   unbounded buffer, bounded use:
                                                                         queue_size submission slots,
                                                                         <= max_running_requests Requeue
    prefill inbox    <- admission                                        buffer 0: one hand-off at a time
    staging inbox    <- prefill + waker                                  buffer 4
    decode inbox     <- staging + waker                                  buffer 4
    executor inbox   <- one client per stage                             buffer 8 (one command out per stage)

The engine owns the submission end, the retraction end (decode sends on it without waiting) and the
waker's ends; closing them (once nothing is live) is the shutdown signal, and it flows down the pipeline as
each stage closes its outbound end; the executor actor ends when the last stage has closed its handle.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
import attrs
from anyio.streams.memory import MemoryObjectSendStream

from pipeline.driver import spec_policy_of
from pipeline.errors import EngineClosed
from pipeline.executor_interface import CommandExecutor
from pipeline.messages import PrefillBatch, StageMessage, Submit
from pipeline.request import Request
from pipeline.scheduler import Scheduler
from pipeline.stages.admission import AdmissionStage
from pipeline.stages.context import Registry, StageContext, StageWaker
from pipeline.stages.decode import DecodeStage
from pipeline.stages.executor_actor import Envelope, ExecutorActor, ExecutorClient, Pairing
from pipeline.stages.prefill import PrefillStage
from pipeline.stages.staging import StagingStage
from statemachines.request import AbortRequested


@attrs.define(eq=False)
class Pipeline:
    ctx: StageContext
    core: Scheduler
    actor: ExecutorActor
    admission: AdmissionStage
    prefill: PrefillStage
    staging: StagingStage
    decode: DecodeStage
    submit_end: MemoryObjectSendStream[StageMessage]
    requeue_end: MemoryObjectSendStream[StageMessage]
    slots: anyio.Semaphore  # submissions waiting for admission to read them
    control: ExecutorClient  # the engine's own commands (flushing the prefix cache)
    ended_stages: set[str] = attrs.Factory(set)  # stages whose run() has returned or raised
    closed: bool = False  # the entries are closed: no new submission

    @property
    def waker(self) -> StageWaker:
        return self.ctx.waker

    def runners(self) -> list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]]:
        runs = {
            "executor": self.actor.run,
            "admission": self.admission.run,
            "prefill": self.prefill.run,
            "staging": self.staging.run,
            "decode": self.decode.run,
        }
        return [(name, self._tracked(name, run)) for name, run in runs.items()]

    def _tracked(
        self, name: str, run: Callable[[], Awaitable[None]]
    ) -> Callable[[], Coroutine[Any, Any, None]]:
        async def runner() -> None:
            try:
                await run()
            finally:
                self.ended_stages.add(name)

        return runner

    @property
    def all_running(self) -> bool:
        return not self.ended_stages

    async def submit(self, req: Request) -> None:
        """Hand a registered request to admission, waiting for a submission slot (backpressure)."""
        if self.closed:
            raise EngineClosed("the engine is shutting down")
        await self.slots.acquire()
        try:
            self.submit_end.send_nowait(Submit(req))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.slots.release()
            raise EngineClosed("the engine is shutting down") from None

    def drop_unsubmitted(self, req: Request) -> None:
        """A registered request that never reached admission: it ends ABORTED, owning nothing."""
        req.apply(AbortRequested(), "engine")
        self.ctx.registry.ended(req)

    def close_entries(self) -> None:
        self.closed = True
        self.control.close()
        self.submit_end.close()
        self.requeue_end.close()
        self.waker.close()

    def on_read(self) -> None:
        """A consumer read its deltas: a parked request may step again."""
        if self.ctx.max_undelivered_tokens is not None:
            self.waker.wake("decode", reason="consumer")

    def check_integrity(self) -> None:
        """Every live request is held by the stage that owns its state, or travels between two."""
        live = [r for r in self.ctx.registry.live.values() if not r.is_finished]
        held = {r.request_id for reqs in self.core.containers().values() for r in reqs}
        self.core.check_integrity(live, in_transit=[r for r in live if r.request_id not in held])

    def stats(self) -> dict[str, object]:
        registry = self.ctx.registry
        uptime = time.monotonic() - registry.started
        tokens = registry.tokens_generated()
        finished = dict(registry.finished_by_reason)
        snapshot = copy.deepcopy(self.actor.snapshot)  # (its parts are shared with later snapshots)
        return {
            **snapshot,
            "requests": {
                "live": len(registry.live),
                "queued": len(self.core.admission),
                "staging": len(self.core.staging.owned),
                "decoding": len(self.core.decode),
                "ended": finished,
            },
            "throughput": {
                "tokens_generated": tokens,
                "requests_finished": sum(finished.values()),
                "uptime_s": uptime,
                "tokens_per_s": tokens / uptime if uptime > 0 else 0.0,
            },
            "executor_commands": self.actor.num_commands,
            "executor_busy_s": self.actor.busy_s,
            "running": self.actor.batches.as_dict(),
        }


def build_pipeline(
    executor: CommandExecutor,
    *,
    queue_size: int,
    max_prefill_tokens: int,
    max_undelivered_tokens: int | None,
    prefill_pacing: bool = False,
) -> Pipeline:
    admission_end, admission_inbox = anyio.create_memory_object_stream[StageMessage](math.inf)
    prefill_end, prefill_inbox = anyio.create_memory_object_stream[PrefillBatch](0)
    staging_end, staging_inbox = anyio.create_memory_object_stream[StageMessage](4)
    decode_end, decode_inbox = anyio.create_memory_object_stream[StageMessage](4)
    executor_end, executor_inbox = anyio.create_memory_object_stream[Envelope](8)

    waker = StageWaker(
        {"admission": admission_end.clone(), "staging": staging_end.clone(), "decode": decode_end.clone()}
    )
    core = Scheduler.build(
        max_prefill_tokens=max_prefill_tokens,
        num_steps=executor.num_steps,
        policy=spec_policy_of(executor),
        chunk_tokens=executor.config.chunked_prefill_tokens,
        batch_tokens=executor.plan.prefill_budget,
        pace=prefill_pacing,
        mixes=executor.config.mixed_steps,
    )
    ctx = StageContext(
        registry=Registry(), waker=waker, aborts=core.aborts, max_undelivered_tokens=max_undelivered_tokens
    )
    pairing = Pairing()  # the decode and prefill stages' busy flags: their commands may be mixed
    actor = ExecutorActor(executor, executor_inbox, on_change=waker.wake_wanted, pairing=pairing)

    def client(name: str | None = None) -> ExecutorClient:
        return ExecutorClient(executor_end.clone(), name, pairing if name is not None else None)

    slots = anyio.Semaphore(queue_size)
    requeue_end = admission_end.clone()
    admission = AdmissionStage(ctx, core.admission, client(), admission_inbox, prefill_end, slots)
    prefill = PrefillStage(ctx, core.prefill, client("prefill"), prefill_inbox, staging_end)
    staging = StagingStage(ctx, core.staging, client(), staging_inbox, decode_end)
    decode = DecodeStage(ctx, core.decode, client("decode"), decode_inbox, requeue_end)
    control = client()
    executor_end.close()  # only the stages' clones remain: the actor ends when the last stage does
    return Pipeline(
        ctx, core, actor, admission, prefill, staging, decode, admission_end, requeue_end, slots, control
    )
