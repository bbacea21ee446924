"""Prefill: runs each admitted batch on the executor and sorts the requests by what happened.

For each request of the batch, in the synchronous driver's terms:

* refused by the executor (memory changed since admission judged it): ``Retracted``, back to the
  front of the queue;
* its first token already ends it (EOS, stop string, ``max_new_tokens == 1``): ``FinishedAtPrefill``;
* an abort arrived meanwhile: ``AbortRequested``;
* otherwise ``PrefillDone``: its prompt KV is on its way to the host pool, and it goes to staging.
"""

from __future__ import annotations

from collections.abc import Callable

from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.executor import NewSequence, PrefillResult
from pipeline.messages import Outcome, Prefill, PrefillBatch, Staged
from pipeline.request import Request
from pipeline.stages.context import StageContext, apply, figures_of
from pipeline.stages.executor_actor import ExecutorClient
from statemachines.request import AbortRequested, Event, FinishedAtPrefill, PrefillDone


def sort_prefilled(
    reqs: list[Request], result: PrefillResult, is_aborted: Callable[[str], bool]
) -> tuple[list[Request], list[tuple[Request, Event]], list[Request]]:
    """(refused, ending with their terminal event, going on to staging); appends the first tokens."""
    refused_ids = set(result.refused)
    refused = [r for r in reqs if r.request_id in refused_ids]
    ending: list[tuple[Request, Event]] = []
    staged: list[Request] = []
    for req in reqs:
        if req.request_id in refused_ids:
            continue
        reason = req.append((result.first_tokens[req.request_id],))
        if reason is not None:
            ending.append((req, FinishedAtPrefill(reason)))
        elif is_aborted(req.request_id):
            ending.append((req, AbortRequested()))
        else:
            staged.append(req)
    return refused, ending, staged


class PrefillStage:
    """Owns requests in PREFILL; hands the staged ones to the staging stage."""

    name = "prefill"

    def __init__(
        self,
        ctx: StageContext,
        client: ExecutorClient,
        inbox: MemoryObjectReceiveStream[PrefillBatch],
        staging_out: MemoryObjectSendStream[Staged],
        on_done: Callable[[], None],
    ) -> None:
        self.ctx = ctx
        self._client = client
        self._inbox = inbox
        self._staging_out = staging_out
        self._on_done = on_done  # admission may choose the next batch

    async def run(self) -> None:
        async with self._inbox, self._staging_out, self._client:
            async for batch in self._inbox:
                try:
                    staged = await self._prefill(list(batch.requests))
                finally:
                    self._on_done()
                if staged:
                    await self._staging_out.send(Staged(tuple(staged)))

    async def _prefill(self, reqs: list[Request]) -> list[Request]:
        ctx, client = self.ctx, self._client
        aborted = await ctx.take_aborts(client, reqs, self.name)
        reqs = [r for r in reqs if r.request_id not in aborted]
        if not reqs:
            return []
        sequences = tuple(NewSequence(r.request_id, r.known_tokens(), r.params) for r in reqs)
        outcome: Outcome = await client.call(Prefill(sequences))
        if outcome.error is not None:
            await ctx.fail(client, reqs, outcome.error, self.name)
            return []
        refused, ending, staged = sort_prefilled(reqs, outcome.result, ctx.registry.pending_aborts.__contains__)
        # refused requests were never admitted by the executor: nothing to release
        await ctx.retract(client, refused, self.name, count=False, release=False)
        figures = figures_of(outcome, len(reqs) - len(refused))
        prefilled = {s.request_id: len(s.token_ids) for s in sequences}
        for req in staged:
            apply(req, PrefillDone(), self.name, prefill_tokens=prefilled[req.request_id], **figures)
        await ctx.end(client, ending, self.name)
        for req in reqs:
            ctx.registry.notify(req.request_id)
        return staged
