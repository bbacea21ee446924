"""Staging: the actor around the core's ``StagingPart``; owns requests in STAGING.

It polls ``CollectReady`` and hands the requests whose copy landed to the decode stage (READY), in
the FIFO order of the copies. The copies overlap with decode steps: while other commands wait for
the device, a poll does not block, and the stage polls again behind them (at most one poll per other
command); when the device has nothing else to do, the poll waits for the copies itself.
"""

from __future__ import annotations

from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.messages import Ready, Staged, StageMessage, Wake
from pipeline.scheduler import StagingPart
from pipeline.stages import absorb, drive
from pipeline.stages.context import StageContext
from pipeline.stages.executor_actor import ExecutorClient


class StagingStage:
    name = "staging"

    def __init__(
        self,
        ctx: StageContext,
        part: StagingPart,
        client: ExecutorClient,
        inbox: MemoryObjectReceiveStream[StageMessage],
        decode_out: MemoryObjectSendStream[Ready],
    ) -> None:
        self.ctx = ctx
        self.part = part
        self._client = client
        self._inbox = inbox
        self._decode_out = decode_out

    async def run(self) -> None:
        async with self._inbox, self._decode_out, self._client:
            while await absorb(self._inbox, self._accept, self._has_work):
                handoff = await drive(self.part.turn(), self._client)
                self.ctx.settle(handoff)
                if handoff.onward:
                    await self._decode_out.send(Ready(tuple(handoff.onward)))
                if self.part.waiting_for_memory:
                    self.ctx.waker.want(self.name)

    def _has_work(self) -> bool:
        return bool(self.part.owned) and not self.part.waiting_for_memory

    def _accept(self, message: StageMessage) -> None:
        match message:
            case Staged(requests=reqs):
                self.part.accept(reqs)
            case Wake():
                self.ctx.waker.heard(self.name)
                self.part.waiting_for_memory = False
            case _:
                raise TypeError(f"staging cannot take {message!r}")
