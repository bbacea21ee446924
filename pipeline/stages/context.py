"""What the stages share: the registry of live requests, the wake-up bells, and the verbs that end,
retract or fail requests the same way in every stage.

Everything here runs on the event loop only (no locks needed); device work goes through the
executor actor.

Ending a request follows the synchronous driver: release its memory first, then set its finish
reason and apply the terminal event (one log event), then tell its consumer.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable

import anyio
import attrs
from anyio.streams.memory import MemoryObjectSendStream

from pipeline.errors import EngineError, RequestError
from pipeline.logs import info_enabled, request_context
from pipeline.messages import Outcome, Release, StageMessage, Wake
from pipeline.request import Request
from pipeline.stages.executor_actor import ExecutorClient
from pipeline.stages.output import OutputBuffer
from statemachines.request import AbortRequested, Crashed, Event, Retracted, State

STAGES = ("admission", "staging", "decode")


@attrs.define(eq=False)
class Bells:
    """Non-blocking ``Wake`` messages into the stages' inboxes.

    At most one Wake per stage is outstanding (``heard`` clears it). A Wake that does not fit in a
    full inbox is dropped: the stage has messages to read and looks at shared state after each.
    The engine owns these send ends and closes them at shutdown.
    """

    _ends: dict[str, MemoryObjectSendStream[StageMessage]]
    _pending: set[str] = attrs.field(factory=set)

    def ring(self, *stages: str, reason: str) -> None:
        for name in stages:
            if name in self._pending:
                continue
            try:
                self._ends[name].send_nowait(Wake(reason))
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                continue
            self._pending.add(name)

    def ring_all(self, reason: str) -> None:
        self.ring(*self._ends, reason=reason)

    def heard(self, stage: str) -> None:
        self._pending.discard(stage)

    def close(self) -> None:
        for end in self._ends.values():
            end.close()


@attrs.define(eq=False)
class Registry:
    """Every accepted request that has not ended, its consumer's buffer, and pending aborts."""

    live: dict[str, Request] = attrs.field(factory=dict)
    outputs: dict[str, OutputBuffer] = attrs.field(factory=dict)
    # ids whose abort was asked for; the stage owning the request applies it at its next safe point
    pending_aborts: set[str] = attrs.field(factory=set)
    started: float = attrs.field(factory=time.monotonic)
    finished_tokens: int = 0  # output tokens of requests that have ended
    finished_by_reason: collections.Counter[str] = attrs.field(factory=collections.Counter)
    _idle: anyio.Event = attrs.field(factory=anyio.Event)

    def __attrs_post_init__(self) -> None:
        self._idle.set()

    def check_new_id(self, request_id: str) -> None:
        if request_id in self.live:
            raise RequestError("request_id", request_id, "is already in use by a live request")

    def add(self, req: Request, on_read: Callable[[], None], *, whole: bool = False) -> OutputBuffer:
        self.check_new_id(req.request_id)
        buffer = OutputBuffer(req, on_read, whole)
        self.live[req.request_id] = req
        self.outputs[req.request_id] = buffer
        if self._idle.is_set():
            self._idle = anyio.Event()
        return buffer

    def request_abort(self, request_id: str) -> bool:
        """Record the wish; False if no live request has this id."""
        req = self.live.get(request_id)
        if req is None or req.is_finished:
            return False
        self.pending_aborts.add(request_id)
        return True

    def notify(self, request_id: str) -> None:
        """Wake the request's consumer (new output)."""
        buffer = self.outputs.get(request_id)
        if buffer is not None:
            buffer.notify()

    def ended(self, req: Request) -> None:
        req.metrics.finished_time = time.monotonic()
        self.live.pop(req.request_id, None)
        self.pending_aborts.discard(req.request_id)
        buffer = self.outputs.pop(req.request_id, None)
        if buffer is not None:
            buffer.notify()
        self.finished_tokens += len(req.output_ids)
        self.finished_by_reason[req.finish_reason or "unknown"] += 1
        if not self.live:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def tokens_generated(self) -> int:
        return self.finished_tokens + sum(len(r.output_ids) for r in self.live.values())


def apply(req: Request, event: Event, stage: str, **figures: object) -> None:
    """``req.apply(event)`` with the request id and stage bound to every log line it writes (the
    binding is skipped when info events are filtered out anyway)."""
    if not info_enabled():
        req.apply(event, **figures)
        return
    with request_context(req.request_id, stage):
        req.apply(event, **figures)


def figures_of(outcome: Outcome, batch_size: int) -> dict[str, float]:
    """The figures a step's lifecycle events carry: batch size, the step's HiSparse hits and misses
    (the whole batch's, summed over layers) and the device command's wall time."""
    return {
        "batch_size": batch_size,
        "step_hits": outcome.figures.hits,
        "step_misses": outcome.figures.misses,
        "device_ms": round(outcome.seconds * 1e3, 3),
    }


@attrs.define(eq=False)
class StageContext:
    """Shared by every stage of one engine."""

    registry: Registry
    bells: Bells
    speculative: bool
    num_draft_steps: int  # drafts per round (0 without speculation)
    draft_tokens: int  # D = num_draft_steps + 1 positions a round may add
    max_undelivered_tokens: int | None  # park a request whose consumer is this far behind
    requeue: Callable[[list[Request]], None] = lambda reqs: None  # the admission queue's front door

    def is_parked(self, req: Request) -> bool:
        limit = self.max_undelivered_tokens
        if limit is None:
            return False
        buffer = self.registry.outputs.get(req.request_id)
        return buffer is not None and not buffer.whole and buffer.undelivered >= limit

    async def end(self, client: ExecutorClient, items: list[tuple[Request, Event]], stage: str) -> None:
        """Release, then apply each terminal event (finish reason set from it)."""
        if not items:
            return
        ids = tuple(r.request_id for r, _ in items if r.state is not State.QUEUED)
        if ids:
            outcome = await client.call(Release(ids))
            if outcome.error is not None:
                raise EngineError(f"releasing {ids} failed: {outcome.error}")
        for req, event in items:
            if isinstance(event, Crashed):
                req.finish_reason, req.error = "error", event.reason
            else:
                req.finish_reason = event.reason
            apply(req, event, stage, output_tokens=len(req.output_ids))
            self.registry.ended(req)

    async def fail(self, client: ExecutorClient, reqs: Iterable[Request], reason: str, stage: str) -> None:
        await self.end(client, [(r, Crashed(reason)) for r in reqs], stage)

    async def retract(
        self,
        client: ExecutorClient,
        reqs: list[Request],
        stage: str,
        *,
        count: bool = True,
        release: bool = True,
    ) -> None:
        """Memory pressure: release, back to the front of the queue (output kept). ``count``: a
        retraction of a running request (a prefill refusal is not counted, as in the driver)."""
        if not reqs:
            return
        if release:
            outcome = await client.call(Release(tuple(r.request_id for r in reqs)))
            if outcome.error is not None:
                raise EngineError(f"releasing retracted requests failed: {outcome.error}")
        for req in reqs:
            apply(req, Retracted(), stage)
            if count:
                req.metrics.num_retractions += 1
        self.requeue(reqs)
        self.bells.ring("admission", reason="memory")

    async def take_aborts(self, client: ExecutorClient, owned: Iterable[Request], stage: str) -> set[str]:
        """End every owned request whose abort is pending; returns their ids."""
        pending = self.registry.pending_aborts
        if not pending:
            return set()
        doomed = [r for r in owned if r.request_id in pending and not r.is_finished]
        await self.end(client, [(r, AbortRequested()) for r in doomed], stage)
        return {r.request_id for r in doomed}
