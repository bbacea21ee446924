"""One data-parallel replica as the server sees it: its process, its channel, its status.

``ReplicaClient.run`` reads the replica's frames until its channel closes, handing each to the
engine (``on_message``); then it reaps the process and reports the end once (``on_end``). Status::

    STARTING --Ready--> SERVING --Stopped--> STOPPED     (told to stop; its pool counts reported)
        |                  |
        +------------------+--(channel closed)--> LOST   (its process ended without being told to,
                                                          or did not start)

A replica's channel closes when its process ends, however it ends (its end of the socket lives in
that process only), so a killed replica is seen at once, never waited for.
"""

from __future__ import annotations

import enum
import signal
import socket
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import anyio
import attrs
import structlog

from pipeline.distributed.group import START_TIMEOUT_S
from pipeline.server.generation import ApiError
from pipeline.server.replica_worker import FrameChannel, Ready, ReplicaSetup, Stop, Stopped, replica_main

log = structlog.get_logger("hispec.server")

JOIN_TIMEOUT_S = 10.0  # how long an ended replica's process gets to be reaped


class ReplicaStatus(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    STOPPED = "stopped"
    LOST = "lost"


def lost_error(index: int, reason: str) -> ApiError:
    """What a request that was running on a replica that went gets (a 503 naming the replica)."""
    return ApiError(
        f"replica {index} stopped serving ({reason}); the request was lost",
        status=503,
        type="service_unavailable",
        code="replica_lost",
    )


@attrs.define(eq=False)
class ReplicaClient:
    """The server's end of one replica (``multiprocessing.Process``-like ``process``: ``exitcode``,
    ``is_alive``, ``join``, ``kill``)."""

    index: int
    process: Any
    sock: socket.socket | None  # the server's end of the socket, until ``run`` wraps it
    status: ReplicaStatus = ReplicaStatus.STARTING
    channel: FrameChannel | None = None
    ready: Ready | None = None  # its start-up figures, once it serves
    lost_reason: str | None = None  # set when it becomes LOST
    stats: dict[str, Any] | None = None  # the last figures it answered (the engine sets them)
    final_pool_counts: dict[str, int] | None = None  # reported with Stopped
    started: anyio.Event = attrs.Factory(anyio.Event)  # set once it serves, or has ended
    ended: anyio.Event = attrs.Factory(anyio.Event)  # set once its end has been reported

    @property
    def serving(self) -> bool:
        return self.status is ReplicaStatus.SERVING

    async def run(
        self,
        on_message: Callable[[ReplicaClient, object], None],
        on_end: Callable[[ReplicaClient], None],
    ) -> None:
        """Read frames until the channel closes (``on_message`` for each but ``Ready`` and
        ``Stopped``); then reap the process and call ``on_end`` once, the status final."""
        assert self.sock is not None, "a replica's socket is wrapped once"
        self.channel = channel = await FrameChannel.open(self.sock)
        self.sock = None
        try:
            first = None
            # a replica not started within a tensor-parallel group's bound to start failed to start
            with anyio.move_on_after(START_TIMEOUT_S) as waited:
                first = await _first_frame(channel)
            if waited.cancelled_caught:
                self.lost_reason = f"it did not start in {START_TIMEOUT_S:.0f} s"
            if isinstance(first, Ready):
                self.ready = first
                self.status = ReplicaStatus.SERVING
                self.started.set()
                async for message in channel:
                    if isinstance(message, Stopped):
                        self.final_pool_counts = message.final_pool_counts
                        self.status = ReplicaStatus.STOPPED
                    else:
                        on_message(self, message)
        finally:
            with anyio.CancelScope(shield=True):
                await channel.aclose()
                await anyio.to_thread.run_sync(self.process.join, JOIN_TIMEOUT_S)
            if self.status is not ReplicaStatus.STOPPED:
                self.status = ReplicaStatus.LOST
                self.lost_reason = self.lost_reason or self._describe_exit()
                log.error("server.replica_lost", replica=self.index, reason=self.lost_reason)
            on_end(self)
            self.started.set()
            self.ended.set()

    async def send(self, message: object) -> None:
        """Send a frame; ``ApiError`` (503 naming the replica) if it is not serving or its
        connection broke (its reader then sees it end)."""
        if not self.serving or self.channel is None:
            raise lost_error(self.index, self.lost_reason or f"it is {self.status.value}")
        try:
            await self.channel.send(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise lost_error(self.index, f"its connection broke: {exc}") from exc

    async def stop(self) -> None:
        """Ask it to stop (nothing if it has ended already)."""
        if self.status in (ReplicaStatus.STARTING, ReplicaStatus.SERVING) and self.channel is not None:
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                await self.channel.send(Stop())

    def _describe_exit(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "its connection closed"
        if code < 0:
            return f"its process was killed by {signal.Signals(-code).name}"
        return f"its process exited with status {code}"


async def _first_frame(channel: FrameChannel) -> object:
    try:
        return await channel.receive()
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
        return None


def start_process(setup: ReplicaSetup, sock: socket.socket) -> Any:
    """A replica in a process of its own (spawned, as tensor-parallel ranks are)."""
    import torch.multiprocessing as mp

    # not a daemon: a replica with tensor parallelism starts rank processes of its own; should the
    # server die first, the replica sees its socket close and stops itself
    process = mp.get_context("spawn").Process(
        target=replica_main, args=(setup, sock), name=f"hispec-dp{setup.index}", daemon=False
    )
    process.start()
    sock.close()  # the replica's end lives in its process only: its death closes the socket
    return process


def join_all(processes: list[Any]) -> None:
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
