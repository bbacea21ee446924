"""Decode: the running batch, stepped back to back (continuous batching).

Between two steps, requests that became READY join the batch (``JoinedBatch``) and pending aborts
are applied. A step is one plain decode (``StepDone`` or ``Finished``) or, in speculative mode, one
round: ``DraftStarted`` -> draft -> ``DraftDone`` -> [aborts] -> verify -> ``Verified`` or
``Finished``. A request the executor cannot grow is retracted to the queue (its output kept); one
the executor reports failed ends FAILED with the reason, the others go on.

With ``max_undelivered_tokens`` set, a request whose consumer lags that far behind is parked: it
stays in the batch with its memory but is left out of steps until its consumer reads.
"""

from __future__ import annotations

import anyio
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream

from pipeline.executor import StepResult
from pipeline.messages import Decode, Draft, Outcome, Ready, StageMessage, Verify, Wake
from pipeline.request import Request
from pipeline.stages import drain
from pipeline.stages.context import StageContext, apply, figures_of
from pipeline.stages.executor_actor import ExecutorClient
from statemachines.request import (
    Crashed,
    DraftDone,
    DraftStarted,
    Event,
    Finished,
    JoinedBatch,
    StepDone,
    Verified,
)


@attrs.define(eq=False)
class DecodeBatch:
    """The running batch, in join order (no awaits)."""

    members: dict[str, Request] = attrs.field(factory=dict)

    def __len__(self) -> int:
        return len(self.members)

    def join(self, req: Request) -> None:
        self.members[req.request_id] = req

    def pop(self, request_ids) -> list[Request]:
        return [self.members.pop(rid) for rid in request_ids if rid in self.members]

    def get(self, request_ids) -> list[Request]:
        return [self.members[rid] for rid in request_ids]


def settle(
    batch: DecodeBatch, result: StepResult, *, num_draft_steps: int | None, figures: dict[str, float]
) -> list[tuple[Request, Event]]:
    """Append each request's committed tokens and apply ``StepDone`` (plain) or ``Verified``
    (speculative, ``num_draft_steps`` given) with the step's figures; returns the requests that
    end instead, each with its terminal event (to apply once their memory is released)."""
    ending: list[tuple[Request, Event]] = []
    for rid, tokens in result.tokens.items():
        req = batch.members[rid]
        if num_draft_steps is not None:
            req.record_verify(result.accepted[rid], num_draft_steps)
        reason = req.append(tokens)
        if reason is not None:
            ending.append((req, Finished(reason)))
        elif num_draft_steps is None:
            apply(req, StepDone(), DecodeStage.name, **figures)
        else:
            apply(req, Verified(accepted=len(tokens)), DecodeStage.name, **figures)
    for rid, why in result.failed.items():
        ending.append((batch.members[rid], Crashed(why)))
    return ending


class DecodeStage:
    """Owns requests in READY, DECODE, DRAFT and VERIFY."""

    name = "decode"

    def __init__(
        self, ctx: StageContext, client: ExecutorClient, inbox: MemoryObjectReceiveStream[StageMessage]
    ) -> None:
        self.ctx = ctx
        self.batch = DecodeBatch()
        self._client = client
        self._inbox = inbox

    async def run(self) -> None:
        async with self._inbox, self._client:
            while True:
                if not self._runnable():
                    try:
                        self._accept(await self._inbox.receive())
                    except anyio.EndOfStream:
                        break
                self._accept()
                aborted = await self.ctx.take_aborts(self._client, list(self.batch.members.values()), self.name)
                self.batch.pop(aborted)
                runnable = self._runnable()
                if runnable:
                    await (self._speculate(runnable) if self.ctx.speculative else self._decode(runnable))

    def _runnable(self) -> list[Request]:
        return [r for r in self.batch.members.values() if not self.ctx.is_parked(r)]

    def _accept(self, *messages: StageMessage) -> None:
        for item in (*messages, *drain(self._inbox)):
            match item:
                case Ready(requests=reqs):
                    for req in reqs:
                        self.batch.join(req)
                        apply(req, JoinedBatch(), self.name, batch_size=len(self.batch))
                case Wake():
                    self.ctx.bells.heard(self.name)

    async def _decode(self, reqs: list[Request]) -> None:
        outcome = await self._client.call(Decode(tuple(r.request_id for r in reqs)))
        if not await self._usable(outcome, reqs):
            return
        result: StepResult = outcome.result
        await self.ctx.retract(self._client, self.batch.pop(result.refused), self.name)
        figures = figures_of(outcome, len(result.tokens))
        ending = settle(self.batch, result, num_draft_steps=None, figures=figures)
        await self._finish(result, ending)

    async def _speculate(self, reqs: list[Request]) -> None:
        ctx = self.ctx

        def start(ids: tuple[str, ...]) -> None:  # on the event loop, while the executor waits
            for req in self.batch.get(ids):
                apply(req, DraftStarted(), self.name, batch_size=len(ids))

        outcome = await self._client.call(Draft(tuple(r.request_id for r in reqs), start))
        if not await self._usable(outcome, reqs):
            return
        await ctx.retract(self._client, self.batch.pop(outcome.result.refused), self.name)
        drafted = [r for r in reqs if r.request_id in self.batch.members]
        for req in drafted:
            apply(req, DraftDone(num_drafts=ctx.num_draft_steps), self.name, batch_size=len(drafted))
        # an abort that arrived while drafting takes effect here, between draft and verify
        aborted = await ctx.take_aborts(self._client, drafted, self.name)
        self.batch.pop(aborted)
        drafted = [r for r in drafted if r.request_id not in aborted]
        if not drafted:
            return
        outcome = await self._client.call(Verify(tuple(r.request_id for r in drafted)))
        if not await self._usable(outcome, drafted):
            return
        result: StepResult = outcome.result
        figures = figures_of(outcome, len(drafted))
        ending = settle(self.batch, result, num_draft_steps=ctx.num_draft_steps, figures=figures)
        await self._finish(result, ending)

    async def _usable(self, outcome: Outcome, reqs: list[Request]) -> bool:
        """False (and the requests failed) when the command raised."""
        if outcome.error is None:
            return True
        await self.ctx.fail(self._client, self.batch.pop(r.request_id for r in reqs), outcome.error, self.name)
        return False

    async def _finish(self, result: StepResult, ending: list[tuple[Request, Event]]) -> None:
        self.batch.pop(r.request_id for r, _ in ending)
        await self.ctx.end(self._client, ending, self.name)
        for rid in result.tokens:
            self.ctx.registry.notify(rid)
