"""Staging: waits for each prefilled request's KV copy to reach the host pool, then hands it to the
decode stage with its device buffer (``StagingDone``, READY), in the FIFO order of the copies.

The copies overlap with decode steps. The stage polls ``CollectReady``; while other commands wait
for the device, a poll does not block, and the stage polls again behind them (at most one poll per
other command). When the device has nothing else to do, the poll waits for the copies itself, so
what is still staging afterwards waits for memory: the stage then sleeps until a ``Wake``.
"""

from __future__ import annotations

from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.messages import CollectReady, Ready, ReadyAnswer, Staged, StageMessage, Wake
from pipeline.request import Request
from pipeline.stages import drain
from pipeline.stages.context import StageContext, apply
from pipeline.stages.executor_actor import ExecutorClient
from statemachines.request import StagingDone


class StagingStage:
    """Owns requests in STAGING."""

    name = "staging"

    def __init__(
        self,
        ctx: StageContext,
        client: ExecutorClient,
        inbox: MemoryObjectReceiveStream[StageMessage],
        decode_out: MemoryObjectSendStream[Ready],
    ) -> None:
        self.ctx = ctx
        self._client = client
        self._inbox = inbox
        self._decode_out = decode_out
        self.owned: dict[str, Request] = {}  # staging requests, in the order they arrived
        # ids the executor reported ready before their Staged message arrived here
        self._early: set[str] = set()

    def is_waiting(self) -> bool:
        """Some request here waits for its copy or for memory."""
        return bool(self.owned or self._early)

    async def run(self) -> None:
        async with self._inbox, self._decode_out, self._client:
            async for message in self._inbox:
                self._accept(message)
                await self._collect()

    def _accept(self, *messages: StageMessage) -> None:
        """Take ``messages`` and whatever else already waits in the inbox."""
        for item in (*messages, *drain(self._inbox)):
            match item:
                case Staged(requests=reqs):
                    self.owned.update((r.request_id, r) for r in reqs)
                case Wake():
                    self.ctx.bells.heard(self.name)

    async def _collect(self) -> None:
        ctx, client = self.ctx, self._client
        while self.owned:
            for rid in await ctx.take_aborts(client, list(self.owned.values()), self.name):
                self.owned.pop(rid)
            ready = [self.owned.pop(rid) for rid in list(self._early) if rid in self.owned]
            self._early.intersection_update(ctx.registry.live)
            self._early.difference_update(r.request_id for r in ready)
            answer = None
            if self.owned:
                outcome = await client.call(CollectReady())
                if outcome.error is not None:
                    doomed, self.owned = list(self.owned.values()), {}
                    await ctx.fail(client, doomed, outcome.error, self.name)
                    return
                answer = outcome.result
                ready += self._claim(answer)
            # an abort that arrived during the poll ends the request from STAGING
            aborted = await ctx.take_aborts(client, ready, self.name)
            ready = [r for r in ready if r.request_id not in aborted]
            for req in ready:
                apply(req, StagingDone(), self.name)
            if ready:
                await self._decode_out.send(Ready(tuple(ready)))
            self._accept()
            if answer is not None and not answer.ready and answer.waited:
                return  # copies landed; what is left waits for memory (a Wake comes when it frees)

    def _claim(self, answer: ReadyAnswer) -> list[Request]:
        ready = []
        for rid in answer.ready:
            req = self.owned.pop(rid, None)
            if req is None:
                self._early.add(rid)
            else:
                ready.append(req)
        return ready
