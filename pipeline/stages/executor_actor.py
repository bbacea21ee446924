"""The executor actor: the one task that talks to the ``Executor``.

Stages send it commands (``pipeline.messages``) through one bounded inbox, each with a one-shot reply
stream; it runs them one at a time in a worker thread (``anyio.to_thread.run_sync`` behind a
``CapacityLimiter(1)``), so the event loop stays free to stream outputs and take new requests while
the device works. The executor is not thread-safe and never needs to be: no other task touches it
while the engine runs.

After a command that changed memory or request state it calls ``on_change`` (the engine rings the
stages that wait for memory) and refreshes the statistics snapshot that ``Engine.stats()`` reads
without crossing threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import suppress
from typing import TYPE_CHECKING

import anyio
import attrs
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.executor import Executor, StepResult

if TYPE_CHECKING:
    from pipeline.messages import Result
from pipeline.messages import (
    AdmitAnswer,
    CanAdmit,
    CollectReady,
    Command,
    Decode,
    Draft,
    Outcome,
    Prefill,
    ReadyAnswer,
    Release,
    StepFigures,
    Verify,
)

log = structlog.get_logger("hispec.executor")

NO_FIGURES = StepFigures(0, 0, 0)


@attrs.frozen
class Envelope:
    """A command and where its outcome goes."""

    command: Command
    reply: MemoryObjectSendStream[Outcome]  # one-shot, buffer 1: the actor never waits on a reply


class ExecutorClient:
    """A stage's handle on the executor actor: ``await client.call(command)``. Each stage owns one
    (a clone of the actor's inbox send end) and closes it when the stage ends."""

    def __init__(self, send: MemoryObjectSendStream[Envelope]) -> None:
        self._send = send

    async def call(self, command: Command) -> Outcome:
        reply_send, reply_receive = anyio.create_memory_object_stream[Outcome](1)
        with reply_receive:
            envelope = Envelope(command, reply_send)
            try:
                self._send.send_nowait(envelope)  # the usual case: room in the inbox, no extra loop turn
            except anyio.WouldBlock:
                await self._send.send(envelope)
            return await reply_receive.receive()

    async def aclose(self) -> None:
        await self._send.aclose()

    async def __aenter__(self) -> ExecutorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _hisparse_totals(stats: dict[str, object]) -> tuple[int, int, int]:
    counters = stats.get("hisparse")
    if not counters:
        return 0, 0, 0
    return sum(counters["hits"]), sum(counters["misses"]), sum(counters["h2d_bytes"])


class ExecutorActor:
    """Owns the executor; runs commands from ``inbox`` until every sender has closed its end."""

    def __init__(
        self,
        executor: Executor,
        inbox: MemoryObjectReceiveStream[Envelope],
        on_change: Callable[[], None],
    ) -> None:
        self.executor = executor
        self._inbox = inbox
        self._on_change = on_change
        self._limiter = anyio.CapacityLimiter(1)
        self.snapshot: dict[str, object] = executor.stats()  # replaced whole after each change
        self.num_commands = 0
        self.busy_s = 0.0  # wall time spent inside commands (the rest of the engine's time is its own)
        self._handlers: dict[type, Callable[[Command, bool], tuple[Result, bool]]] = {
            CanAdmit: self._can_admit,
            Prefill: self._prefill,
            CollectReady: self._collect_ready,
            Decode: self._decode,
            Draft: self._draft,
            Verify: self._verify,
            Release: self._release,
        }

    async def run(self) -> None:
        async with self._inbox:
            async for envelope in self._inbox:
                stats = self._inbox.statistics()
                idle = stats.current_buffer_used == 0 and stats.tasks_waiting_send == 0
                outcome = await anyio.to_thread.run_sync(
                    self._execute, envelope.command, idle, limiter=self._limiter
                )
                self.busy_s += outcome.seconds
                with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    envelope.reply.send_nowait(outcome)  # the caller may have been cancelled
                envelope.reply.close()
                if outcome.changed:
                    self._on_change()

    # --- in the worker thread -----------------------------------------------------------------------

    def _execute(self, command: Command, idle: bool) -> Outcome:
        start = time.perf_counter()
        self.num_commands += 1
        try:
            result, changed = self._handlers[type(command)](command, idle)
        except Exception as exc:  # one command's failure fails its requests, not the engine
            log.error("executor.command_failed", command=type(command).__name__, exc_info=True)
            self.snapshot = self.executor.stats()
            return Outcome(None, NO_FIGURES, True, f"{type(exc).__name__}: {exc}", time.perf_counter() - start)
        figures = NO_FIGURES
        if changed:
            before = _hisparse_totals(self.snapshot)
            self.snapshot = self.executor.stats()
            after = _hisparse_totals(self.snapshot)
            figures = StepFigures(*(a - b for a, b in zip(after, before)))
        return Outcome(result, figures, changed, None, time.perf_counter() - start)

    def _can_admit(self, command: CanAdmit, idle: bool) -> tuple[Result, bool]:
        ex = self.executor
        fits = tuple(ex.can_admit(n) for n in command.num_tokens)
        return AdmitAnswer(fits, ex.pool_counts()["rows"]), False

    def _prefill(self, command: Prefill, idle: bool) -> tuple[Result, bool]:
        result = self.executor.prefill(list(command.sequences))
        return result, bool(result.first_tokens)

    def _collect_ready(self, command: CollectReady, idle: bool) -> tuple[Result, bool]:
        ex = self.executor
        if idle:
            ex.wait_staging()
        ready = tuple(ex.collect_ready())
        return ReadyAnswer(ready, tuple(ex.staging()), idle), bool(ready)

    def _decode(self, command: Decode, idle: bool) -> tuple[Result, bool]:
        return self.executor.decode(list(command.request_ids)), True

    def _draft(self, command: Draft, idle: bool) -> tuple[Result, bool]:
        ex = self.executor
        d = ex.config.speculative.draft_tokens
        runnable, refused = ex.reserve(list(command.request_ids), new_tokens=d, speculative=True)
        anyio.from_thread.run_sync(command.on_start, tuple(runnable))  # the stage marks them DRAFT
        result = ex.draft(runnable)  # room is reserved: nothing is refused here
        return StepResult({}, refused + result.refused), True

    def _verify(self, command: Verify, idle: bool) -> tuple[Result, bool]:
        return self.executor.verify(list(command.request_ids)), True

    def _release(self, command: Release, idle: bool) -> tuple[Result, bool]:
        for rid in command.request_ids:
            self.executor.release(rid)
        return None, bool(command.request_ids)
