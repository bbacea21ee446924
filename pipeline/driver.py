"""The synchronous driver: the executor's commands in a plain loop, no asyncio.

Each iteration: admit queued requests into one prefill (in arrival order, while memory allows),
collect the requests whose staging finished, then run one decode step (plain) or one draft + verify
round (speculative) over every decoding request, and end the requests that finished. It is the
oracle and the baseline of the async engine, and what the tests drive directly.
"""

from __future__ import annotations

import collections
import itertools

from pipeline.executor import Executor, NewSequence
from pipeline.request import Request
from pipeline.sampling import SamplingParams
from statemachines.request import (
    AbortRequested,
    Admitted,
    Crashed,
    DraftDone,
    DraftStarted,
    Event,
    Finished,
    FinishedAtPrefill,
    JoinedBatch,
    PrefillDone,
    Retracted,
    StagingDone,
    State,
    StepDone,
    Verified,
)


class SyncDriver:
    """Runs requests to completion on one executor; ``check`` verifies every invariant each step."""

    def __init__(self, executor: Executor, *, max_prefill_tokens: int = 8192, check: bool = False) -> None:
        self.executor = executor
        self.max_prefill_tokens = max_prefill_tokens
        self.check = check
        self.requests: dict[str, Request] = {}
        self._queue: collections.deque[str] = collections.deque()
        self._ids = itertools.count()

    @property
    def speculative(self) -> bool:
        return self.executor.config.speculative is not None

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        """Queue a request; raises ``RequestError`` (nothing queued) if it is invalid."""
        self.executor.validate(prompt_ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(
            rid, tuple(prompt_ids), params, self.executor.tokenizer, self.executor.config.max_context_len
        )
        self.requests[rid] = req
        self._queue.append(rid)
        return req

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Request]:
        """Submit every prompt, run until all have ended, return them in submission order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.submit(p, sp) for p, sp in zip(prompts, plist)]
        self.run()
        return reqs

    def run(self) -> None:
        while self.step():
            pass

    def abort(self, request_id: str) -> None:
        """Abort in whatever state the request is; frees everything it owns."""
        req = self.requests[request_id]
        if req.is_finished:
            return
        if req.state is State.QUEUED and request_id in self._queue:
            self._queue.remove(request_id)
        self._end(req, AbortRequested(), "abort")

    def live(self, state: State) -> list[Request]:
        return [r for r in self.requests.values() if r.state is state]

    # --- one iteration ----------------------------------------------------------------------------

    def step(self) -> bool:
        """One scheduler iteration; False once nothing is left to do."""
        self._admit()
        # Synchronous: wait for the staging copies, so that which requests join which step does not
        # depend on copy timing (the async engine overlaps them instead).
        self.executor.wait_staging()
        for rid in self.executor.collect_ready():
            req = self.requests[rid]
            req.apply(StagingDone())
            req.apply(JoinedBatch())
        decoding = [r.request_id for r in self.live(State.DECODE)]
        if decoding:
            self._speculate(decoding) if self.speculative else self._decode(decoding)
        if self.check:
            self.executor.check_integrity()
        return any(not r.is_finished for r in self.requests.values())

    def _admit(self) -> None:
        batch: list[Request] = []
        budget = self.max_prefill_tokens
        while self._queue:
            req = self.requests[self._queue[0]]
            need = len(req.known_tokens())
            if (batch and need > budget) or not self.executor.can_admit(need):
                break
            self._queue.popleft()
            req.apply(Admitted())
            batch.append(req)
            budget -= need
        if not batch:
            return
        result = self.executor.prefill([NewSequence(r.request_id, r.known_tokens(), r.params) for r in batch])
        for req in batch:
            if req.request_id in result.refused:
                req.apply(Retracted())
                self._queue.appendleft(req.request_id)
                continue
            reason = req.append((result.first_tokens[req.request_id],))
            if reason is None:
                req.apply(PrefillDone())
            else:
                self._end(req, FinishedAtPrefill(reason), reason)

    def _decode(self, ids: list[str]) -> None:
        result = self.executor.decode(ids)
        self._retract(result.refused)
        for rid, tokens in result.tokens.items():
            req = self.requests[rid]
            reason = req.append(tokens)
            if reason is None:
                req.apply(StepDone())
            else:
                self._end(req, Finished(reason), reason)

    def _speculate(self, ids: list[str]) -> None:
        # room for the round first: a request that cannot grow is retracted while still in DECODE
        # (there is no way back to the queue from DRAFT)
        draft_tokens = self.executor.config.speculative.draft_tokens
        ids, refused = self.executor.reserve(ids, new_tokens=draft_tokens, speculative=True)
        self._retract(refused)
        for rid in ids:
            self.requests[rid].apply(DraftStarted())
        drafted = self.executor.draft(ids)
        self._retract(drafted.refused)
        runnable = [rid for rid in ids if rid not in drafted.refused]
        for rid in runnable:
            self.requests[rid].apply(DraftDone(num_drafts=self.executor.num_draft_steps))
        result = self.executor.verify(runnable)
        for rid, why in result.failed.items():
            req = self.requests[rid]
            req.error = why
            self._end(req, Crashed(why), "error")
        for rid, tokens in result.tokens.items():
            req = self.requests[rid]
            req.record_verify(result.accepted[rid], self.executor.num_draft_steps)
            reason = req.append(tokens)
            if reason is None:
                req.apply(Verified(accepted=len(tokens)))
            else:
                self._end(req, Finished(reason), reason)

    def _retract(self, request_ids: tuple[str, ...]) -> None:
        """Memory pressure: release, and queue again at the front (output kept)."""
        for rid in request_ids:
            req = self.requests[rid]
            self.executor.release(rid)
            req.apply(Retracted())
            req.metrics.num_retractions += 1
            self._queue.appendleft(rid)

    def _end(self, req: Request, event: Event, reason: str) -> None:
        self.executor.release(req.request_id)
        req.finish_reason = reason
        req.apply(event)
