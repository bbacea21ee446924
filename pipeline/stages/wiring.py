"""Builds the actor pipeline around one executor: the streams, the stages, who holds which end.

Stream ends and their owners (each closes what it owns when it ends)::

    admission inbox  <- engine (submissions) + bells          buffer queue_size
    prefill inbox    <- admission                             buffer 0: one batch hand-off at a time
    staging inbox    <- prefill + bells                       buffer 4
    decode inbox     <- staging + bells                       buffer 4
    executor inbox   <- one client per stage                  buffer 8 (each stage has one command out)

The engine owns the submission end and the bells; closing them (once nothing is live) is the
shutdown signal, and it flows down the pipeline as each stage closes its outbound end.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio
import attrs
from anyio.streams.memory import MemoryObjectSendStream

from pipeline.errors import EngineClosed
from pipeline.executor import Executor
from pipeline.messages import PrefillBatch, StageMessage, Submit
from pipeline.request import Request
from pipeline.stages.admission import AdmissionStage
from pipeline.stages.context import Bells, Registry, StageContext, apply
from pipeline.stages.decode import DecodeStage
from pipeline.stages.executor_actor import Envelope, ExecutorActor, ExecutorClient
from pipeline.stages.prefill import PrefillStage
from pipeline.stages.staging import StagingStage
from statemachines.request import AbortRequested, Crashed


@attrs.define(eq=False)
class Pipeline:
    ctx: StageContext
    actor: ExecutorActor
    admission: AdmissionStage
    prefill: PrefillStage
    staging: StagingStage
    decode: DecodeStage
    submit_end: MemoryObjectSendStream[StageMessage]

    @property
    def bells(self) -> Bells:
        return self.ctx.bells

    def runners(self) -> list[tuple[str, Callable[[], Awaitable[None]]]]:
        stages = (self.actor, self.admission, self.prefill, self.staging, self.decode)
        names = ("executor", "admission", "prefill", "staging", "decode")
        return [(name, stage.run) for name, stage in zip(names, stages)]

    async def submit(self, req: Request) -> None:
        """Hand a registered request to admission. Shielded: once sent, admission owns it, so a
        cancelled caller must not be left unsure whether the hand-off happened."""
        try:
            with anyio.CancelScope(shield=True):
                await self.submit_end.send(Submit(req))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise EngineClosed("the engine is shutting down") from None

    def drop_unsubmitted(self, req: Request) -> None:
        """A registered request that never reached admission: it ends ABORTED, owning nothing."""
        req.finish_reason = "abort"
        apply(req, AbortRequested(), "engine")
        self.ctx.registry.ended(req)

    def fail_live(self, reason: str) -> None:
        """The stages were cancelled (one raised): every live request ends FAILED; the executor's
        close() then releases whatever they held."""
        for req in list(self.ctx.registry.live.values()):
            if not req.is_finished:
                req.finish_reason, req.error = "error", reason
                apply(req, Crashed(reason), "engine")
            self.ctx.registry.ended(req)

    def close_entries(self) -> None:
        self.submit_end.close()
        self.bells.close()

    def on_read(self) -> None:
        """A consumer read its deltas: a parked request may step again."""
        if self.ctx.max_undelivered_tokens is not None:
            self.bells.ring("decode", reason="consumer")

    def stats(self) -> dict[str, object]:
        registry = self.ctx.registry
        uptime = time.monotonic() - registry.started
        tokens = registry.tokens_generated()
        finished = dict(registry.finished_by_reason)
        snapshot = dict(self.actor.snapshot)
        return {
            **snapshot,
            "requests": {
                "live": len(registry.live),
                "queued": len(self.admission.queue),
                "staging": len(self.staging.owned),
                "decoding": len(self.decode.batch),
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
        }


def build_pipeline(
    executor: Executor, *, queue_size: int, max_prefill_tokens: int, max_undelivered_tokens: int | None
) -> Pipeline:
    admission_end, admission_inbox = anyio.create_memory_object_stream[StageMessage](queue_size)
    prefill_end, prefill_inbox = anyio.create_memory_object_stream[PrefillBatch](0)
    staging_end, staging_inbox = anyio.create_memory_object_stream[StageMessage](4)
    decode_end, decode_inbox = anyio.create_memory_object_stream[StageMessage](4)
    executor_end, executor_inbox = anyio.create_memory_object_stream[Envelope](8)

    bells = Bells({"admission": admission_end.clone(), "staging": staging_end.clone(), "decode": decode_end.clone()})
    spec = executor.config.speculative
    ctx = StageContext(
        registry=Registry(),
        bells=bells,
        speculative=spec is not None,
        num_draft_steps=0 if spec is None else spec.num_steps,
        draft_tokens=1 if spec is None else spec.draft_tokens,
        max_undelivered_tokens=max_undelivered_tokens,
    )
    stages: dict[str, object] = {}

    def memory_changed() -> None:
        """Wake the stages that wait for memory, and only those (the others would find nothing)."""
        if len(stages["admission"].queue):
            bells.ring("admission", reason="memory")
        if stages["staging"].is_waiting():
            bells.ring("staging", reason="memory")

    actor = ExecutorActor(executor, executor_inbox, on_change=memory_changed)

    def client() -> ExecutorClient:
        return ExecutorClient(executor_end.clone())

    admission = AdmissionStage(ctx, client(), admission_inbox, prefill_end, max_prefill_tokens)
    ctx.requeue = admission.requeue
    prefill = PrefillStage(ctx, client(), prefill_inbox, staging_end, on_done=admission.prefill_done)
    staging = StagingStage(ctx, client(), staging_inbox, decode_end)
    decode = DecodeStage(ctx, client(), decode_inbox)
    stages.update(admission=admission, staging=staging)
    executor_end.close()  # only the stages' clones remain: the actor ends when the last stage does
    return Pipeline(ctx, actor, admission, prefill, staging, decode, admission_end)
