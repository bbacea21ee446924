"""The scheduling core: every decision the pipeline makes, in plain synchronous code.

Theory of operation. A request passes four owners, one *part* of the core each::

    AdmissionPart --admitted--> PrefillPart --staged--> StagingPart --ready--> DecodePart
         ^                                                                        |
         +----------------------------- retracted -----------------------------------+

Each part owns the requests in its states (admission: QUEUED; prefill: PREFILL; staging: STAGING;
decode: READY, DECODE, DRAFT, VERIFY) and decides what to do with them in a *turn*: a generator that
yields device commands (``pipeline.messages``) and is sent each command's ``Outcome``, and returns a
``Handoff`` saying which requests move on, which go back to the queue, and which ended. A turn never
awaits and never touches torch; whoever drives it runs the commands:

* the synchronous driver (``pipeline/driver.py``) runs one turn of each part in order, calling the
  executor directly, and passes hand-offs from part to part;
* the async engine gives each part to a stage actor (``pipeline/stages``), which runs its part's turns
  against the executor actor and sends hand-offs to the next stage as messages.

So the policy (who is admitted, how a speculative round is ordered, who is retracted, how a request
ends) is written once, here, and both drivers produce the same commands for the same request.

Mixed steps (``EngineConfig.mixed_steps``): a decode turn's ``Decode`` and a prefill turn's
``Prefill`` at hand together go to the executor as one ``Mixed`` command (``mix``), and its outcome
is split back (``split``), so each turn is sent its own command's outcome and never knows it shared
a forward. The synchronous driver runs the two turns side by side with ``together``; the executor
actor pairs the two stages' commands with ``mix`` as they arrive.

Rules every part follows:

* Ending a request: release its memory first (``Release``), then apply the terminal event (which sets
  its finish reason), then report it in ``Handoff.ended``. A QUEUED request holds no memory.
* Aborts are wishes (``AbortBook``) that the owning part applies at its next safe point: before a
  command and between the two halves of a speculative round.
* A command's failure (``Outcome.error``) fails the requests of that command only; a failure the
  executor pins on one request (``failed``) fails that request only.
* Retraction (memory pressure) releases a request's memory but keeps its output and its sampling
  state; it goes back to the front of the queue and prefills prompt + output when re-admitted.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence

import attrs
import structlog

from pipeline.chunking import plan_chunks
from pipeline.messages import (
    NO_SWAPS,
    Admit,
    AdmitResult,
    CollectReady,
    Command,
    Decode,
    Draft,
    Mixed,
    MixedResult,
    NewSequence,
    Outcome,
    Prefill,
    PrefillResult,
    ReadyResult,
    Release,
    Reserve,
    RoomResult,
    StepResult,
    Verify,
)
from pipeline.request import Request
from statemachines.request import (
    AbortRequested,
    Admitted,
    ChunkDone,
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

log = structlog.get_logger("hispec.scheduler")


@attrs.define(eq=False)
class Handoff:
    """What one turn did to the requests that left its part."""

    onward: list[Request] = attrs.Factory(list)  # to the next part, in order
    requeue: list[Request] = attrs.Factory(list)  # retracted: to the front of the queue, in order
    ended: list[Request] = attrs.Factory(list)  # reached a terminal state, memory released
    notify: list[Request] = attrs.Factory(list)  # got new output tokens (wake their consumers)

    def merge(self, other: Handoff) -> Handoff:
        for name in ("onward", "requeue", "ended", "notify"):
            getattr(self, name).extend(getattr(other, name))
        return self


Turn = Generator[Command, Outcome, Handoff]


@attrs.define(eq=False)
class AbortBook:
    """Ids whose abort was asked for; the part owning each request applies it at a safe point."""

    pending: set[str] = attrs.field(factory=set)

    def add(self, request_id: str) -> None:
        self.pending.add(request_id)

    def discard(self, request_id: str) -> None:
        self.pending.discard(request_id)

    def among(self, reqs: Iterable[Request]) -> list[Request]:
        """The live requests of ``reqs`` with an abort pending."""
        if not self.pending:
            return []
        return [r for r in reqs if r.request_id in self.pending and not r.is_finished]


def step_fields(outcome: Outcome, batch_size: int) -> dict[str, float]:
    """The fields a step's lifecycle events carry: batch size, the step's HiSparse hits and misses
    (the whole batch's, summed over layers) and the device command's wall time."""
    return {
        "batch_size": batch_size,
        "step_hits": outcome.swaps.hits,
        "step_misses": outcome.swaps.misses,
        "step_h2d_bytes": outcome.swaps.h2d_bytes,
        "device_ms": round(outcome.seconds * 1e3, 3),
    }


def end(items: Sequence[tuple[Request, Event]], stage: str) -> Turn:
    """Release (whatever holds memory), then apply each terminal event. A request that crashed
    leaves nothing to the prefix cache (its memory is not trusted); the others may."""
    if not items:
        return Handoff()
    held = [(r.request_id, isinstance(e, Crashed)) for r, e in items if r.state is not State.QUEUED]
    for crashed in (False, True):
        ids = tuple(rid for rid, c in held if c is crashed)
        if ids:  # never fails: the executor frees what it can and logs the rest
            yield Release(ids, cache=not crashed)
    for req, event in items:
        req.apply(event, stage, output_tokens=len(req.output_ids))
    return Handoff(ended=[r for r, _ in items])


def retract(reqs: list[Request], stage: str) -> Turn:
    """Memory pressure: release (sampling state kept), back to the queue with the output kept."""
    if not reqs:
        return Handoff()
    yield Release(tuple(r.request_id for r in reqs), keep_sampling_state=True)
    for req in reqs:
        req.apply(Retracted(), stage)
        req.metrics.num_retractions += 1
    return Handoff(requeue=list(reqs))


def output_fault(exc: BaseException) -> str:
    """The reason a request fails when turning its tokens into output raised (logged with its trace)."""
    log.error("scheduler.output_failed", error=f"{type(exc).__name__}: {exc}", exc_info=True)
    return f"its output could not be detokenized: {type(exc).__name__}: {exc}"


def fail(reqs: Iterable[Request], reason: str, stage: str) -> Turn:
    return (yield from end([(r, Crashed(reason)) for r in reqs], stage))


def take_aborts(reqs: Iterable[Request], aborts: AbortBook, stage: str) -> Turn:
    """End every request of ``reqs`` whose abort is pending."""
    return (yield from end([(r, AbortRequested()) for r in aborts.among(reqs)], stage))


# --- admission ---------------------------------------------------------------------------------------


@attrs.define(eq=False)
class AdmissionPart:
    """The FIFO of QUEUED requests and the choice of each prefill batch.

    A turn takes requests from the head, in order, while the prefill token budget allows (the head
    always), and asks the executor to admit the longest prefix that fits memory together; nobody
    overtakes the head. Retracted requests go back to the front, in order.
    """

    max_prefill_tokens: int  # a prefill batch's token budget (a longer head request still goes alone)
    aborts: AbortBook
    name: str = "admission"
    queue: collections.deque[Request] = attrs.field(factory=collections.deque)
    # the last turn found candidates and admitted none: it waits for memory to change
    waiting_for_memory: bool = False

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.queue)

    def push(self, req: Request) -> None:
        self.queue.append(req)

    def requeue(self, reqs: Iterable[Request]) -> None:
        """Back to the front, keeping their order."""
        self.queue.extendleft(reversed(list(reqs)))

    def remove(self, request_ids: set[str]) -> None:
        self.queue = collections.deque(r for r in self.queue if r.request_id not in request_ids)

    def candidates(self) -> list[Request]:
        """The head requests the token budget allows in one prefill (at least the first)."""
        chosen: list[Request] = []
        budget = self.max_prefill_tokens
        for req in self.queue:
            need = len(req.known_tokens())
            if chosen and need > budget:
                break
            chosen.append(req)
            budget -= need
        return chosen

    def turn(self) -> Turn:
        aborted = self.aborts.among(self.queue)
        self.remove({r.request_id for r in aborted})
        done = yield from end([(r, AbortRequested()) for r in aborted], self.name)
        candidates = self.candidates()
        if not candidates:
            self.waiting_for_memory = False
            return done
        outcome = yield Admit(tuple(
            NewSequence(r.request_id, r.known_tokens(), r.params, len(r.prompt_ids)) for r in candidates
        ))
        if outcome.error is not None:
            # nothing is known of the command's effect: release whatever it may have allocated
            self.remove({r.request_id for r in candidates})
            for req in candidates:
                req.apply(Admitted(), self.name)
            return done.merge((yield from fail(candidates, outcome.error, self.name)))
        result = outcome.result_as(AdmitResult)
        admitted = candidates[: len(result.admitted)]
        assert [r.request_id for r in admitted] == list(result.admitted), "admission must take a prefix"
        self.remove(set(result.admitted))
        self.waiting_for_memory = not admitted
        for req in admitted:
            if req.metrics.scheduled_time is None:
                req.metrics.scheduled_time = time.monotonic()
            cached = req.metrics.cached_tokens = result.cached.get(req.request_id, 0)
            req.apply(
                Admitted(), self.name, batch_size=len(admitted), queued=len(self.queue), cached_tokens=cached
            )
        done.onward.extend(admitted)
        return done


# --- prefill -----------------------------------------------------------------------------------------


@attrs.define(eq=False)
class PrefillPace:
    """Keeps a prefill forward, while requests decode, to about one decode step's time.

    A fixed token budget does not bound a chunk's time: a chunk's cost grows with the context it
    reads. So, while the decode part has members, a prefill forward takes at most as many tokens as
    the latest decode step's seconds buy at the latest prefill forward's seconds per token (at least
    ``min_tokens``, at most the configured budget); with nothing decoding it takes the whole budget.
    A running request then waits about one decode step for a chunk, and a prompt arriving at an idle
    engine is not slowed. The async engine paces (its stages measure real device time); the
    synchronous driver keeps fixed chunks, so that what it does never depends on timing.

    Mixed steps (the chunk in the decode step's forward, ``Outcome.mixed``): a mixed step leaves
    ``decode_seconds`` at the latest decode step of its own, and the chunk's share of it is what it
    took beyond that step. The chunk then gets ``mixed_share`` of a decode step's time: the step
    costs about 1.5 decode steps, which keeps the running requests' inter-token latency clear of
    two decode steps, and since the forward's fixed cost is paid once the chunk is still about as
    large as a chunk of its own forward would be.
    """

    min_tokens: int = 16
    mixed_share: float = 0.5  # of a decode step's time, a mixed step's chunk may add
    decoding: bool = False  # the decode part has members (it says so after each of its turns)
    decode_seconds: float | None = None  # the latest decode step's (or verify's) device time
    seconds_per_token: float | None = None  # the latest prefill forward's device time per token
    mixing: bool = False  # the latest prefill forward was a mixed step's

    def record_decode(self, outcome: Outcome) -> None:
        if not outcome.mixed:
            self.decode_seconds = outcome.seconds

    def record_prefill(self, outcome: Outcome, tokens: int) -> None:
        seconds = outcome.seconds
        if outcome.mixed and self.decode_seconds:  # the chunk's share (a tenth at least: noise)
            seconds = max(seconds - self.decode_seconds, seconds / 10)
        self.seconds_per_token = seconds / tokens
        self.mixing = outcome.mixed

    def budget(self, limit: int | None) -> int | None:
        if not self.decoding or not self.decode_seconds or not self.seconds_per_token:
            return limit
        seconds = self.decode_seconds * (self.mixed_share if self.mixing else 1.0)
        fit = max(self.min_tokens, int(seconds / self.seconds_per_token))
        return fit if limit is None else min(limit, fit)


@attrs.define(eq=False)
class PrefillPart:
    """The admitted requests whose prompts are being computed (PREFILL), in admission order.

    A turn is one prefill forward: the head requests get a chunk each (at most ``chunk_tokens`` of
    a prompt) within the forward's token budget (``batch_tokens``; ``pipeline.chunking.plan_chunks``).
    A prompt longer than a chunk takes several turns, and another part's commands run between them,
    so a long prompt never holds up decoding for long.
    After the forward each request whose chunk does not end its prompt logs ``ChunkDone`` and stays;
    the others end (their first token ends them: ``FinishedAtPrefill``; an abort arrived:
    ``AbortRequested``; the executor failed them: ``Crashed``) or go on to staging (``PrefillDone``).
    """

    aborts: AbortBook
    chunk_tokens: int | None = None  # one request's tokens in a forward (None: whole prompts)
    pace: PrefillPace | None = None  # the async engine's pacing of chunks while requests decode
    name: str = "prefill"
    batch_tokens: int | None = None  # a forward's prompt tokens over all its requests (None: no bound)
    owned: dict[str, Request] = attrs.field(factory=dict)  # admission order
    progress: dict[str, int] = attrs.field(factory=dict)  # request id -> prompt positions computed

    def __len__(self) -> int:
        return len(self.owned)

    def accept(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            self.owned[req.request_id] = req
            self.progress[req.request_id] = req.metrics.cached_tokens  # a cached prefix is computed

    def remove(self, request_id: str) -> None:
        self.owned.pop(request_id, None)
        self.progress.pop(request_id, None)

    def turn(self) -> Turn:
        aborted = self.aborts.among(self.owned.values())
        for req in aborted:
            self.remove(req.request_id)
        done = yield from end([(r, AbortRequested()) for r in aborted], self.name)
        pending = ((rid, self.progress[rid], len(r.known_tokens())) for rid, r in self.owned.items())
        budget = self.batch_tokens if self.pace is None else self.pace.budget(self.batch_tokens)
        chunks = plan_chunks(pending, budget, self.chunk_tokens)
        if not chunks:
            return done
        reqs = [self.owned[c.request_id] for c in chunks]
        outcome = yield Prefill(chunks)
        if self.pace is not None and outcome.error is None:
            self.pace.record_prefill(outcome, sum(c.end - c.start for c in chunks))
        if outcome.error is not None:
            for req in reqs:
                self.remove(req.request_id)
            return done.merge((yield from fail(reqs, outcome.error, self.name)))
        result = outcome.result_as(PrefillResult)
        ending: list[tuple[Request, Event]] = []
        staged: list[Request] = []
        fields = step_fields(outcome, len(reqs))
        for chunk, req in zip(chunks, reqs):
            rid = req.request_id
            prompt_len = len(req.known_tokens())
            if rid not in result.failed and chunk.end < prompt_len:
                self.progress[rid] = chunk.end
                req.apply(ChunkDone(chunk.start, chunk.end), self.name, **fields)
                continue
            self.remove(rid)
            if rid in result.failed:
                ending.append((req, Crashed(result.failed[rid])))
                continue
            logprob = result.logprobs.get(rid)
            logprobs = None if logprob is None else (logprob,)
            try:
                reason = req.append((result.first_tokens[rid],), logprobs=logprobs)
            except Exception as exc:  # its detokenizer (or its text's stop rule): this request's fault alone
                ending.append((req, Crashed(output_fault(exc))))
                continue
            if reason is not None:
                ending.append((req, FinishedAtPrefill(reason)))
            elif rid in self.aborts.pending:
                ending.append((req, AbortRequested()))
            else:
                req.apply(PrefillDone(), self.name, prefill_tokens=prompt_len, **fields)
                staged.append(req)
        done.merge((yield from end(ending, self.name)))
        done.onward.extend(staged)
        done.notify.extend(r for r in reqs if r.output_ids and r.request_id not in self.owned)
        return done


# --- staging -----------------------------------------------------------------------------------------


@attrs.define(eq=False)
class StagingPart:
    """Requests whose prompt KV is on its way to the host pool; hands them on READY, in FIFO order."""

    aborts: AbortBook
    name: str = "staging"
    owned: dict[str, Request] = attrs.field(factory=dict)  # arrival order = staging order
    # the last poll waited for every copy and still found nothing: what is left waits for memory
    waiting_for_memory: bool = False

    def accept(self, reqs: Iterable[Request]) -> None:
        self.owned.update((r.request_id, r) for r in reqs)

    def turn(self) -> Turn:
        aborted = self.aborts.among(self.owned.values())
        for req in aborted:
            self.owned.pop(req.request_id)
        done = yield from end([(r, AbortRequested()) for r in aborted], self.name)
        if not self.owned:
            self.waiting_for_memory = False
            return done
        outcome = yield CollectReady(tuple(self.owned))
        if outcome.error is not None:
            held, self.owned = list(self.owned.values()), {}
            return done.merge((yield from fail(held, outcome.error, self.name)))
        result = outcome.result_as(ReadyResult)
        ready = [self.owned.pop(rid) for rid in result.ready]
        broken = [
            (self.owned.pop(rid), Crashed(why)) for rid, why in result.failed.items() if rid in self.owned
        ]
        self.waiting_for_memory = not ready and not broken and result.waited
        for req in ready:
            req.apply(StagingDone(), self.name)
        done.onward.extend(ready)
        return done.merge((yield from end(broken, self.name)))


# --- decode ------------------------------------------------------------------------------------------


# the timed rule's probe interval grows to at most ``probe_every * 2 ** MAX_PROBE_DOUBLINGS`` turns
MAX_PROBE_DOUBLINGS = 3


def rounds_lead(rates: list[float | None]) -> bool | None:
    """Whether rounds deliver at least plain steps' tokens/s, by ``[rounds, plain steps]`` rates
    (``SpecPolicy.rates``); None while either mode is not measured."""
    spec, plain = rates
    return None if spec is None or plain is None else spec >= plain


@attrs.define(eq=False)
class SpecPolicy:
    """Whether the next step of a speculative batch is a round or a plain step (adaptive speculation).

    A round pays while its forwards stay cheap (a small batch: verifying D tokens per request costs
    about one forward only while the forward is not compute-bound) and while drafts are accepted
    (the measured accept length, a moving average over rounds). When acceptance turns speculation
    off, a probe round every ``probe_every`` plain steps measures it again. Either choice leaves the
    output unchanged: the executor keeps each request's MTP state current across plain steps.

    ``timed``: between 2 and ``max_batch_size`` requests, the choice goes to whichever mode has
    delivered more tokens per second at about this batch size (batches grouped by powers of two;
    each mode's rate a moving average of its turns, wall time from the turn's first command to its
    outcome). A mode not yet measured at a size is tried first (rounds, then plain steps); the losing
    mode runs again after ``probe_every`` turns of the winner, so a change in acceptance or cost is
    seen; each such probe that leaves the lead where it was doubles that interval (up to
    ``2 ** MAX_PROBE_DOUBLINGS`` times), and any change of lead resets it, so a mode that keeps
    losing costs ever less to watch (with ``probe_every`` 16, twice in the 100 turns after the
    first comparison instead of 5 times). Each mode's first ``warm_up_turns`` turns at a size are
    not counted (a fresh engine's first round also pays one-off costs, its first forward of that
    shape among them, which would make rounds look slower than plain steps;
    docs/performance-notes.md), so the mode is tried again before the rule compares. A batch of one
    is timed too when its request is greedy (the same tokens either way); a sampled request served
    alone always speculates (so a seeded one stays reproducible).

    ``max_context``: no round while some request of the batch holds more tokens than this (its
    verify's queries and its drafts each scan the whole context; vLLM's speculative_max_model_len).

    ``plain_tail``: the last tokens of every stream (no request of the batch may produce D more)
    are plain steps. ``plain_while_prefilling``: while prompts wait for prefill and steps mix, the
    turns are plain steps, which carry a chunk in their forward (``DecodePart.prefill_waiting``).
    Both depend on the batch's own progress and the prompts waiting, never on timing.
    """

    max_batch_size: int | None = None  # speculate only while the batch has at most this many requests
    min_accept_length: float | None = None  # ... and the measured accept length is at least this
    probe_every: int = 16
    timed: bool = False  # ... and (2+ requests) while rounds deliver more tokens/s than plain steps
    plain_tail: bool = False  # ... and while some request of the batch may produce D more tokens
    plain_while_prefilling: bool = False  # ... and (mixed steps) while no prompt waits for prefill
    max_context: int | None = None  # ... and while no request of the batch holds more tokens than this
    accept_length: float | None = None  # the moving average (None: nothing measured yet)
    plain_steps: int = 0  # plain steps since the last round
    weight: float = 0.2  # of the newest round in the moving average
    warm_up_turns: int = 1  # timed: each mode's first turns per batch-size group, not counted
    # timed: per batch-size group, tokens/s of [rounds, plain steps] (None: not measured yet) and the
    # winner's turns since the loser last ran
    rates: dict[int, list[float | None]] = attrs.Factory(dict)
    since_probe: dict[int, int] = attrs.Factory(dict)
    warmed: dict[int, list[int]] = attrs.Factory(dict)  # timed: per group, [rounds, plain steps] skipped
    # timed: per group, how many times the probe interval has doubled (probes that kept the lead)
    doublings: dict[int, int] = attrs.Factory(dict)

    @classmethod
    def from_config(cls, spec, device: str = "cpu") -> SpecPolicy:
        """The rule of a ``SpeculativeConfig``, its ``"auto"`` limits set for ``device``."""
        spec = spec.for_device(device)
        return cls(spec.max_batch_size, spec.min_accept_length, spec.probe_every, spec.timed,
                   plain_tail=spec.plain_tail, plain_while_prefilling=spec.plain_while_prefilling,
                   max_context=spec.max_context)

    def within_context(self, longest: int) -> bool:
        """Whether a batch whose longest request holds ``longest`` tokens may run a round."""
        return self.max_context is None or longest <= self.max_context

    def speculate(self, batch_size: int, *, greedy: bool = False) -> bool:
        """Whether the next turn over ``batch_size`` requests is a round; ``greedy``: all of them
        are greedy (a batch of one is then timed as well)."""
        if self.max_batch_size is not None and batch_size > self.max_batch_size:
            return False
        floor, measured = self.min_accept_length, self.accept_length
        if floor is not None and measured is not None and measured < floor:
            return self.plain_steps >= self.probe_every
        if not self._timed(batch_size, greedy):
            return True
        group = batch_size.bit_length()
        spec, plain = self.rates.get(group, (None, None))
        if spec is None or plain is None:
            return spec is None
        winner = spec >= plain
        interval = self.probe_every << self.doublings.get(group, 0)
        return winner if self.since_probe.get(group, 0) < interval else not winner

    def record_round(self, accept_lengths: list[int]) -> None:
        """Tokens each request committed in one round (accepted drafts + 1)."""
        self.plain_steps = 0
        if not accept_lengths:
            return
        mean = sum(accept_lengths) / len(accept_lengths)
        old = self.accept_length
        self.accept_length = mean if old is None else (1 - self.weight) * old + self.weight * mean

    def record_plain_step(self) -> None:
        self.plain_steps += 1

    def _timed(self, batch_size: int, greedy: bool) -> bool:
        return self.timed and (batch_size >= 2 or greedy)

    def record_time(
        self, batch_size: int, tokens: int, seconds: float, *, speculative: bool, greedy: bool = False
    ) -> None:
        """A turn over ``batch_size`` requests committed ``tokens`` in ``seconds`` (timed rule)."""
        if not self._timed(batch_size, greedy) or tokens <= 0 or seconds <= 0:
            return
        group = batch_size.bit_length()
        mode = 0 if speculative else 1
        warmed = self.warmed.setdefault(group, [0, 0])
        if warmed[mode] < self.warm_up_turns:  # a warm-up turn: tried, not counted
            warmed[mode] += 1
            return
        rates = self.rates.setdefault(group, [None, None])
        lead = rounds_lead(rates)
        ran_winner = lead is not None and lead == speculative
        self.since_probe[group] = self.since_probe.get(group, 0) + 1 if ran_winner else 0
        rate, old = tokens / seconds, rates[mode]
        rates[mode] = rate if old is None else (1 - self.weight) * old + self.weight * rate
        if lead is not None:
            kept = rounds_lead(rates) == lead
            if not kept:  # the lead changed hands: watch the new loser closely again
                self.doublings[group] = 0
            elif not ran_winner:  # a probe that confirmed the lead: look less often
                self.doublings[group] = min(self.doublings.get(group, 0) + 1, MAX_PROBE_DOUBLINGS)


@attrs.define(eq=False)
class DecodePart:
    """The running batch, stepped back to back (continuous batching).

    A plain step: ``Decode`` -> ``StepDone`` or ``Finished``. In speculative mode each turn is a
    round or (when ``policy`` says a round would not pay) a plain step. A round, in this order:
    ``Reserve`` (room for D positions; the refused are retracted while still in DECODE) ->
    ``DraftStarted`` -> ``Draft`` -> ``DraftDone`` -> [pending aborts] -> ``Verify`` -> ``Verified`` or
    ``Finished``. A request the executor cannot grow is retracted; one it failed ends FAILED. With
    dynamic residency each decode command's outcome carries the demotions and promotions made since
    the last one, applied as their requests' events (``_note``).
    """

    aborts: AbortBook
    num_steps: int  # draft tokens per speculative round; 0 = plain decoding
    policy: SpecPolicy = attrs.Factory(SpecPolicy)  # speculative mode: round or plain step, per turn
    pace: PrefillPace | None = None  # told each step's device time (the prefill part paces by it)
    # mixed steps: whether prompts wait for a prefill forward, which a plain step would carry in its
    # own forward and a round (several commands) cannot: while they do, the turns are plain steps
    prefill_waiting: Callable[[], bool] | None = None
    name: str = "decode"
    members: dict[str, Request] = attrs.field(factory=dict)  # join order
    _committed: int = 0  # tokens the current turn committed (the timed speculation rule reads it)
    # dynamic residency (``_note``): the ``Demoted`` / ``Promoted`` events of requests on their way
    # in, applied when each joins
    _arriving: dict[str, list[Event]] = attrs.field(factory=dict)
    # the requests that left (ended or retracted) since the last successful decode command's outcome
    _left: dict[str, Request] = attrs.field(factory=dict)

    @property
    def speculative(self) -> bool:
        return self.num_steps > 0

    @property
    def draft_tokens(self) -> int:
        """D: positions one round may add (the bonus token and the drafts)."""
        return self.num_steps + 1

    def __len__(self) -> int:
        return len(self.members)

    def accept(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            self.members[req.request_id] = req
            # back after a retraction: a move still to come is of its new memory (or, made before
            # the retraction and brought late, shown at its joining: a marker late, never lost)
            self._left.pop(req.request_id, None)
            for event in self._arriving.pop(req.request_id, ()):  # made while it was on its way in
                req.apply(event, self.name)
            req.apply(JoinedBatch(), self.name, batch_size=len(self.members))
        if self.pace is not None:
            self.pace.decoding = bool(self.members)

    def remove(self, request_id: str) -> Request | None:
        """Take a member out, for its caller to end it: a move of it still to come is dropped."""
        popped = self._pop([self.members[request_id]] if request_id in self.members else [])
        return popped[0] if popped else None

    def _note(self, outcome: Outcome) -> Outcome:
        """Apply the residency events a decode command's outcome carries (dynamic residency).

        A move is made at a step boundary to a request that holds its decode memory (READY, DECODE,
        DRAFT or VERIFY, a self-loop in each), so a member's is applied at once, in whatever step
        of a round it is: a request that finishes in the round of its move has the move before its
        end. The request of any other move is one of two:

        * on its way in: the async engine hands a READY request on by message, and a decode command
          may bring its move before the message is taken. It is kept until the request joins
          (``accept``), which it does (an abort of it is applied by this part, after it joined).
        * gone (``_left``): ended, or retracted to the queue, after the move, by the time a decode
          command brought it (another part's command moved it before this part's ``Release``). The
          memory the move is about was released; the request's timeline has that release's event
          (its end, or ``Retracted``) after the move was made, and a terminal or QUEUED request
          takes no move. It is dropped, logged with the request's state.

        A successful outcome carries every move made before its command was sent, and a request in
        ``_left`` was released before that (a part pops between commands, never during one), so no
        move of it can come later: the record starts over. A failed command's outcome carries none
        (they wait for the next), so the record stays."""
        for rid, event in outcome.residency:
            req = self.members.get(rid)
            if req is not None:
                req.apply(event, self.name)
            elif (gone := self._left.get(rid)) is not None:
                log.info(
                    "scheduler.move_after_release",
                    request_id=rid,
                    move=event.name,
                    state=gone.state.value,
                    **attrs.asdict(event),
                )
            else:
                self._arriving.setdefault(rid, []).append(event)
        if outcome.error is None:
            self._left.clear()
        return outcome

    def _pop(self, reqs: Iterable[Request]) -> list[Request]:
        popped = [self.members.pop(r.request_id) for r in reqs if r.request_id in self.members]
        self._left.update((r.request_id, r) for r in popped)
        return popped

    def turn(self, runnable: list[Request] | None = None) -> Turn:
        """One step (or round) over ``runnable`` (default: every member), after pending aborts."""
        done = yield from take_aborts(list(self.members.values()), self.aborts, self.name)
        self._pop(done.ended)
        reqs = [r for r in (runnable if runnable is not None else self.members.values()) if not r.is_finished]
        if not reqs:
            return done
        greedy = all(r.params.greedy for r in reqs)
        # a round commits at most D tokens a request: it is not run for the last few of every stream
        # (the tail of a batch would pay a catch-up of its MTP layer for a token or two), nor past the
        # rule's context limit, nor while a prompt's chunk could share the step's forward instead of
        # running one of its own
        policy, waiting = self.policy, self.prefill_waiting
        worth = (self.speculative
                 and not (policy.plain_tail and all(r.tokens_left < self.draft_tokens for r in reqs))
                 and policy.within_context(max(len(r.prompt_ids) + len(r.output_ids) for r in reqs))
                 and not (policy.plain_while_prefilling and waiting is not None and waiting()))
        speculative = worth and self.policy.speculate(len(reqs), greedy=greedy)
        if speculative:
            step = self._round(reqs)
        else:
            if self.speculative:
                self.policy.record_plain_step()
            step = self._step(reqs)
        start, self._committed = time.perf_counter(), 0
        done.merge((yield from step))
        if self.speculative:
            seconds = time.perf_counter() - start
            self.policy.record_time(
                len(reqs), self._committed, seconds, speculative=speculative, greedy=greedy
            )
        if self.pace is not None:
            self.pace.decoding = bool(self.members)
        return done

    def _step(self, reqs: list[Request]) -> Turn:
        outcome = self._note((yield Decode(tuple(r.request_id for r in reqs))))
        if outcome.error is not None:
            return (yield from fail(self._pop(reqs), outcome.error, self.name))
        result = outcome.result_as(StepResult)
        done = yield from self._retract(result.refused)
        return done.merge((yield from self._settle(result, outcome, len(result.tokens), verified=False)))

    def _round(self, reqs: list[Request]) -> Turn:
        outcome = self._note((yield Reserve(tuple(r.request_id for r in reqs), self.draft_tokens)))
        if outcome.error is not None:
            return (yield from fail(self._pop(reqs), outcome.error, self.name))
        room = outcome.result_as(RoomResult)
        done = yield from self._retract(room.refused)
        drafting = [self.members[rid] for rid in room.runnable]
        if not drafting:
            return done
        for req in drafting:
            req.apply(DraftStarted(), self.name, batch_size=len(drafting))
        outcome = self._note((yield Draft(tuple(room.runnable))))
        if outcome.error is not None:
            return done.merge((yield from fail(self._pop(drafting), outcome.error, self.name)))
        failed = outcome.result_as(StepResult).failed
        for req in drafting:
            if req.request_id not in failed:
                req.apply(DraftDone(num_steps=self.num_steps), self.name, batch_size=len(drafting))
        draft_failed = [r for r in drafting if r.request_id in failed]
        self._pop(draft_failed)
        done.merge((yield from end([(r, Crashed(failed[r.request_id])) for r in draft_failed], self.name)))
        # an abort that arrived while drafting takes effect here, between draft and verify
        drafted = [r for r in drafting if r.request_id not in failed]
        aborted = yield from take_aborts(drafted, self.aborts, self.name)
        self._pop(aborted.ended)
        done.merge(aborted)
        drafted = [r for r in drafted if not r.is_finished]
        if not drafted:
            return done
        outcome = self._note((yield Verify(tuple(r.request_id for r in drafted))))
        if outcome.error is not None:
            return done.merge((yield from fail(self._pop(drafted), outcome.error, self.name)))
        result = outcome.result_as(StepResult)
        return done.merge((yield from self._settle(result, outcome, len(drafted), verified=True)))

    def _retract(self, refused: tuple[str, ...]) -> Turn:
        reqs = self._pop(self.members[rid] for rid in refused)
        return (yield from retract(reqs, self.name))

    def _settle(self, result: StepResult, outcome: Outcome, batch_size: int, *, verified: bool) -> Turn:
        """Append each request's committed tokens and apply ``StepDone`` / ``Verified``; end the ones
        that finished or failed."""
        fields = step_fields(outcome, batch_size)
        if self.pace is not None:
            self.pace.record_decode(outcome)
        if verified:
            self.policy.record_round([len(tokens) for tokens in result.tokens.values()])
        ending: list[tuple[Request, Event]] = []
        notify: list[Request] = []
        self._committed += sum(len(tokens) for tokens in result.tokens.values())
        for rid, tokens in result.tokens.items():
            req = self.members[rid]
            if verified:
                req.record_verify(result.accepted[rid], self.num_steps)
            try:
                reason = req.append(tokens, logprobs=result.logprobs.get(rid))
            except Exception as exc:  # its detokenizer (or its text's stop rule): this request's fault alone
                ending.append((req, Crashed(output_fault(exc))))
                continue
            notify.append(req)
            if reason is not None:
                ending.append((req, Finished(reason)))
            elif verified:
                req.apply(Verified(accepted=len(tokens)), self.name, **fields)
            else:
                req.apply(StepDone(), self.name, **fields)
        for rid, why in result.failed.items():
            ending.append((self.members[rid], Crashed(why)))
        self._pop(r for r, _ in ending)
        done = yield from end(ending, self.name)
        done.notify.extend(notify)
        return done


# --- mixed steps -------------------------------------------------------------------------------------


def mix(a: Command, b: Command) -> Mixed | None:
    """The mixed step two parts' commands make together: a ``Decode`` and a ``Prefill``, in either
    order (``EngineConfig.mixed_steps``); None for any other pair, which run one after the other."""
    if isinstance(a, Decode) and isinstance(b, Prefill):
        return Mixed(a, b)
    if isinstance(a, Prefill) and isinstance(b, Decode):
        return Mixed(b, a)
    return None


def split(outcome: Outcome) -> tuple[Outcome, Outcome]:
    """The outcomes of a ``Mixed`` command's two parts, (decode's, prefill's). A mixed step that
    failed as a whole fails both parts with its error."""
    if outcome.error is not None:
        failed = Outcome(None, NO_SWAPS, outcome.changed, outcome.error, outcome.seconds, mixed=True)
        return failed, failed
    result = outcome.result
    assert isinstance(result, MixedResult), f"not a mixed step's outcome: {result!r}"
    return result.decode, result.prefill


Together = Generator[Command, Outcome, dict[str, Handoff]]


def together(turns: dict[str, Turn]) -> Together:
    """Turns side by side until each returns its hand-off (by name): a ``Decode`` of one and a
    ``Prefill`` of the other go out as one ``Mixed`` command; any other command goes out alone as
    soon as it is yielded, and a command left without its partner (the other turn ended, or yields
    a speculative round) goes out alone."""
    pending: dict[str, Command] = {}
    handoffs: dict[str, Handoff] = {}

    def advance(name: str, outcome: Outcome | None) -> None:
        turn = turns[name]
        try:
            pending[name] = next(turn) if outcome is None else turn.send(outcome)
        except StopIteration as stop:
            pending.pop(name, None)
            handoffs[name] = stop.value

    for name in turns:
        advance(name, None)
    while pending:
        mixed = mix(*pending.values()) if len(pending) == 2 else None
        if mixed is not None:
            parts = dict(zip((mixed.decode, mixed.prefill), split((yield mixed))))
            for name, command in list(pending.items()):
                advance(name, parts[command])
            continue
        alone = [n for n, c in pending.items() if not isinstance(c, (Decode, Prefill))]
        name = alone[0] if alone else next(iter(pending))
        advance(name, (yield pending[name]))
    return handoffs


# --- the whole core ----------------------------------------------------------------------------------

# which part owns a request in each live state
OWNER: dict[State, str] = {
    State.QUEUED: "admission",
    State.PREFILL: "prefill",
    State.STAGING: "staging",
    State.READY: "decode",
    State.DECODE: "decode",
    State.DRAFT: "decode",
    State.VERIFY: "decode",
}


@attrs.define(eq=False)
class Scheduler:
    """The four parts over one abort book (the synchronous driver holds all of them; the engine
    gives one to each stage)."""

    admission: AdmissionPart
    prefill: PrefillPart
    staging: StagingPart
    decode: DecodePart
    aborts: AbortBook

    @classmethod
    def build(
        cls,
        *,
        max_prefill_tokens: int,
        num_steps: int,
        policy: SpecPolicy | None = None,
        chunk_tokens: int | None = None,
        batch_tokens: int | None = None,
        pace: bool = False,
        mixes: bool = False,
    ) -> Scheduler:
        """``chunk_tokens``, ``batch_tokens``: a request's chunk and a prefill forward's budget
        (``EngineConfig.chunked_prefill_tokens``, ``prefill_budget``).
        ``pace``: pace prefill chunks by the decode steps' device time (``PrefillPace``).
        ``mixes``: a prefill chunk shares a plain decode step's forward (``EngineConfig.mixed_steps``),
        so speculation pauses while prompts wait for their prefill (``DecodePart.prefill_waiting``)."""
        aborts = AbortBook()
        pacer = PrefillPace() if pace else None
        prefill = PrefillPart(aborts, chunk_tokens, pacer, batch_tokens=batch_tokens)
        decode = DecodePart(aborts, num_steps, policy if policy is not None else SpecPolicy(), pacer)
        if mixes:
            decode.prefill_waiting = lambda: len(prefill) > 0
        return cls(
            admission=AdmissionPart(max_prefill_tokens, aborts),
            prefill=prefill,
            staging=StagingPart(aborts),
            decode=decode,
            aborts=aborts,
        )

    def containers(self) -> dict[str, list[Request]]:
        return {
            "admission": list(self.admission.queue),
            # a prefill turn drops the requests it moves on (STAGING) or ends before it waits for a
            # later command: they are on their way out, not held (the rest of the turn hands them off)
            "prefill": list(self.prefill.owned.values()),
            "staging": list(self.staging.owned.values()),
            "decode": list(self.decode.members.values()),
        }

    def check_integrity(self, live: Iterable[Request], *, in_transit: Iterable[Request] = ()) -> None:
        """Every live request sits in exactly the container of the part that owns its state (or,
        in the async engine, in a message between two stages: ``in_transit``)."""
        where: dict[str, list[str]] = collections.defaultdict(list)
        for name, reqs in self.containers().items():
            for req in reqs:
                where[req.request_id].append(name)
        moving = {r.request_id for r in in_transit}
        for req in live:
            places = where.pop(req.request_id, [])
            if req.request_id in moving and not places:
                continue
            held_by = places or "no part"
            assert len(places) == 1, f"request {req.request_id} ({req.state.name}) is held by {held_by}"
            assert OWNER[req.state] == places[0], (
                f"request {req.request_id} is {req.state.name} but held by {places[0]}"
            )
        assert not where, f"parts hold requests that are not live: {sorted(where)}"
