"""What the stages share: the registry of live requests, the abort book, and the stage waker.

Everything here runs on the event loop only (no locks needed); device work goes through the
executor actor. Nothing here decides anything: the decisions are the scheduling core's.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import anyio
import attrs
from anyio.streams.memory import MemoryObjectSendStream

from pipeline.errors import RequestError
from pipeline.messages import StageMessage, Wake
from pipeline.request import Request
from pipeline.scheduler import AbortBook, Handoff
from pipeline.stages.output import OutputBuffer


@attrs.define(eq=False)
class StageWaker:
    """Sends non-blocking ``Wake`` messages into the stages' inboxes (it holds a send end of each).

    A stage that goes to sleep waiting for memory says so (``want``); a memory change wakes only
    those (``wake_wanted``). At most one Wake per stage is outstanding (``heard`` clears it). A Wake
    that does not fit in a full inbox is dropped: the stage has messages to read and looks at shared
    state after each. The engine owns these send ends and closes them at shutdown.
    """

    _ends: dict[str, MemoryObjectSendStream[StageMessage]]
    _pending: set[str] = attrs.field(factory=set)
    _wanted: set[str] = attrs.field(factory=set)

    def wake(self, *stages: str, reason: str) -> None:
        for name in stages:
            if name in self._pending:
                continue
            try:
                self._ends[name].send_nowait(Wake(reason))
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                continue
            self._pending.add(name)

    def wake_all(self, reason: str) -> None:
        self.wake(*self._ends, reason=reason)

    def want(self, stage: str) -> None:
        """``stage`` sleeps until memory changes."""
        self._wanted.add(stage)

    def wake_wanted(self, reason: str = "memory") -> None:
        wanted, self._wanted = self._wanted, set()
        self.wake(*sorted(wanted), reason=reason)

    def heard(self, stage: str) -> None:
        self._pending.discard(stage)

    def close(self) -> None:
        for end in self._ends.values():
            end.close()


@attrs.define(eq=False)
class Registry:
    """Every accepted request that has not ended, and its consumer's buffer."""

    live: dict[str, Request] = attrs.field(factory=dict)
    outputs: dict[str, OutputBuffer] = attrs.field(factory=dict)
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

    def notify(self, request_id: str) -> None:
        """Wake the request's consumer (new output)."""
        buffer = self.outputs.get(request_id)
        if buffer is not None:
            buffer.notify()

    def ended(self, req: Request) -> None:
        self.live.pop(req.request_id, None)
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


@attrs.define(eq=False)
class StageContext:
    """Shared by every stage of one engine."""

    registry: Registry
    waker: StageWaker
    aborts: AbortBook
    max_undelivered_tokens: int | None  # park a request whose consumer is this far behind

    def is_parked(self, req: Request) -> bool:
        limit = self.max_undelivered_tokens
        if limit is None:
            return False
        buffer = self.registry.outputs.get(req.request_id)
        return buffer is not None and not buffer.whole and buffer.undelivered >= limit

    def settle(self, handoff: Handoff) -> None:
        """What every stage does with a turn's hand-off besides passing ``onward`` on: the ended
        requests leave the registry (their consumers see the end), the others' consumers wake."""
        for req in handoff.ended:
            self.aborts.discard(req.request_id)
            self.registry.ended(req)
        for req in handoff.notify:
            self.registry.notify(req.request_id)
