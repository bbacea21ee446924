"""Prefill: the actor around the core's ``PrefillPart``; owns requests in PREFILL.

Admitted batches join its part; while the part holds requests it runs one turn after another (one
prefill forward each: a chunk of each head prompt) and hands the requests whose prompt is done to
the staging stage. Each turn is one executor command, so the decode stage's commands run between
the chunks of a long prompt, or (mixed steps) a chunk runs in the decode step's forward: the stage
is *busy* (``Pairing``) from a turn's start until it waits for anything but the executor.
"""

from __future__ import annotations

from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.messages import PrefillBatch, Staged
from pipeline.scheduler import PrefillPart, end
from pipeline.stages import absorb, drive
from pipeline.stages.context import StageContext
from pipeline.stages.executor_actor import ExecutorClient
from statemachines.request import AbortRequested


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
            # busy (``Pairing``) from a turn's start until the stage waits: the actor may hold a
            # decode step for this stage's next Prefill meanwhile
            while await absorb(self._inbox, self._accept, lambda: len(self.part) > 0, self._client.pause):
                self._client.busy()
                handoff = await drive(self.part.turn(), self._client)
                self.ctx.settle(handoff)
                if handoff.onward:
                    self._client.pause()  # staging may be slow to take them
                    await self._staging_out.send(Staged(tuple(handoff.onward)))
            # the engine closes its ends only once nothing is live; anything left is aborted
            leftover = list(self.part.owned.values())
            for req in leftover:
                self.part.remove(req.request_id)
            turn = end([(r, AbortRequested()) for r in leftover], self.name)
            self.ctx.settle(await drive(turn, self._client))

    def _accept(self, message: PrefillBatch) -> None:
        match message:
            case PrefillBatch(requests=reqs):
                self.part.accept(reqs)
            case _:
                raise TypeError(f"prefill cannot take {message!r}")
