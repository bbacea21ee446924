"""Decode: the actor around the core's ``DecodePart`` (the running batch); owns requests in READY,
DECODE, DRAFT and VERIFY.

Between two steps (or speculative rounds), requests that became READY join the batch and pending
aborts are applied; requests the executor could not grow go back to admission as ``Requeue`` (sent
without waiting: admission's inbox always has room for them).

With ``max_undelivered_tokens`` set, a request whose consumer lags that far behind is parked: it
stays in the batch with its memory but is left out of steps until its consumer reads.
"""

from __future__ import annotations

from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.messages import Ready, Requeue, StageMessage, Wake
from pipeline.request import Request
from pipeline.scheduler import DecodePart
from pipeline.stages import absorb, drive
from pipeline.stages.context import StageContext
from pipeline.stages.executor_actor import ExecutorClient


class DecodeStage:
    name = "decode"

    def __init__(
        self,
        ctx: StageContext,
        part: DecodePart,
        client: ExecutorClient,
        inbox: MemoryObjectReceiveStream[StageMessage],
        requeue_out: MemoryObjectSendStream[StageMessage],
    ) -> None:
        self.ctx = ctx
        self.part = part
        self._client = client
        self._inbox = inbox
        self._requeue_out = requeue_out  # admission's inbox; owned (and closed) by the engine

    async def run(self) -> None:
        async with self._inbox, self._client:
            # busy (``Pairing``) from a turn's start until the stage waits: the actor may hold a
            # prefill chunk for this stage's next Decode meanwhile
            while await absorb(self._inbox, self._accept, self._has_work, self._client.pause):
                if not self._has_work():
                    continue
                self._client.busy()
                handoff = await drive(self.part.turn(self._runnable()), self._client)
                self.ctx.settle(handoff)
                if handoff.requeue:
                    self._requeue_out.send_nowait(Requeue(tuple(handoff.requeue)))

    def _runnable(self) -> list[Request]:
        return [r for r in self.part.members.values() if not self.ctx.is_parked(r)]

    def _has_work(self) -> bool:
        return bool(self._runnable()) or bool(self.ctx.aborts.among(self.part.members.values()))

    def _accept(self, message: StageMessage) -> None:
        match message:
            case Ready(requests=reqs):
                self.part.accept(reqs)
            case Wake():
                self.ctx.waker.heard(self.name)
            case _:
                raise TypeError(f"decode cannot take {message!r}")
