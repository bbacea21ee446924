"""Prefill: the actor around the core's ``PrefillPart``; owns requests in PREFILL.

For each admitted batch it runs one turn (the forward, the first tokens, the start of staging) and
hands the requests that go on to the staging stage.
"""

from __future__ import annotations

from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.messages import PrefillBatch, Staged
from pipeline.scheduler import PrefillPart
from pipeline.stages import drive
from pipeline.stages.context import StageContext
from pipeline.stages.executor_actor import ExecutorClient


class PrefillStage:
    name = "prefill"

    def __init__(
        self,
        ctx: StageContext,
        part: PrefillPart,
        client: ExecutorClient,
        inbox: MemoryObjectReceiveStream[PrefillBatch],
        staging_out: MemoryObjectSendStream[Staged],
    ) -> None:
        self.ctx = ctx
        self.part = part
        self._client = client
        self._inbox = inbox
        self._staging_out = staging_out

    async def run(self) -> None:
        async with self._inbox, self._staging_out, self._client:
            async for batch in self._inbox:
                match batch:
                    case PrefillBatch(requests=reqs):
                        handoff = await drive(self.part.turn(list(reqs)), self._client)
                    case _:
                        raise TypeError(f"prefill cannot take {batch!r}")
                self.ctx.settle(handoff)
                if handoff.onward:
                    await self._staging_out.send(Staged(tuple(handoff.onward)))
