"""The synchronous driver: the scheduling core's turns in a plain loop, no asyncio.

Each iteration runs one turn of every part of the core in pipeline order (admission, prefill: one
forward, a chunk of each head prompt; staging, decode), executing their commands directly on the
executor, and passes each turn's hand-off to the next part. While requests decode and a prompt is
being prefilled (mixed steps on), the prefill and decode turns run side by side instead
(``scheduler.together``: their ``Decode`` and ``Prefill`` go out as one ``Mixed`` command), then
staging's turn. Staging copies are waited for before staging's turn, so which requests join which
step does not depend on copy timing (the async engine overlaps them instead). It is the oracle and
the baseline of the async engine, and what many tests drive directly.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from typing import TYPE_CHECKING, TypeVar

from pipeline.chunking import plan_chunks
from pipeline.executor_interface import CommandExecutor
from pipeline.messages import Command, NewSequence, Outcome, PrefillResult
from pipeline.request import Request
from pipeline.sampling import SamplingParams
from pipeline.scheduler import Handoff, Scheduler, SpecPolicy, end, together
from statemachines.request import AbortRequested, State

if TYPE_CHECKING:
    from pipeline.executor import Executor

# what a driven generator returns: one part's hand-off, or (turns side by side) each part's by name
Done = TypeVar("Done")


class SyncDriver:
    """Runs requests to completion on one executor; ``check`` verifies every invariant each step."""

    def __init__(
        self,
        executor: CommandExecutor,
        *,
        max_prefill_tokens: int = 8192,
        check: bool = False,
        spec_policy: SpecPolicy | None = None,
    ) -> None:
        """``spec_policy`` replaces the adaptive rule of the executor's ``SpeculativeConfig`` (tests)."""
        self.executor = executor
        self.check = check
        policy = spec_policy if spec_policy is not None else spec_policy_of(executor)
        # a prefill chunk shares its forward with the decode step (a ``Mixed`` command)
        self.mixes = executor.config.mixed_steps
        self.core = Scheduler.build(
            max_prefill_tokens=max_prefill_tokens,
            num_steps=executor.num_steps,
            policy=policy,
            chunk_tokens=executor.config.chunked_prefill_tokens,
            batch_tokens=executor.plan.prefill_budget,
            mixes=self.mixes,
        )
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()

    @property
    def speculative(self) -> bool:
        return self.executor.speculative

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        """Queue a request; raises ``RequestError`` (nothing queued) if it is invalid."""
        self.executor.validate(prompt_ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(
            rid, tuple(prompt_ids), params, self.executor.tokenizer, self.executor.plan.max_context_len
        )
        self.requests[rid] = req
        self.core.admission.push(req)
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
        """Abort in whatever state the request is: it ends at once, its memory released."""
        req = self.requests[request_id]
        if req.is_finished:
            return
        core = self.core
        core.admission.remove({request_id})
        core.prefill.remove(request_id)
        core.staging.owned.pop(request_id, None)
        core.decode.remove(request_id)
        self._drive(end([(req, AbortRequested())], "driver"))

    def live(self, state: State) -> list[Request]:
        return [r for r in self.requests.values() if r.state is state]

    # --- one iteration ----------------------------------------------------------------------------

    def step(self) -> bool:
        """One scheduler iteration; False once nothing is left to do."""
        core = self.core
        self._route(self._drive(core.admission.turn()), "admission")
        if self.mixes and len(core.prefill) and len(core.decode):  # one mixed step, then staging
            handoffs = self._drive(together({"prefill": core.prefill.turn(), "decode": core.decode.turn()}))
            for part in ("prefill", "decode"):
                self._route(handoffs[part], part)
            self.executor.wait_staging()
            self._route(self._drive(core.staging.turn()), "staging")
        else:
            if len(core.prefill):  # one prefill forward: a chunk of each head prompt
                self._route(self._drive(core.prefill.turn()), "prefill")
            self.executor.wait_staging()
            self._route(self._drive(core.staging.turn()), "staging")
            if len(core.decode):
                self._route(self._drive(core.decode.turn()), "decode")
        if self.check:
            self.check_integrity()
        return any(not r.is_finished for r in self.requests.values())

    def _drive(self, turn: Generator[Command, Outcome, Done]) -> Done:
        """Run a turn's commands on the executor until it returns its hand-off."""
        try:
            command = next(turn)
            while True:
                command = turn.send(self.executor.run(command))
        except StopIteration as stop:
            return stop.value

    def _route(self, handoff: Handoff, part: str) -> None:
        core = self.core
        for req in handoff.ended:
            core.aborts.discard(req.request_id)
        core.admission.requeue(handoff.requeue)
        if not handoff.onward:
            return
        if part == "admission":
            core.prefill.accept(handoff.onward)
        elif part == "prefill":
            core.staging.accept(handoff.onward)
        elif part == "staging":
            core.decode.accept(handoff.onward)
        else:
            raise AssertionError(f"{part} hands nothing onward")

    def check_integrity(self) -> None:
        live = [r for r in self.requests.values() if not r.is_finished]
        self.core.check_integrity(live)
        self.executor.check_integrity(states={r.request_id: r.state for r in live})


def spec_policy_of(executor: CommandExecutor) -> SpecPolicy:
    """The adaptive-speculation rule of the executor's configuration (inert without speculation)."""
    spec = executor.plan.speculative
    return SpecPolicy.from_config(spec, executor.config.device) if executor.speculative else SpecPolicy()


def prefill_whole(executor: Executor, sequences: list[NewSequence]) -> PrefillResult:
    """``Admit`` then every ``Prefill`` forward their prompts take on a local executor, in chunks of
    the config's ``chunked_prefill_tokens`` within the plan's ``prefill_budget`` (tests and
    benchmarks that step an executor by hand): the sequences that do not fit are left out of the
    result (neither in ``first_tokens`` nor in ``failed``)."""
    admitted = list(executor.admit(sequences).admitted)
    first: dict[str, int] = {}
    failed = {rid: why for rid, why in executor.failed_admissions.items() if rid in admitted}
    while True:
        pending = [
            (rid, executor.seqs[rid].prefilled, len(executor.seqs[rid].token_ids))
            for rid in admitted
            if rid not in failed and rid in executor.seqs
        ]
        budget, chunk = executor.plan.prefill_budget, executor.config.chunked_prefill_tokens
        chunks = plan_chunks(pending, budget, chunk)
        if not chunks:
            return PrefillResult(first, failed)
        result = executor.prefill_chunks(chunks)
        first.update(result.first_tokens)
        failed.update(result.failed)
