"""The request lifecycle: every legal edge, every illegal pair, terminal absorption, random walks."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given

from statemachines.diagram import DOC_PATH, document
from statemachines.request import (
    EVENT_TYPES,
    TERMINAL,
    TRANSITIONS,
    AbortRequested,
    Admitted,
    ChunkDone,
    Crashed,
    Demoted,
    DraftDone,
    DraftStarted,
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
    is_terminal,
)

S = State
EXPECTED_EDGES = (
    {
        (S.QUEUED, Admitted, S.PREFILL),
        (S.PREFILL, ChunkDone, S.PREFILL),
        (S.PREFILL, PrefillDone, S.STAGING),
        (S.PREFILL, FinishedAtPrefill, S.FINISHED),
        (S.STAGING, StagingDone, S.READY),
        (S.READY, JoinedBatch, S.DECODE),
        (S.DECODE, DraftStarted, S.DRAFT),
        (S.DECODE, StepDone, S.DECODE),
        (S.DECODE, Finished, S.FINISHED),
        (S.DRAFT, DraftDone, S.VERIFY),
        (S.VERIFY, Verified, S.DECODE),
        (S.VERIFY, Finished, S.FINISHED),
        (S.PREFILL, Retracted, S.QUEUED),
        (S.READY, Retracted, S.QUEUED),
        (S.DECODE, Retracted, S.QUEUED),
        (S.READY, Demoted, S.READY),
        (S.READY, Promoted, S.READY),
        (S.DECODE, Demoted, S.DECODE),
        (S.DECODE, Promoted, S.DECODE),
        (S.DRAFT, Demoted, S.DRAFT),
        (S.DRAFT, Promoted, S.DRAFT),
        (S.VERIFY, Demoted, S.VERIFY),
        (S.VERIFY, Promoted, S.VERIFY),
    }
    | {(s, AbortRequested, S.ABORTED) for s in S if s not in TERMINAL}
    | {(s, Crashed, S.FAILED) for s in S if s not in TERMINAL}
)


def test_the_table_is_exactly_the_documented_lifecycle():
    assert {(s, e, t) for (s, e), t in TRANSITIONS.items()} == EXPECTED_EDGES


@pytest.mark.parametrize(("state", "event", "target"), sorted(EXPECTED_EDGES, key=str))
def test_every_legal_edge(state, event, target):
    assert advance(state, event()) is target


ILLEGAL = [(s, e) for s in S for e in EVENT_TYPES if (s, e) not in TRANSITIONS]


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=[f"{s.name}-{e.__name__}" for s, e in ILLEGAL])
def test_every_illegal_pair_raises_naming_both_and_changes_nothing(state, event):
    current = state
    with pytest.raises(IllegalTransition) as info:
        current = advance(current, event())
    assert current is state
    assert state.name in str(info.value) and event.__name__ in str(info.value)
    assert info.value.state is state


@pytest.mark.parametrize("state", sorted(TERMINAL, key=lambda s: s.name))
def test_terminal_states_absorb_nothing(state):
    assert is_terminal(state)
    for event in EVENT_TYPES:
        with pytest.raises(IllegalTransition):
            advance(state, event())


def test_every_state_is_reachable_and_every_live_state_can_end():
    reachable = {S.QUEUED}
    frontier = [S.QUEUED]
    while frontier:
        state = frontier.pop()
        for (src, _), dst in TRANSITIONS.items():
            if src is state and dst not in reachable:
                reachable.add(dst)
                frontier.append(dst)
    assert reachable == set(S)


@given(st.lists(st.sampled_from(EVENT_TYPES), max_size=60))
def test_random_event_sequences(events):
    """Legal events move along the table, illegal ones change nothing, terminals are final."""
    state = S.QUEUED
    for event_type in events:
        expected = TRANSITIONS.get((state, event_type))
        if expected is None:
            with pytest.raises(IllegalTransition):
                advance(state, event_type())
        else:
            previous, state = state, advance(state, event_type())
            assert state is expected
            assert not is_terminal(previous)


def test_events_are_frozen_values():
    event = Verified(accepted=3)
    assert event == Verified(accepted=3)
    with pytest.raises(AttributeError):
        event.accepted = 4  # type: ignore[misc]


def test_state_diagram_document_is_current():
    assert DOC_PATH.read_text() == document(), "regenerate with: python -m statemachines.diagram --write"
