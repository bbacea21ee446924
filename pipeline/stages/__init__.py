"""The engine's actors: admission, prefill, staging, decode, and the executor actor that owns the device.

Each stage owns one part of the scheduling core (``pipeline/scheduler.py``) and runs its turns: it
moves messages in and out, sends the part's commands to the executor actor, and passes the part's
hand-offs to the next stage. No stage decides anything itself, and none calls into another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from pipeline.scheduler import Handoff, Turn
from pipeline.stages.executor_actor import ExecutorClient

_M = TypeVar("_M")  # the messages of one inbox


def drain(inbox: MemoryObjectReceiveStream[_M]) -> Iterator[_M]:
    """Every message already waiting in ``inbox``, without blocking."""
    while True:
        try:
            yield inbox.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream):
            return


async def absorb(
    inbox: MemoryObjectReceiveStream[_M],
    accept: Callable[[_M], None],
    has_work: Callable[[], bool],
    before_wait: Callable[[], None] | None = None,
) -> bool:
    """A stage's wait: with nothing to do, wait for one message (``before_wait`` is called first);
    then take every message already waiting. False once the inbox has ended (the stage ends)."""
    if not has_work():
        if before_wait is not None:
            before_wait()
        try:
            accept(await inbox.receive())
        except anyio.EndOfStream:
            return False
    for message in drain(inbox):
        accept(message)
    return True


async def drive(turn: Turn, client: ExecutorClient) -> Handoff:
    """Run one turn of a core part: each command it yields goes to the executor actor, each outcome
    back into the turn, until the turn returns its hand-off."""
    try:
        command = next(turn)
        while True:
            command = turn.send(await client.call(command))
    except StopIteration as stop:
        return stop.value
