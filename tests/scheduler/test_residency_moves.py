"""Dynamic residency in the decode part: every ``Demoted`` / ``Promoted`` a decode command's outcome
carries becomes its request's lifecycle event, whatever step of a round the request is in.

The outcomes are hand-built (no model, no executor): each test drives a decode turn, sends the
outcome it chooses with the moves it chooses, and reads the lifecycle events the part logged.
"""

from __future__ import annotations

import attrs
import pytest
import structlog

from pipeline.messages import Decode, Draft, Outcome, Reserve, RoomResult, StepResult, Verify
from pipeline.model.tokenizer import ByteTokenizer
from pipeline.request import Request
from pipeline.sampling import SamplingParams
from pipeline.scheduler import AbortBook, DecodePart
from statemachines.request import Admitted, Demoted, Event, PrefillDone, Promoted, StagingDone, State

TOKENIZER = ByteTokenizer()


def ready(rid: str, **params) -> Request:
    req = Request(rid, (65, 66, 67, 68), SamplingParams(**params), TOKENIZER, 256)
    for event in (Admitted(), PrefillDone(), StagingDone()):
        req.apply(event)
    return req


def drive(turn, answers: dict[type, object], moves: dict[type, tuple[tuple[str, Event], ...]]) -> list[str]:
    """Run ``turn``: each command is answered with ``answers[type]`` and carries ``moves[type]`` as its
    outcome's residency events; the kinds of the commands, in order."""
    kinds = []
    try:
        command = next(turn)
        while True:
            kinds.append(type(command).__name__)
            residency = moves.get(type(command), ())
            command = turn.send(Outcome(answers.get(type(command)), changed=True, residency=residency))
    except StopIteration:
        return kinds


def timeline(logs: list[dict], rid: str) -> list[tuple[str, str, str]]:
    """(event, from state, state) of ``rid``'s lifecycle events, in order."""
    return [
        (e["event"], e["from_state"], e["state"])
        for e in logs
        if "from_state" in e and e["request_id"] == rid
    ]


ROUND = {
    Reserve: RoomResult(("a",), ()),
    Draft: StepResult({}),
    Verify: StepResult({"a": (70, 71, 72)}, accepted={"a": 2}),  # its last three tokens: it ends
}


@pytest.mark.parametrize("move", [Demoted(4096), Promoted(8192)], ids=["demoted", "promoted"])
@pytest.mark.parametrize(
    ("carrier", "where"),
    [
        (Reserve, ("decode", "decode")),  # before the round's DraftStarted
        (Draft, ("draft", "draft")),
        (Verify, ("verify", "verify")),
    ],
    ids=["reserve", "draft", "verify"],
)
def test_a_move_in_the_round_a_request_finishes_in_is_in_its_timeline(move, carrier, where):
    """A request moved during the speculative round that ends it keeps the move in its timeline, in
    the state the round had it in when the move's outcome came back, before its end."""
    part = DecodePart(AbortBook(), num_steps=2)
    req = ready("a", max_new_tokens=3, ignore_eos=True)
    part.accept([req])
    with structlog.testing.capture_logs() as logs:
        kinds = drive(part.turn(), ROUND, {carrier: (("a", move),)})
    assert kinds == ["Reserve", "Draft", "Verify", "Release"]
    assert req.state is State.FINISHED
    steps = [e for e, _, _ in timeline(logs, "a")]
    expected = {
        Reserve: [move.name, "DraftStarted", "DraftDone", "Finished"],
        Draft: ["DraftStarted", move.name, "DraftDone", "Finished"],
        Verify: ["DraftStarted", "DraftDone", move.name, "Finished"],
    }[carrier]
    assert steps == expected
    (marked,) = [e for e in logs if e["event"] == move.name]
    assert (marked["from_state"], marked["state"]) == where
    assert marked.items() >= attrs.asdict(move).items()  # its bytes logged with it


def test_a_move_in_a_plain_step_that_finishes_the_request_comes_before_its_end():
    part = DecodePart(AbortBook(), num_steps=0)
    req = ready("a", max_new_tokens=1, ignore_eos=True)
    part.accept([req])
    with structlog.testing.capture_logs() as logs:
        drive(part.turn(), {Decode: StepResult({"a": (70,)})}, {Decode: (("a", Demoted(512)),)})
    assert timeline(logs, "a") == [("Demoted", "decode", "decode"), ("Finished", "decode", "finished")]


def test_a_move_of_a_request_on_its_way_in_waits_for_it_however_many_turns():
    """The async engine hands a READY request on by message: a decode command may bring its move first.
    The move waits (several turns, if need be) and comes before its joining, in READY."""
    part = DecodePart(AbortBook(), num_steps=0)
    member = ready("a", ignore_eos=True)
    part.accept([member])
    for _ in range(3):
        drive(part.turn(), {Decode: StepResult({"a": (70,)})}, {Decode: (("b", Demoted(1024)),)})
    late = ready("b", ignore_eos=True)
    with structlog.testing.capture_logs() as logs:
        part.accept([late])
    assert timeline(logs, "b") == [("Demoted", "ready", "ready")] * 3 + [("JoinedBatch", "ready", "decode")]
    assert late.state is State.DECODE and member.state is State.DECODE


def test_a_move_brought_after_its_request_ended_is_logged_not_applied():
    """Another part's command moved the request before this part released it (here: aborted at the
    turn's start); the turn's Decode brings the move. The request has ended and the memory the move
    is about is gone: the move is logged with the request's state, never applied."""
    aborts = AbortBook()
    part = DecodePart(aborts, num_steps=0)
    gone, other = ready("a", ignore_eos=True), ready("b", ignore_eos=True)
    part.accept([gone, other])
    aborts.add("a")
    with structlog.testing.capture_logs() as logs:
        kinds = drive(part.turn(), {Decode: StepResult({"b": (70,)})}, {Decode: (("a", Demoted(2048)),)})
    assert kinds == ["Release", "Decode"]
    assert gone.state is State.ABORTED
    assert [e for e, _, _ in timeline(logs, "a")] == ["AbortRequested"]
    (late,) = [e for e in logs if e["event"] == "scheduler.move_after_release"]
    assert (late["request_id"], late["move"], late["state"]) == ("a", "Demoted", "aborted")
    assert late["freed_bytes"] == 2048


def test_a_move_brought_after_a_retraction_is_logged_and_one_after_that_waits_for_the_rejoin():
    """A request retracted after a Decode whose next Decode brings a move made before its release:
    logged (it is QUEUED, and the memory is gone). From then on a move of it is of its new memory:
    re-admitted, on its way in again, it gets the move when it joins."""
    part = DecodePart(AbortBook(), num_steps=0)
    gone, other = ready("a", ignore_eos=True), ready("b", ignore_eos=True)
    part.accept([gone, other])
    drive(part.turn(), {Decode: StepResult({"b": (70,)}, refused=("a",))}, {})
    assert gone.state is State.QUEUED
    with structlog.testing.capture_logs() as logs:
        drive(part.turn(), {Decode: StepResult({"b": (71,)})}, {Decode: (("a", Demoted(2048)),)})
    assert not timeline(logs, "a") and gone.state is State.QUEUED
    (late,) = [e for e in logs if e["event"] == "scheduler.move_after_release"]
    assert (late["request_id"], late["move"], late["state"]) == ("a", "Demoted", "queued")
    # re-admitted and staged again; its new memory is promoted before it joins
    for event in (Admitted(), PrefillDone(), StagingDone()):
        gone.apply(event)
    with structlog.testing.capture_logs() as logs:
        drive(part.turn(), {Decode: StepResult({"b": (72,)})}, {Decode: (("a", Promoted(64)),)})
        part.accept([gone])
    assert timeline(logs, "a") == [("Promoted", "ready", "ready"), ("JoinedBatch", "ready", "decode")]
    assert not [e for e in logs if e["event"] == "scheduler.move_after_release"]


def test_a_removed_member_takes_no_move_brought_later():
    """``remove`` (a driver ending a member itself) counts as leaving: a move brought after it is
    logged, not kept for a joining that never comes."""
    part = DecodePart(AbortBook(), num_steps=0)
    gone, other = ready("a", ignore_eos=True), ready("b", ignore_eos=True)
    part.accept([gone, other])
    assert part.remove("a") is gone and part.remove("a") is None and list(part.members) == ["b"]
    with structlog.testing.capture_logs() as logs:
        drive(part.turn(), {Decode: StepResult({"b": (70,)})}, {Decode: (("a", Promoted(64)),)})
    assert [e["request_id"] for e in logs if e["event"] == "scheduler.move_after_release"] == ["a"]
    assert not part._arriving
