"""The executor actor: the one task that talks to the ``Executor``.

Stages send it commands (``pipeline.messages``) through one bounded inbox, each with a one-shot reply
stream; it runs them one at a time in a thread of its own (``CommandThread``), on every device, so
that the event loop (the engine's, and the application's that embeds it) stays free while a command
runs: it streams outputs, takes new requests and runs the application's own tasks meanwhile. No
forward, copy or compiled loop of a command runs on the loop's thread; between two commands the loop
runs only the stages' bookkeeping. ``EngineConfig.executor_thread=False`` runs the commands on the
event loop itself instead (the loop's other tasks run between commands, and each command holds the
loop for its whole length). The executor is not thread-safe and never needs to be: no other task
touches it while the engine runs. ``Executor.run`` is the same entry point the synchronous driver
calls.

The thread and the loop share the GIL. A command gives it up inside every torch op and every
compiled loop (the numba kernels are ``nogil``), so the loop gets its turns during a forward; what a
command runs as plain Python between them is bounded by the interpreter's switch interval. The
hand-off is one queue put and one ``call_soon_threadsafe`` per command (docs/performance-notes.md
has what it was measured to cost).

After a command that changed memory or request state it calls ``on_change`` (the stages that wait
for memory look again) and refreshes the statistics snapshot that ``Engine.stats()`` reads without
crossing threads (the snapshot is taken in the command's thread).

Mixed steps. The decode stage's ``Decode`` and the prefill stage's ``Prefill`` run as one forward
(the ``Mixed`` command the core forms of them: ``scheduler.mix``) when both are at hand. The two
stages run concurrently, so one command usually arrives a moment before the other; the actor then
*holds* it, but only while the other stage is busy (``Pairing``): it is inside its loop and will
send its next command without waiting for anything but the actor's replies. A stage stops being
busy, and says so, before every other wait (an empty inbox, a full hand-off to the next stage) and
before it ends, and the actor looks again then. While it holds one command the actor runs every
other command as it comes; the partner's ``Release`` keeps the hold (its turn goes on), any other
command of the partner (a speculative round) ends it: the held command then runs alone, so a chunk
makes progress beside speculation.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import anyio
import anyio.lowlevel
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.config import EngineConfig
from pipeline.executor_interface import CommandExecutor
from pipeline.messages import Command, Decode, Mixed, Outcome, Prefill, Release, Verify
from pipeline.scheduler import mix, split

# the stage whose commands may share a forward with each stage's: its partner
PARTNER = {"decode": "prefill", "prefill": "decode"}


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
    """A command and where its outcome goes; a *notice* (no command) only wakes the actor."""

    command: Command | None
    reply: MemoryObjectSendStream[Outcome] | None  # one-shot, buffer 1: the actor never waits on a reply
    source: str | None = None  # the sending stage's name


@attrs.define(eq=False)
class Pairing:
    """Which of the stages whose commands may be mixed (decode, prefill) are *busy*: inside their
    loop, about to send the actor their next command without waiting for anything else."""

    busy: dict[str, bool] = attrs.Factory(lambda: dict.fromkeys(PARTNER, False))


class CommandThread:
    """The thread the actor's commands run in: one thread, commands in the order they are given
    (with ``inline``, the event loop's own thread: each command runs in the caller, then the loop
    takes one turn).

    Under asyncio a command is handed over through a queue and its result comes back through
    ``call_soon_threadsafe`` onto a future: one wake-up each way. ``anyio.to_thread.run_sync`` costs
    several times that per call (a capacity limiter, a cancel scope, its worker pool's bookkeeping),
    a cost a small decode step notices (docs/performance-notes.md). On another anyio backend it is
    used as it is.

    As with ``run_sync``, the caller cannot be cancelled out of a running command (the executor's
    state must not be left half-changed): the wait is shielded, and a command runs to its end. The
    command runs in a copy of the caller's context (the log fields bound to it). ``close`` lets the
    thread end after the commands already given; it is a daemon, so a process never waits on an
    engine that was not closed.
    """

    def __init__(self, name: str = "hispec-executor", *, inline: bool = False) -> None:
        self.name = name
        self.inline = inline  # run each command on the event loop itself (``EngineConfig.executor_thread``)
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._limiter = anyio.CapacityLimiter(1)  # the other backends' path: one command at a time

    async def run(self, fn: Callable[..., Any], *args: object) -> Any:
        if self.inline:
            try:
                return fn(*args)
            finally:  # the loop's other tasks get a turn after every command, as they would in a thread
                with anyio.CancelScope(shield=True):
                    await anyio.lowlevel.checkpoint()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
            self._thread.start()
        future = loop.create_future()
        self._queue.put((contextvars.copy_context(), fn, args, loop, future))
        with anyio.CancelScope(shield=True):
            return await future

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            context, fn, args, loop, future = item
            error: BaseException | None = None
            try:
                value = context.run(fn, *args)
            except BaseException as exc:  # the caller re-raises it
                value, error = None, exc
            # drop the command before its caller resumes: it holds the executor, which must not
            # outlive a closed engine for as long as this thread then waits for the GIL
            del item, context, fn, args
            with suppress(RuntimeError):  # the loop has closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, future, value, error)
            del future, value, error


def _settle(future: asyncio.Future, value: object, error: BaseException | None) -> None:
    """``error``: what the command raised (None: it returned ``value``)."""
    if future.cancelled():  # the waiting task was cancelled by asyncio itself (not by anyio)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def runs_in_thread(config: EngineConfig) -> bool:
    """``EngineConfig.executor_thread``, resolved: None (the default) and True are the actor's
    thread on every device, False the event loop itself."""
    return config.executor_thread is not False


class ExecutorClient:
    """A stage's handle on the executor actor: ``await client.call(command)``. Each stage owns one
    (a clone of the actor's inbox send end) and closes it when the stage ends. The decode and
    prefill stages' clients also carry the ``Pairing`` they set their busy flag in."""

    def __init__(
        self, send: MemoryObjectSendStream[Envelope], name: str | None = None, pairing: Pairing | None = None
    ) -> None:
        self._send = send
        self.name = name
        self._pairing = pairing

    def busy(self) -> None:
        """The stage is about to send commands back to back (its turn starts)."""
        if self._pairing is not None and self.name is not None:
            self._pairing.busy[self.name] = True

    def pause(self) -> None:
        """The stage is about to wait for something other than the actor (or to end): an actor
        holding a command for this stage's next one looks again."""
        if self._pairing is None or self.name is None or not self._pairing.busy[self.name]:
            return
        self._pairing.busy[self.name] = False
        # a full inbox wakes the actor anyway; the flag is what it reads
        with suppress(anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._send.send_nowait(Envelope(None, None, self.name))

    async def call(self, command: Command) -> Outcome:
        reply_send, reply_receive = anyio.create_memory_object_stream[Outcome](1)
        with reply_receive:
            envelope = Envelope(command, reply_send, self.name)
            try:
                self._send.send_nowait(envelope)  # the usual case: room in the inbox, no extra loop turn
            except anyio.WouldBlock:
                await self._send.send(envelope)
            return await reply_receive.receive()

    async def aclose(self) -> None:
        self.pause()  # an ending stage is never waited for
        await self._send.aclose()

    def close(self) -> None:
        self.pause()
        self._send.close()

    async def __aenter__(self) -> ExecutorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class ExecutorActor:
    """Owns the executor; runs commands from ``inbox`` until every sender has closed its end."""

    def __init__(
        self,
        executor: CommandExecutor,
        inbox: MemoryObjectReceiveStream[Envelope],
        on_change: Callable[[], None],
        pairing: Pairing | None = None,
    ) -> None:
        self.executor = executor
        self._inbox = inbox
        self._on_change = on_change
        self._thread = CommandThread(inline=not runs_in_thread(executor.config))
        self.snapshot: dict[str, object] = executor.stats()  # replaced whole after each change
        self.num_commands = 0
        self.busy_s = 0.0  # wall time spent inside commands (the rest of the engine's time is its own)
        self.batches = BatchCounters()
        self.pairing = pairing if executor.config.mixed_steps else None  # None: every command runs alone
        self._held: Envelope | None = None  # a Decode or Prefill waiting for its partner's

    async def run(self) -> None:
        try:
            await self._serve()
        finally:
            self._thread.close()

    async def _serve(self) -> None:
        async with self._inbox:
            while True:
                if self._held is not None and not self._worth_holding(self._held):
                    await self._run_held()
                    continue
                try:
                    envelope = await self._inbox.receive()
                except anyio.EndOfStream:
                    break
                if envelope.command is None:  # a notice: a stage stopped being busy
                    continue
                held = self._held
                if held is not None and (mixed := _mixed(held, envelope)) is not None:
                    self._held = None
                    await self._run_mixed(mixed, held, envelope)
                elif held is None and self._worth_holding(envelope):
                    self._held = envelope
                else:
                    await self._run(envelope)
                    # the partner's turn took another way than a Decode / Prefill (a speculative
                    # round): the held command runs now; a Release keeps the hold (its turn goes on)
                    from_partner = held is not None and envelope.source == PARTNER.get(held.source or "")
                    if from_partner and not isinstance(envelope.command, Release):
                        await self._run_held()
        if self._held is not None:  # never: its stage waits for the reply, so the inbox cannot end
            await self._run_held()

    async def _run_held(self) -> None:
        held, self._held = self._held, None
        assert held is not None
        await self._run(held)

    def _worth_holding(self, envelope: Envelope) -> bool:
        """A Decode or Prefill whose partner stage is busy: its next command may join it."""
        if self.pairing is None or not isinstance(envelope.command, (Decode, Prefill)):
            return False
        partner = PARTNER.get(envelope.source or "")
        return partner is not None and self.pairing.busy[partner]

    async def _run(self, envelope: Envelope) -> None:
        """Run one command; answer it."""
        assert envelope.command is not None, "a notice carries no command"
        outcome = await self._execute(envelope.command)
        self._answer(envelope, outcome)
        if outcome.changed:
            self._on_change()

    async def _run_mixed(self, mixed: Mixed, *envelopes: Envelope) -> None:
        """Run the mixed step two envelopes' commands make; answer each with its part's outcome."""
        outcome = await self._execute(mixed)
        parts = dict(zip((mixed.decode, mixed.prefill), split(outcome)))
        for envelope in envelopes:
            self._answer(envelope, parts[envelope.command])
        if outcome.changed:
            self._on_change()

    async def _execute(self, command: Command) -> Outcome:
        stats = self._inbox.statistics()
        idle = stats.current_buffer_used == 0 and stats.tasks_waiting_send == 0 and self._held is None
        outcome, snapshot = await self._thread.run(self._in_thread, command, idle)
        self.num_commands += len(_parts(command))
        self.busy_s += outcome.seconds
        if snapshot is not None:
            self.snapshot = snapshot
        return outcome

    def _in_thread(self, command: Command, idle: bool) -> tuple[Outcome, dict[str, object] | None]:
        """In the worker thread: the command, then (if anything changed) fresh statistics."""
        outcome = self.executor.run(command, idle=idle)
        for part in _parts(command):
            self.batches.record(part, len(self.executor.seqs))
        return outcome, (self.executor.stats() if outcome.changed else None)

    @staticmethod
    def _answer(envelope: Envelope, outcome: Outcome) -> None:
        assert envelope.reply is not None, "a notice wants no answer"
        with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            envelope.reply.send_nowait(outcome)  # the caller may have been cancelled
        envelope.reply.close()


def _parts(command: Command) -> tuple[Command, ...]:
    """The stages' commands ``command`` answers: a mixed step's two parts, else itself."""
    return (command.decode, command.prefill) if isinstance(command, Mixed) else (command,)


def _mixed(held: Envelope, envelope: Envelope) -> Mixed | None:
    """The mixed step of the held command and its partner stage's (None: ``envelope`` is not it)."""
    if envelope.source != PARTNER.get(held.source or "") or held.command is None or envelope.command is None:
        return None
    return mix(held.command, envelope.command)
