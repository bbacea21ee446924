"""The executor actor: the one task that talks to the ``Executor``.

Stages send it commands (``pipeline.messages``) through one bounded inbox, each with a one-shot reply
stream; it runs them one at a time in a worker thread (``anyio.to_thread.run_sync`` behind a
``CapacityLimiter(1)``), so the event loop stays free to stream outputs and take new requests while
the device works. The executor is not thread-safe and never needs to be: no other task touches it
while the engine runs. ``Executor.run`` is the same entry point the synchronous driver calls.

After a command that changed memory or request state it calls ``on_change`` (the stages that wait
for memory look again) and refreshes the statistics snapshot that ``Engine.stats()`` reads without
crossing threads.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress

import anyio
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.executor import Executor
from pipeline.messages import Command, Decode, Outcome, Verify


@attrs.define
class BatchCounters:
    """How many requests ran at once: the batch of every decode step or verify round (the requests
    stepped together), and the requests holding memory (admitted, not yet released)."""

    steps: int = 0
    batched: int = 0  # requests summed over the steps
    peak_batch: int = 0
    peak_live: int = 0  # request rows held at once

    def record(self, command: Command, live: int) -> None:
        self.peak_live = max(self.peak_live, live)
        if isinstance(command, (Decode, Verify)):
            n = len(command.request_ids)
            self.steps += 1
            self.batched += n
            self.peak_batch = max(self.peak_batch, n)

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "peak_running": self.peak_batch,
            "mean_running": self.batched / self.steps if self.steps else 0.0,
            "peak_live": self.peak_live,
        }


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

    def close(self) -> None:
        self._send.close()

    async def __aenter__(self) -> ExecutorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


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
        self.batches = BatchCounters()

    async def run(self) -> None:
        async with self._inbox:
            async for envelope in self._inbox:
                stats = self._inbox.statistics()
                idle = stats.current_buffer_used == 0 and stats.tasks_waiting_send == 0
                outcome, snapshot = await anyio.to_thread.run_sync(
                    self._execute, envelope.command, idle, limiter=self._limiter
                )
                self.num_commands += 1
                self.busy_s += outcome.seconds
                if snapshot is not None:
                    self.snapshot = snapshot
                with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    envelope.reply.send_nowait(outcome)  # the caller may have been cancelled
                envelope.reply.close()
                if outcome.changed:
                    self._on_change()

    def _execute(self, command: Command, idle: bool) -> tuple[Outcome, dict[str, object] | None]:
        """In the worker thread: the command, then (if it changed anything) fresh statistics."""
        outcome = self.executor.run(command, idle=idle)
        self.batches.record(command, len(self.executor.seqs))
        return outcome, (self.executor.stats() if outcome.changed else None)
