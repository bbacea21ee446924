"""The lifecycle of one request: one enum, one transition table, one function.

Theory of operation. A request is accepted into QUEUED, admitted into a prefill batch, and its prompt is
computed in PREFILL, chunk by chunk (PREFILL -> PREFILL per chunk when the prompt is longer than one chunk; a
short prompt is one chunk). It then waits in STAGING while its prompt KV is copied to the host pool. Once the
copy lands it is READY (it owns a device buffer) and joins the running batch in DECODE. Plain decoding loops
DECODE -> DECODE one token per step; speculative decoding loops DECODE -> DRAFT -> VERIFY -> DECODE, several
tokens per round. It ends in exactly one terminal state: FINISHED (EOS, stop string, length), ABORTED (the
caller gave up) or FAILED (something broke). Abort and failure are legal from every live state; memory
pressure may retract a request from PREFILL, READY or DECODE back to QUEUED, releasing its memory. With
dynamic residency a request that holds its decode memory (READY, DECODE, DRAFT or VERIFY) may be
Demoted (its whole context on the device -> its hot buffer over the host copy) under memory pressure
and Promoted back when memory returns. A move is made at any step boundary, between the steps of a
speculative round too, so both are self-loops in each of those states: the event is applied in the
state the request is in when its command's outcome comes back, and a request that finishes in the
round of its move still has the move in its timeline.

``advance(state, event)`` is the only way to change a state. It is pure: an illegal pair raises
``IllegalTransition`` and the caller's state stays what it was. Entering a terminal state is the
caller's cue to release every resource the request owns, exactly once.

No torch and no anyio here: this module is imported by the pipeline, the tests and the log replayer.
"""

from __future__ import annotations

import enum

import attrs


class State(enum.Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    STAGING = "staging"
    READY = "ready"
    DECODE = "decode"
    DRAFT = "draft"
    VERIFY = "verify"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


TERMINAL: frozenset[State] = frozenset({State.FINISHED, State.ABORTED, State.FAILED})


@attrs.frozen
class Event:
    """Base of the events; each event class is a frozen value carrying that step's figures."""

    @property
    def name(self) -> str:
        return type(self).__name__


@attrs.frozen
class Admitted(Event):
    """Taken into a prefill batch."""


@attrs.frozen
class ChunkDone(Event):
    """One chunk of a long prompt computed (its KV on its way to host); more chunks follow."""

    start: int = 0  # first position of the chunk
    end: int = 0  # one past its last


@attrs.frozen
class PrefillDone(Event):
    """Prompt KV computed and the first token sampled; the KV copy to host starts."""


@attrs.frozen
class FinishedAtPrefill(Event):
    """The first token already ends the request (EOS, stop string or max_new_tokens == 1)."""

    reason: str = "length"


@attrs.frozen
class StagingDone(Event):
    """The host copy landed and the device buffer is allocated."""


@attrs.frozen
class JoinedBatch(Event):
    """Merged into the running decode batch."""


@attrs.frozen
class DraftStarted(Event):
    """The MTP layer starts drafting (speculative mode)."""


@attrs.frozen
class DraftDone(Event):
    """Drafts ready; the target verifies them."""

    num_steps: int = 0  # draft tokens proposed per request


@attrs.frozen
class Verified(Event):
    """Verify and finalize done; the request stays in the batch."""

    accepted: int = 1  # tokens committed this round, the bonus token included


@attrs.frozen
class StepDone(Event):
    """One plain decode step done; the request stays in the batch."""


@attrs.frozen
class Demoted(Event):
    """Memory pressure (dynamic residency): the request's KV outside its hot buffer left the device
    (its host copy is complete); it decodes through the hot buffer from now on."""

    freed_bytes: int = 0  # device bytes given back


@attrs.frozen
class Promoted(Event):
    """Memory returned (dynamic residency): the request's whole context is on the device again; it
    decodes without swap-in from now on."""

    copied_bytes: int = 0  # bytes copied host -> device


@attrs.frozen
class Finished(Event):
    """EOS, a stop string or the length limit among the newly committed tokens."""

    reason: str = "length"


@attrs.frozen
class AbortRequested(Event):
    """The caller aborted the request (or stopped consuming its stream)."""

    reason: str = "abort"


@attrs.frozen
class Crashed(Event):
    """An error ended the request; ``reason`` says which."""

    reason: str = "error"


@attrs.frozen
class Retracted(Event):
    """Memory pressure: memory released, back to the queue to be admitted again."""

    reason: str = "memory"


S = State
# (state, event type) -> next state. Every pair not listed is illegal.
TRANSITIONS: dict[tuple[State, type[Event]], State] = {
    (S.QUEUED, Admitted): S.PREFILL,
    (S.QUEUED, AbortRequested): S.ABORTED,
    (S.QUEUED, Crashed): S.FAILED,
    (S.PREFILL, ChunkDone): S.PREFILL,
    (S.PREFILL, PrefillDone): S.STAGING,
    (S.PREFILL, FinishedAtPrefill): S.FINISHED,
    (S.PREFILL, Retracted): S.QUEUED,
    (S.PREFILL, AbortRequested): S.ABORTED,
    (S.PREFILL, Crashed): S.FAILED,
    (S.STAGING, StagingDone): S.READY,
    (S.STAGING, AbortRequested): S.ABORTED,
    (S.STAGING, Crashed): S.FAILED,
    (S.READY, JoinedBatch): S.DECODE,
    (S.READY, Retracted): S.QUEUED,
    (S.READY, Demoted): S.READY,
    (S.READY, Promoted): S.READY,
    (S.READY, AbortRequested): S.ABORTED,
    (S.READY, Crashed): S.FAILED,
    (S.DECODE, StepDone): S.DECODE,
    (S.DECODE, Finished): S.FINISHED,
    (S.DECODE, DraftStarted): S.DRAFT,
    (S.DECODE, Retracted): S.QUEUED,
    (S.DECODE, Demoted): S.DECODE,
    (S.DECODE, Promoted): S.DECODE,
    (S.DECODE, AbortRequested): S.ABORTED,
    (S.DECODE, Crashed): S.FAILED,
    (S.DRAFT, DraftDone): S.VERIFY,
    (S.DRAFT, Demoted): S.DRAFT,
    (S.DRAFT, Promoted): S.DRAFT,
    (S.DRAFT, AbortRequested): S.ABORTED,
    (S.DRAFT, Crashed): S.FAILED,
    (S.VERIFY, Verified): S.DECODE,
    (S.VERIFY, Finished): S.FINISHED,
    (S.VERIFY, Demoted): S.VERIFY,
    (S.VERIFY, Promoted): S.VERIFY,
    (S.VERIFY, AbortRequested): S.ABORTED,
    (S.VERIFY, Crashed): S.FAILED,
}

EVENT_TYPES: tuple[type[Event], ...] = (
    Admitted,
    ChunkDone,
    PrefillDone,
    FinishedAtPrefill,
    StagingDone,
    JoinedBatch,
    DraftStarted,
    DraftDone,
    Verified,
    StepDone,
    Demoted,
    Promoted,
    Finished,
    AbortRequested,
    Crashed,
    Retracted,
)
EVENTS_BY_NAME: dict[str, type[Event]] = {cls.__name__: cls for cls in EVENT_TYPES}


class IllegalTransition(Exception):
    """``event`` is not allowed in ``state``; nothing was changed."""

    def __init__(self, state: State, event: Event) -> None:
        self.state = state
        self.event = event
        super().__init__(f"illegal transition: event {event.name} in state {state.name}")


def advance(state: State, event: Event) -> State:
    """The state after ``event``; raises ``IllegalTransition`` (state unchanged) if not allowed."""
    try:
        return TRANSITIONS[(state, type(event))]
    except KeyError:
        raise IllegalTransition(state, event) from None


def is_terminal(state: State) -> bool:
    return state in TERMINAL
