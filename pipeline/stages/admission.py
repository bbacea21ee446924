"""Admission: the queue of requests waiting for memory, and the choice of the next prefill batch.

Policy (the synchronous driver's): take requests from the head of the queue, in order, while the
prefill token budget allows (the first one always), while each one's prompt fits the free memory
(device, logical and host pages, judged by the executor's ``can_admit``) and while request rows are
free; stop at the first that does not fit, so nobody overtakes the head. Retracted requests go back
to the front, with their output kept (they prefill ``known_tokens()``).

One prefill batch is in flight at a time: the next is chosen only after the prefill stage reports
the previous one done, so the memory it judges already includes the last prefill.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator, Sequence

import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.messages import AdmitAnswer, CanAdmit, PrefillBatch, StageMessage, Submit, Wake
from pipeline.request import Request
from pipeline.stages import drain
from pipeline.stages.context import StageContext, apply
from pipeline.stages.executor_actor import ExecutorClient
from statemachines.request import AbortRequested, Admitted


@attrs.define(eq=False)
class AdmissionQueue:
    """FIFO of QUEUED requests (no awaits: the policy, testable on its own)."""

    max_prefill_tokens: int  # a prefill batch's token budget (a longer head request still goes alone)
    _queue: collections.deque[Request] = attrs.field(factory=collections.deque)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def push(self, req: Request) -> None:
        self._queue.append(req)

    def requeue(self, reqs: Sequence[Request]) -> None:
        """Back to the front, keeping their order."""
        self._queue.extendleft(reversed(reqs))

    def remove(self, request_ids: set[str]) -> None:
        self._queue = collections.deque(r for r in self._queue if r.request_id not in request_ids)

    def candidates(self) -> list[Request]:
        """The head requests the token budget allows in one prefill (at least the first)."""
        chosen: list[Request] = []
        budget = self.max_prefill_tokens
        for req in self._queue:
            need = len(req.known_tokens())
            if chosen and need > budget:
                break
            chosen.append(req)
            budget -= need
        return chosen

    def take(self, candidates: list[Request], answer: AdmitAnswer) -> list[Request]:
        """Remove and return the candidates that form the batch: the longest prefix whose members
        each fit (``answer.fits``), at most ``answer.free_rows`` of them."""
        count = 0
        for fits in answer.fits:
            if not fits or count >= answer.free_rows:
                break
            count += 1
        batch = candidates[:count]
        self.remove({r.request_id for r in batch})
        return batch


class AdmissionStage:
    """Owns QUEUED requests; sends admitted batches to the prefill stage."""

    name = "admission"

    def __init__(
        self,
        ctx: StageContext,
        client: ExecutorClient,
        inbox: MemoryObjectReceiveStream[StageMessage],
        prefill_out: MemoryObjectSendStream[PrefillBatch],
        max_prefill_tokens: int,
    ) -> None:
        self.ctx = ctx
        self.queue = AdmissionQueue(max_prefill_tokens)
        self._client = client
        self._inbox = inbox
        self._prefill_out = prefill_out
        self._prefill_in_flight = False

    # --- called by later stages (same event loop, no await) ---------------------------------------

    def requeue(self, reqs: Sequence[Request]) -> None:
        self.queue.requeue(reqs)

    def prefill_done(self) -> None:
        self._prefill_in_flight = False
        self.ctx.bells.ring(self.name, reason="prefill-done")

    # --- the actor ---------------------------------------------------------------------------------

    async def run(self) -> None:
        async with self._inbox, self._prefill_out, self._client:
            async for message in self._inbox:
                self._accept(message)
                for more in drain(self._inbox):
                    self._accept(more)
                await self._admit()
            # the engine closes its ends only once nothing is live; anything left is aborted
            leftover = list(self.queue)
            self.queue.remove({r.request_id for r in leftover})
            await self.ctx.end(self._client, [(r, AbortRequested()) for r in leftover], self.name)

    def _accept(self, message: StageMessage) -> None:
        match message:
            case Submit(request=req):
                self.queue.push(req)
            case Wake():
                self.ctx.bells.heard(self.name)

    async def _admit(self) -> None:
        ctx = self.ctx
        aborted = await ctx.take_aborts(self._client, list(self.queue), self.name)
        self.queue.remove(aborted)
        while not self._prefill_in_flight and len(self.queue):
            candidates = self.queue.candidates()
            if not candidates:
                return
            outcome = await self._client.call(CanAdmit(tuple(len(r.known_tokens()) for r in candidates)))
            if outcome.error is not None:
                self.queue.remove({r.request_id for r in candidates})
                await ctx.fail(self._client, candidates, outcome.error, self.name)
                continue
            batch = self.queue.take(candidates, outcome.result)
            if not batch:
                return  # memory is short: a Wake comes when it changes
            now = time.monotonic()
            for req in batch:
                if req.metrics.scheduled_time is None:
                    req.metrics.scheduled_time = now
                apply(req, Admitted(), self.name, batch_size=len(batch), queued=len(self.queue))
            self._prefill_in_flight = True
            await self._prefill_out.send(PrefillBatch(tuple(batch)))
            aborted = await ctx.take_aborts(self._client, list(self.queue), self.name)
            self.queue.remove(aborted)
