"""Stateful property test of the request lifecycle: requests live their documented lives.

A shadow model written from statemachines/request.py's theory of operation says what may happen to
a request in which state, and where it leads: admission, prompt chunks, the end of prefill (or a
first token that ends it), staging, joining the batch, plain steps, draft and verify rounds,
retraction under memory pressure, demotion and promotion (dynamic residency: the KV of a request
holding its decode memory, READY, DECODE, DRAFT or VERIFY, leaves the device or comes back, its
state unchanged), finishes, and aborts and crashes in any live state. Several requests live at
once; a rule picks one of the model's edges and a live request, walks the request there along the
model's shortest way, and takes the edge, each happening through ``advance``, which must reach the
model's state; another rule tries an event the model says cannot happen, which must raise and
change nothing (terminal states absorb nothing). So every edge of the table is walked, and an edge
missing from it, or one too many, fails a rule.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from shadow_model import machine_settings

from statemachines.request import (
    EVENT_TYPES,
    TERMINAL,
    AbortRequested,
    Admitted,
    ChunkDone,
    Crashed,
    Demoted,
    DraftDone,
    DraftStarted,
    Event,
    Finished,
    FinishedAtPrefill,
    IllegalTransition,
    JoinedBatch,
    PrefillDone,
    Promoted,
    Retracted,
    StagingDone,
    State,
    StepDone,
    Verified,
    advance,
)

S = State
LIVE = frozenset(S) - TERMINAL
# the model, written from the theory of operation: what may happen in which state, and where it leads
# (None: the state stays as it was, as a demotion or a promotion leaves it)
HAPPENINGS: dict[type[Event], tuple[frozenset[State], State | None]] = {
    Admitted: (frozenset({S.QUEUED}), S.PREFILL),
    ChunkDone: (frozenset({S.PREFILL}), S.PREFILL),
    PrefillDone: (frozenset({S.PREFILL}), S.STAGING),
    FinishedAtPrefill: (frozenset({S.PREFILL}), S.FINISHED),
    StagingDone: (frozenset({S.STAGING}), S.READY),
    JoinedBatch: (frozenset({S.READY}), S.DECODE),
    StepDone: (frozenset({S.DECODE}), S.DECODE),
    DraftStarted: (frozenset({S.DECODE}), S.DRAFT),
    DraftDone: (frozenset({S.DRAFT}), S.VERIFY),
    Verified: (frozenset({S.VERIFY}), S.DECODE),
    Finished: (frozenset({S.DECODE, S.VERIFY}), S.FINISHED),
    Retracted: (frozenset({S.PREFILL, S.READY, S.DECODE}), S.QUEUED),
    Demoted: (frozenset({S.READY, S.DECODE, S.DRAFT, S.VERIFY}), None),
    Promoted: (frozenset({S.READY, S.DECODE, S.DRAFT, S.VERIFY}), None),
    AbortRequested: (LIVE, S.ABORTED),
    Crashed: (LIVE, S.FAILED),
}


# every (state, event) the model allows
EDGES = [(state, event) for event, (sources, _) in HAPPENINGS.items() for state in sorted(sources, key=str)]


def path(start: State, goal: State) -> list[type[Event]]:
    """The shortest run of non-ending happenings from ``start`` to ``goal``, by the model."""
    seen, frontier = {start: []}, [start]
    while frontier:
        state = frontier.pop(0)
        if state is goal:
            return seen[state]
        for event, (sources, target) in HAPPENINGS.items():
            if state in sources and target is not None and target not in TERMINAL and target not in seen:
                seen[target] = [*seen[state], event]
                frontier.append(target)
    raise AssertionError(f"the model has no way from {start} to {goal}")


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.states: list[State] = []  # the real states, as ``advance`` returned them
        self.model: list[State] = []  # the shadow model's

    @rule()
    def accept(self) -> None:
        self.states.append(S.QUEUED)
        self.model.append(S.QUEUED)

    def _apply(self, i: int, event: type[Event]) -> None:
        """``event`` happens to request ``i``: the state becomes the one the model says."""
        sources, leads_to = HAPPENINGS[event]
        before = self.model[i]
        assert before in sources
        target = before if leads_to is None else leads_to
        self.states[i] = advance(self.states[i], event())
        self.model[i] = target
        assert self.states[i] is target, f"{event.__name__} in {before.name} must lead to {target.name}"

    @rule(data=st.data(), edge=st.sampled_from(EDGES))
    def live(self, data, edge: tuple[State, type[Event]]) -> None:
        """A live request lives on (prefill, staging, decode and speculative rounds, retractions) until
        it is in the edge's state, then the edge's event happens to it."""
        state, event = edge
        live = [i for i, s in enumerate(self.model) if s not in TERMINAL]
        if not live:
            self.accept()
            live = [len(self.model) - 1]
        i = data.draw(st.sampled_from(live))
        for step in path(self.model[i], state):
            self._apply(i, step)
        self._apply(i, event)

    @precondition(lambda self: bool(self.states))
    @rule(data=st.data(), event=st.sampled_from(EVENT_TYPES))
    def impossible(self, data, event: type[Event]) -> None:
        """An event that cannot happen in a request's state raises and changes nothing."""
        sources, _ = HAPPENINGS[event]
        unable = [i for i, state in enumerate(self.model) if state not in sources]
        if not unable:
            return
        i = data.draw(st.sampled_from(unable))
        before = self.states[i]
        with pytest.raises(IllegalTransition):
            self.states[i] = advance(before, event())
        assert self.states[i] is before

    @invariant()
    def states_match_the_model(self) -> None:
        assert self.states == self.model


TestLifecycleMachine = pytest.mark.proptest(LifecycleMachine.TestCase)
TestLifecycleMachine.settings = machine_settings(examples=60, steps=40)
