"""Admission: the actor around the core's ``AdmissionPart`` (the queue and the choice of each batch).

It owns QUEUED requests. Its inbox brings new submissions (``Submit``), retracted requests
(``Requeue``, to the front) and ``Wake`` (memory changed, an abort). After each it runs one turn of
its part; an admitted batch goes to the prefill stage (one hand-off at a time). When the head of the
queue does not fit, it sleeps until memory changes.

The inbox is not bounded by its buffer: submissions are bounded by the engine's submission slots
(``queue_size``; each is given back here when its ``Submit`` is read), and at most one ``Requeue`` per
admitted request (at most ``max_running_requests``) and one ``Wake`` can be waiting, so a sender never
blocks on it (the decode stage sends retractions upstream without waiting).
"""

from __future__ import annotations

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.messages import PrefillBatch, Requeue, StageMessage, Submit, Wake
from pipeline.scheduler import AdmissionPart, end
from pipeline.stages import absorb, drive
from pipeline.stages.context import StageContext
from pipeline.stages.executor_actor import ExecutorClient
from statemachines.request import AbortRequested


class AdmissionStage:
    name = "admission"

    def __init__(
        self,
        ctx: StageContext,
        part: AdmissionPart,
        client: ExecutorClient,
        inbox: MemoryObjectReceiveStream[StageMessage],
        prefill_out: MemoryObjectSendStream[PrefillBatch],
        slots: anyio.Semaphore,
    ) -> None:
        self.ctx = ctx
        self.part = part
        self._client = client
        self._inbox = inbox
        self._prefill_out = prefill_out
        self._slots = slots  # submission slots: one is given back per Submit taken from the inbox

    async def run(self) -> None:
        async with self._inbox, self._prefill_out, self._client:
            while await absorb(self._inbox, self._accept, self._has_work):
                handoff = await drive(self.part.turn(), self._client)
                self.ctx.settle(handoff)
                if handoff.onward:
                    await self._prefill_out.send(PrefillBatch(tuple(handoff.onward)))
                elif self.part.waiting_for_memory:
                    self.ctx.waker.want(self.name)
            # the engine closes its ends only once nothing is live; anything left is aborted
            leftover = list(self.part.queue)
            self.part.remove({r.request_id for r in leftover})
            turn = end([(r, AbortRequested()) for r in leftover], self.name)
            self.ctx.settle(await drive(turn, self._client))

    def _has_work(self) -> bool:
        part = self.part
        return bool(part.queue) and (not part.waiting_for_memory or bool(self.ctx.aborts.among(part.queue)))

    def _accept(self, message: StageMessage) -> None:
        match message:
            case Submit(request=req):
                self._slots.release()
                self.part.push(req)
            case Requeue(requests=reqs):
                self.part.requeue(reqs)
                self.part.waiting_for_memory = False  # they released memory: look again
            case Wake():
                self.ctx.waker.heard(self.name)
                self.part.waiting_for_memory = False
            case _:
                raise TypeError(f"admission cannot take {message!r}")
