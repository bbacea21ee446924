"""The scheduling core with hand-built outcomes: no model, no executor, no event loop.

Each test drives a part's turn (a generator of commands) by sending the outcome the test chooses, and
checks the commands it yields, in order, and the states and hand-off it leaves.
"""

from __future__ import annotations

import itertools

import pytest
import structlog

from pipeline.messages import (
    Admit,
    AdmitResult,
    CollectReady,
    Decode,
    Draft,
    Outcome,
    Prefill,
    PrefillResult,
    ReadyResult,
    Reserve,
    RoomResult,
    StepResult,
    Verify,
)
from pipeline.model.tokenizer import ByteTokenizer
from pipeline.request import Request
from pipeline.sampling import SamplingParams
from pipeline.scheduler import (
    MAX_PROBE_DOUBLINGS,
    AbortBook,
    AdmissionPart,
    DecodePart,
    PrefillPace,
    PrefillPart,
    Scheduler,
    SpecPolicy,
    StagingPart,
)
from statemachines.request import (
    AbortRequested,
    Admitted,
    JoinedBatch,
    PrefillDone,
    StagingDone,
    State,
)

TOKENIZER = ByteTokenizer()


def request(rid: str, prompt_len: int = 4, **params) -> Request:
    return Request(rid, tuple(range(65, 65 + prompt_len)), SamplingParams(**params), TOKENIZER, 256)


def in_state(rid: str, state: State, **params) -> Request:
    req = request(rid, **params)
    path = {
        State.PREFILL: [Admitted()],
        State.STAGING: [Admitted(), PrefillDone()],
        State.READY: [Admitted(), PrefillDone(), StagingDone()],
        State.DECODE: [Admitted(), PrefillDone(), StagingDone(), JoinedBatch()],
    }[state]
    for event in path:
        req.apply(event)
    return req


class Script:
    """Drives a turn: ``answers`` maps a command type to the result (or a callable of the command)."""

    def __init__(self, turn, answers: dict[type, object]) -> None:
        self.turn = turn
        self.answers = answers
        self.commands: list[object] = []

    def run(self):
        try:
            command = next(self.turn)
            while True:
                self.commands.append(command)
                answer = self.answers.get(type(command))
                if isinstance(answer, Exception):
                    outcome = Outcome(None, error=f"{type(answer).__name__}: {answer}", changed=True)
                else:
                    result = answer(command) if callable(answer) else answer
                    outcome = Outcome(result, changed=True)
                command = self.turn.send(outcome)
        except StopIteration as stop:
            return stop.value

    def kinds(self) -> list[str]:
        return [type(c).__name__ for c in self.commands]


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


# --- admission ---------------------------------------------------------------------------------------


def test_admission_offers_the_budgeted_head_and_takes_what_the_executor_admitted():
    part = AdmissionPart(max_prefill_tokens=10, aborts=AbortBook())
    reqs = [request(f"r{i}", n) for i, n in enumerate([4, 5, 3, 2])]
    for r in reqs:
        part.push(r)
    script = Script(part.turn(), {Admit: AdmitResult(("r0",))})
    handoff = script.run()
    (admit,) = script.commands
    assert [s.request_id for s in admit.sequences] == ["r0", "r1"]  # budget 10: 4 + 5, then 3 is over
    assert ids(handoff.onward) == ["r0"] and reqs[0].state is State.PREFILL
    assert ids(part.queue) == ["r1", "r2", "r3"] and reqs[1].state is State.QUEUED
    assert not part.waiting_for_memory


@pytest.mark.parametrize(
    ("admitted", "queue_after", "waiting"),
    [
        ((), ["a", "b", "c"], True),  # the head does not fit: nobody overtakes it, admission waits
        (("a",), ["b", "c"], False),
        (("a", "b"), ["c"], False),
        (("a", "b", "c"), [], False),
    ],
)
def test_admission_takes_exactly_the_admitted_prefix(admitted, queue_after, waiting):
    part = AdmissionPart(max_prefill_tokens=100, aborts=AbortBook())
    for rid in "abc":
        part.push(request(rid))
    handoff = Script(part.turn(), {Admit: AdmitResult(admitted)}).run()
    assert ids(handoff.onward) == list(admitted)
    assert ids(part.queue) == queue_after
    assert part.waiting_for_memory is waiting


def test_admission_head_longer_than_the_budget_goes_alone_and_retracted_go_first():
    part = AdmissionPart(max_prefill_tokens=3, aborts=AbortBook())
    long, short = request("long", 9), request("short", 1)
    part.push(long)
    part.push(short)
    assert ids(part.candidates()) == ["long"]
    part.requeue([request("a"), request("b")])
    assert ids(part.queue) == ["a", "b", "long", "short"]


def test_admission_ends_queued_aborts_without_a_release():
    aborts = AbortBook()
    part = AdmissionPart(max_prefill_tokens=100, aborts=aborts)
    victim, other = request("victim"), request("other")
    part.push(victim)
    part.push(other)
    aborts.add("victim")
    script = Script(part.turn(), {Admit: AdmitResult(("other",))})
    handoff = script.run()
    assert script.kinds() == ["Admit"]  # a QUEUED request holds no memory: nothing to release
    assert victim.state is State.ABORTED and victim.finish_reason == "abort"
    assert ids(handoff.ended) == ["victim"] and ids(handoff.onward) == ["other"]


def test_admission_command_error_fails_the_candidates_and_releases_them():
    part = AdmissionPart(max_prefill_tokens=100, aborts=AbortBook())
    reqs = [request("a"), request("b")]
    for r in reqs:
        part.push(r)
    script = Script(part.turn(), {Admit: RuntimeError("boom")})
    handoff = script.run()
    assert script.kinds() == ["Admit", "Release"] and script.commands[1].request_ids == ("a", "b")
    assert [r.state for r in reqs] == [State.FAILED, State.FAILED]
    assert reqs[0].error == "RuntimeError: boom" and ids(handoff.ended) == ["a", "b"]


# --- prefill -----------------------------------------------------------------------------------------


def test_prefill_sorts_each_request_by_its_first_token():
    aborts = AbortBook()
    lengths = [("ok", 5), ("one", 1), ("gone", 5), ("bad", 5)]
    reqs = [in_state(rid, State.PREFILL, max_new_tokens=n) for rid, n in lengths]
    part = PrefillPart(aborts)
    part.accept(reqs)

    def answer(command):
        aborts.add("gone")  # arrives while the forward runs
        return PrefillResult({"ok": 70, "one": 71, "gone": 72}, failed={"bad": "ValueError: x"})

    script = Script(part.turn(), {Prefill: answer})
    handoff = script.run()
    assert script.kinds() == ["Prefill", "Release", "Release"]
    released = [set(c.request_ids) for c in script.commands[1:]]
    assert released == [{"one", "gone"}, {"bad"}] and not script.commands[2].cache  # released before ending
    by_id = {r.request_id: r for r in reqs}
    assert by_id["ok"].state is State.STAGING and by_id["ok"].output_ids == [70]
    assert by_id["one"].state is State.FINISHED and by_id["one"].finish_reason == "length"
    assert by_id["gone"].state is State.ABORTED
    assert by_id["bad"].state is State.FAILED and by_id["bad"].error == "ValueError: x"
    assert ids(handoff.onward) == ["ok"] and set(ids(handoff.ended)) == {"one", "gone", "bad"}
    assert len(part) == 0


def test_prefill_aborts_before_the_forward_skip_it():
    aborts = AbortBook({"a"})
    reqs = [in_state("a", State.PREFILL), in_state("b", State.PREFILL)]
    part = PrefillPart(aborts)
    part.accept(reqs)
    script = Script(part.turn(), {Prefill: PrefillResult({"b": 66})})
    script.run()
    assert script.kinds() == ["Release", "Prefill"] and script.commands[1].request_ids == ("b",)


def test_a_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    """Chunks and budget 10: a 25-token prompt takes three forwards (10, 10, 5); a 4-token prompt
    behind it shares the third. Each chunk that does not end its prompt logs ``ChunkDone`` and stays."""
    long = request("long", prompt_len=25, max_new_tokens=5)
    short = request("short", prompt_len=4, max_new_tokens=5)
    for req in (long, short):
        req.apply(Admitted())
    part = PrefillPart(AbortBook(), chunk_tokens=10, batch_tokens=10)
    part.accept([long, short])
    seen = []

    def answer(command):
        seen.append([(c.request_id, c.start, c.end) for c in command.chunks])
        done = {c.request_id: 70 for c in command.chunks if c.end == {"long": 25, "short": 4}[c.request_id]}
        return PrefillResult(done)

    for _ in range(3):
        handoff = Script(part.turn(), {Prefill: answer}).run()
        if len(seen) < 3:
            assert long.state is State.PREFILL and not handoff.onward
    assert seen == [[("long", 0, 10)], [("long", 10, 20)], [("long", 20, 25), ("short", 0, 4)]]
    assert ids(handoff.onward) == ["long", "short"] and len(part) == 0
    assert long.state is State.STAGING and long.output_ids == [70]


def test_a_forward_budget_above_the_chunk_carries_several_requests_chunks():
    """Chunks of 10 within a forward budget of 24: the long prompt gets one chunk a forward, the
    short prompts behind it share the forward up to the budget (the last one cut to what is left)."""
    reqs = [request("long", prompt_len=25, max_new_tokens=5), request("a", prompt_len=8, max_new_tokens=5),
            request("b", prompt_len=9, max_new_tokens=5)]
    for req in reqs:
        req.apply(Admitted())
    part = PrefillPart(AbortBook(), chunk_tokens=10, batch_tokens=24)
    part.accept(reqs)
    ends = {"long": 25, "a": 8, "b": 9}
    seen = []

    def answer(command):
        seen.append([(c.request_id, c.start, c.end) for c in command.chunks])
        return PrefillResult({c.request_id: 70 for c in command.chunks if c.end == ends[c.request_id]})

    while len(part):
        Script(part.turn(), {Prefill: answer}).run()
    assert seen == [
        [("long", 0, 10), ("a", 0, 8), ("b", 0, 6)],
        [("long", 10, 20), ("b", 6, 9)],
        [("long", 20, 25)],
    ]


# --- staging -----------------------------------------------------------------------------------------


def test_staging_hands_on_in_fifo_order_and_fails_a_broken_copy_alone():
    part = StagingPart(AbortBook())
    reqs = [in_state(rid, State.STAGING) for rid in "abc"]
    part.accept(reqs)
    result = ReadyResult(("a",), waited=False, failed={"b": "staging copy failed: OSError: disk"})
    script = Script(part.turn(), {CollectReady: result})
    handoff = script.run()
    assert script.commands[0].request_ids == ("a", "b", "c")
    assert script.kinds() == ["CollectReady", "Release"] and script.commands[1].request_ids == ("b",)
    assert ids(handoff.onward) == ["a"] and reqs[0].state is State.READY
    assert reqs[1].state is State.FAILED and reqs[2].state is State.STAGING
    assert list(part.owned) == ["c"] and not part.waiting_for_memory


def test_staging_waits_for_memory_only_after_a_poll_that_waited():
    part = StagingPart(AbortBook())
    part.accept([in_state("a", State.STAGING)])
    Script(part.turn(), {CollectReady: ReadyResult((), waited=False)}).run()
    assert not part.waiting_for_memory  # copies in flight: poll again behind other commands
    Script(part.turn(), {CollectReady: ReadyResult((), waited=True)}).run()
    assert part.waiting_for_memory


# --- decode ------------------------------------------------------------------------------------------


def decode_part(num_steps: int, *rids: str, **params) -> tuple[DecodePart, AbortBook, list[Request]]:
    aborts = AbortBook()
    part = DecodePart(aborts, num_steps)
    reqs = [in_state(rid, State.READY, **params) for rid in rids]
    part.accept(reqs)
    return part, aborts, reqs


def test_plain_step_settles_tokens_retracts_the_refused_and_fails_the_failed():
    part, _, reqs = decode_part(0, "a", "b", "c", "d", max_new_tokens=2)
    reqs[1].output_ids.append(1)  # b reaches its length with this step's token
    result = StepResult({"a": (66,), "b": (67,)}, refused=("c",), failed={"d": "boom"})
    script = Script(part.turn(), {Decode: result})
    handoff = script.run()
    assert script.kinds() == ["Decode", "Release", "Release", "Release"]
    retract, end, failed = script.commands[1:]
    assert retract.request_ids == ("c",) and retract.keep_sampling_state  # its random stream goes on
    assert end.request_ids == ("b",) and not end.keep_sampling_state and end.cache
    # a failed request's memory is not trusted: nothing of it goes to the prefix cache
    assert failed.request_ids == ("d",) and not failed.cache
    assert [r.state for r in reqs] == [State.DECODE, State.FINISHED, State.QUEUED, State.FAILED]
    assert reqs[1].finish_reason == "length" and reqs[2].metrics.num_retractions == 1
    assert ids(handoff.requeue) == ["c"] and list(part.members) == ["a"]
    assert set(ids(handoff.notify)) == {"a", "b"}


def test_speculative_round_order():
    part, aborts, reqs = decode_part(2, "a", "b", "c", ignore_eos=True)
    seen = []

    def draft(command):
        seen.append([r.state for r in reqs])
        aborts.add("b")  # arrives while drafting: takes effect between draft and verify
        return StepResult({})

    answers = {
        Reserve: RoomResult(("a", "b"), refused=("c",)),
        Draft: draft,
        Verify: StepResult({"a": (70, 71, 72)}, accepted={"a": 2}),
    }
    script = Script(part.turn(), answers)
    script.run()
    assert script.kinds() == ["Reserve", "Release", "Draft", "Release", "Verify"]
    reserve = script.commands[0]
    assert reserve.request_ids == ("a", "b", "c") and reserve.new_tokens == 3  # D = num_steps + 1
    assert script.commands[1].request_ids == ("c",) and script.commands[1].keep_sampling_state
    # c was retracted while still in DECODE (there is no way back to the queue from DRAFT)
    assert seen == [[State.DRAFT, State.DRAFT, State.QUEUED]]
    assert script.commands[3].request_ids == ("b",) and script.commands[4].request_ids == ("a",)
    assert [r.state for r in reqs] == [State.DECODE, State.ABORTED, State.QUEUED]
    assert reqs[0].output_ids == [70, 71, 72] and reqs[0].metrics.spec.accepted_drafts == 2


def test_round_events_in_order_for_one_request():
    part, _, _ = decode_part(3, "a", ignore_eos=True)
    answers = {
        Reserve: RoomResult(("a",), ()),
        Draft: StepResult({}),
        Verify: StepResult({"a": (5,)}, accepted={"a": 0}),
    }
    with structlog.testing.capture_logs() as logs:
        Script(part.turn(), answers).run()
    assert [e["event"] for e in logs] == ["DraftStarted", "DraftDone", "Verified"]
    assert logs[1]["num_steps"] == 3 and logs[2]["accepted"] == 1
    assert all(e["request_id"] == "a" for e in logs)


def test_a_command_error_fails_only_that_commands_requests():
    part, _, reqs = decode_part(2, "a", "b")
    answers = {Reserve: RoomResult(("a",), ()), Draft: RuntimeError("device fell over")}
    # b has no room this round but is not refused either: it simply is not in this round's batch
    handoff = Script(part.turn([reqs[0]]), answers).run()
    assert reqs[0].state is State.FAILED and reqs[0].error == "RuntimeError: device fell over"
    assert reqs[1].state is State.DECODE and ids(handoff.ended) == ["a"]


def test_decode_aborts_come_first_and_parked_requests_are_left_out():
    part, aborts, reqs = decode_part(0, "a", "b", "c")
    aborts.add("a")
    script = Script(part.turn([reqs[1]]), {Decode: StepResult({"b": (9,)})})  # c is parked
    script.run()
    assert script.kinds() == ["Release", "Decode"]
    assert script.commands[0].request_ids == ("a",) and script.commands[1].request_ids == ("b",)
    assert [r.state for r in reqs] == [State.ABORTED, State.DECODE, State.DECODE]


# --- the whole core ----------------------------------------------------------------------------------


def test_registry_check_finds_a_request_in_the_wrong_container():
    core = Scheduler.build(max_prefill_tokens=64, num_steps=0)
    queued, decoding = request("q"), in_state("d", State.DECODE)
    core.admission.push(queued)
    core.decode.members["d"] = decoding
    core.check_integrity([queued, decoding])
    core.staging.owned["q"] = queued  # held twice
    with pytest.raises(AssertionError, match="held by"):
        core.check_integrity([queued, decoding])
    core.staging.owned.clear()
    core.admission.remove({"q"})
    core.staging.owned["q"] = queued  # QUEUED, but held by staging
    with pytest.raises(AssertionError, match="QUEUED but held by staging"):
        core.check_integrity([queued, decoding])
    with pytest.raises(AssertionError, match="not live"):
        core.check_integrity([decoding])


def test_abort_event_sets_the_finish_reason_once():
    req = request("r")
    req.apply(AbortRequested())
    assert req.finish_reason == "abort" and req.metrics.finished_time is not None


# --- adaptive speculation ------------------------------------------------------------------------------


def test_spec_policy_batch_size_rule():
    policy = SpecPolicy(max_batch_size=8)
    assert policy.speculate(1) and policy.speculate(8) and not policy.speculate(9)
    assert SpecPolicy().speculate(1000)  # no limit


def test_spec_policy_acceptance_rule_with_probes():
    policy = SpecPolicy(min_accept_length=1.5, probe_every=3)
    assert policy.speculate(4)  # nothing measured yet
    policy.record_round([1, 1, 1, 2])  # mean 1.25
    assert policy.accept_length == 1.25 and not policy.speculate(4)
    for _ in range(3):
        policy.record_plain_step()
    assert policy.speculate(4)  # a probe round after probe_every plain steps
    for _ in range(10):
        policy.record_round([4, 4])  # drafts accepted again: the average climbs back
    assert policy.accept_length > 1.5 and policy.speculate(4)


def test_spec_policy_timed_rule_follows_the_faster_mode_and_probes_the_slower():
    policy = SpecPolicy(max_batch_size=8, probe_every=3, timed=True, warm_up_turns=0)
    assert policy.speculate(1)  # a request served alone always speculates
    policy.record_time(1, 10, 1.0, speculative=False)  # and batches of one are not timed
    assert policy.rates == {}
    assert policy.speculate(4)  # nothing measured at 4..7: a round first
    policy.record_time(4, 8, 1.0, speculative=True)  # rounds: 8 tokens/s
    assert not policy.speculate(5)  # then a plain step (same group 4..7)
    policy.record_time(5, 20, 1.0, speculative=False)  # plain: 20 tokens/s
    assert policy.speculate(2)  # another group (2..3) measures for itself
    choices = []
    for _ in range(11):
        spec = policy.speculate(6)
        choices.append(spec)
        policy.record_time(6, 8 if spec else 20, 1.0, speculative=spec)
    # plain wins; after probe_every plain turns one round runs again, and plain resumes; the probe
    # kept plain in the lead, so the next one waits twice as long
    assert choices == [False, False, False, True] + [False] * 6 + [True]
    assert policy.doublings[3] == 2
    for _ in range(70):  # rounds get cheaper (acceptance rose): the lead changes hands
        spec = policy.speculate(6)
        policy.record_time(6, 40 if spec else 20, 1.0, speculative=spec)
    assert policy.speculate(6) and policy.rates[3][0] > policy.rates[3][1]
    assert not policy.speculate(9)  # above max_batch_size, plain whatever was measured


def test_spec_policy_timed_rule_probes_a_steady_loser_ever_less_often_up_to_a_cap():
    """Each probe that keeps the lead doubles the interval (at most ``2 ** MAX_PROBE_DOUBLINGS``
    times); a change of lead, by a probe or by the winner's own turns, resets it."""
    policy = SpecPolicy(max_batch_size=8, probe_every=2, timed=True, warm_up_turns=0)
    policy.record_time(4, 8, 1.0, speculative=True)
    policy.record_time(4, 20, 1.0, speculative=False)  # plain leads
    probes = []
    for turn in range(80):
        spec = policy.speculate(4)
        if spec:
            probes.append(turn)
        policy.record_time(4, 8 if spec else 20, 1.0, speculative=spec)
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    cap = 2 << MAX_PROBE_DOUBLINGS
    assert probes[0] == 2 and gaps[:3] == [5, 9, 17] and set(gaps[3:]) == {cap + 1}
    assert policy.doublings[3] == MAX_PROBE_DOUBLINGS
    for _ in range(10):  # plain steps slow down until rounds lead: watched closely again
        spec = policy.speculate(4)
        policy.record_time(4, 8 if spec else 1, 1.0, speculative=spec)
        if policy.rates[3][0] > policy.rates[3][1]:
            break
    assert not spec and policy.rates[3][0] > policy.rates[3][1]  # the winner's own turns lost the lead
    assert policy.doublings[3] == 0


def test_spec_policy_timed_rule_skips_each_modes_warm_up_turns():
    """A fresh engine's first round pays one-off costs: the first turn of each mode at a size is
    tried but not counted, so one slow first round does not hand the batch to plain steps."""
    policy = SpecPolicy(max_batch_size=8, probe_every=16, timed=True)  # warm_up_turns=1
    turns = []
    for _ in range(6):
        spec = policy.speculate(4)
        turns.append(spec)
        first = len([t for t in turns if t == spec]) == 1
        rate = (5 if first else 30) if spec else 20  # the first round is slow, the next ones are not
        policy.record_time(4, rate, 1.0, speculative=spec)
    # round (warm-up), round (30 tokens/s), plain (warm-up), plain (20): rounds win from then on
    assert turns == [True, True, False, False, True, True]
    assert policy.rates[3] == [30.0, 20.0]
    assert policy.speculate(2)  # another group warms up for itself
    policy.record_time(2, 1, 1.0, speculative=True)
    assert 2 not in policy.rates and policy.warmed[2] == [1, 0]


def test_spec_policy_times_a_greedy_request_served_alone():
    """Alone, a greedy request's tokens are the same either way, so the timed rule decides for it
    too (a request whose drafts are rarely accepted decodes plainly); a sampled one always rounds."""
    policy = SpecPolicy(max_batch_size=8, probe_every=2, timed=True, warm_up_turns=0)
    assert policy.speculate(1, greedy=True)  # nothing measured: a round first
    policy.record_time(1, 2, 1.0, speculative=True, greedy=True)  # rounds: 2 tokens/s
    assert not policy.speculate(1, greedy=True)  # then a plain step
    policy.record_time(1, 6, 1.0, speculative=False, greedy=True)  # plain: 6 tokens/s
    choices = []
    for _ in range(8):
        spec = policy.speculate(1, greedy=True)
        choices.append(spec)
        policy.record_time(1, 2 if spec else 6, 1.0, speculative=spec, greedy=True)
    assert choices == [False, False, True, False, False, False, False, True]  # plain, probing rounds
    assert policy.speculate(1)  # a sampled request alone: always a round
    policy.record_time(1, 1, 1.0, speculative=True)  # and not timed
    assert policy.rates[1][0] < policy.rates[1][1]


def test_decode_part_times_its_turns_for_the_policy():
    aborts = AbortBook()
    part = DecodePart(aborts, 2, SpecPolicy(timed=True, warm_up_turns=0))
    reqs = [in_state(rid, State.READY, ignore_eos=True) for rid in "ab"]
    part.accept(reqs)
    script = Script(part.turn(), {Reserve: RoomResult(("a", "b"), ()), Draft: StepResult({}),
                                  Verify: StepResult({"a": (7, 8), "b": (9,)}, accepted={"a": 1, "b": 0})})
    script.run()
    assert part.policy.rates[2][0] is not None and part.policy.rates[2][1] is None
    script = Script(part.turn(), {Decode: StepResult({"a": (5,), "b": (6,)})})
    script.run()
    assert script.kinds() == ["Decode"] and part.policy.rates[2][1] is not None


def test_decode_part_takes_a_plain_step_when_the_policy_says_so():
    aborts = AbortBook()
    part = DecodePart(aborts, 2, SpecPolicy(max_batch_size=1))
    reqs = [in_state(rid, State.READY, ignore_eos=True) for rid in "ab"]
    part.accept(reqs)
    script = Script(part.turn(), {Decode: StepResult({"a": (5,), "b": (6,)})})
    script.run()
    assert script.kinds() == ["Decode"]  # two requests > max_batch_size 1: no round
    script = Script(part.turn([reqs[0]]), {Reserve: RoomResult(("a",), ()), Draft: StepResult({}),
                                          Verify: StepResult({"a": (7, 8)}, accepted={"a": 1})})
    script.run()
    assert script.kinds() == ["Reserve", "Draft", "Verify"] and part.policy.accept_length == 2


def test_decode_part_decodes_plainly_past_the_context_limit():
    """``max_context``: a turn is a round only while every request of the batch holds at most that
    many tokens (prompt and output); one longer request makes the whole turn a plain step."""
    aborts = AbortBook()
    part = DecodePart(aborts, 2, SpecPolicy(max_context=12))
    reqs = [in_state(rid, State.READY, ignore_eos=True) for rid in "ab"]
    part.accept(reqs)
    held = len(reqs[0].prompt_ids)
    assert held <= 12 and len(reqs[1].prompt_ids) <= 12
    reqs[1].output_ids.extend([1] * (12 - len(reqs[1].prompt_ids)))  # exactly at the limit: a round
    script = Script(part.turn(), {Reserve: RoomResult(("a", "b"), ()), Draft: StepResult({}),
                                  Verify: StepResult({"a": (7,), "b": (9,)}, accepted={"a": 0, "b": 0})})
    script.run()
    assert script.kinds() == ["Reserve", "Draft", "Verify"]
    assert len(reqs[1].prompt_ids) + len(reqs[1].output_ids) == 13  # one past it: plain steps
    script = Script(part.turn(), {Decode: StepResult({"a": (5,), "b": (6,)})})
    script.run()
    assert script.kinds() == ["Decode"]
    script = Script(part.turn([reqs[0]]), {Reserve: RoomResult(("a",), ()), Draft: StepResult({}),
                                          Verify: StepResult({"a": (7, 8)}, accepted={"a": 1})})
    script.run()
    assert script.kinds() == ["Reserve", "Draft", "Verify"]  # the short one alone is within it


def test_decode_part_decodes_plainly_for_the_last_tokens_of_every_stream():
    """A round commits at most D = num_steps + 1 tokens a request: while no request of the batch may
    produce D more, the turn is a plain step (no catch-up of the MTP layer for a token or two)."""
    part, _, reqs = decode_part(2, "a", "b", ignore_eos=True, max_new_tokens=5)
    part.policy.plain_tail = True
    for req in reqs:
        req.output_ids.extend([1, 2, 3])  # 2 tokens left each, D = 3
    assert [r.tokens_left for r in reqs] == [2, 2]
    script = Script(part.turn(), {Decode: StepResult({"a": (5,), "b": (6,)})})
    script.run()
    assert script.kinds() == ["Decode"]
    part, _, reqs = decode_part(2, "a", "b", ignore_eos=True, max_new_tokens=5)
    part.policy.plain_tail = True
    reqs[0].output_ids.extend([1, 2, 3])  # b may still produce 5: a round pays for it
    script = Script(part.turn(), {Reserve: RoomResult(("a", "b"), ()), Draft: StepResult({}),
                                  Verify: StepResult({"a": (7,), "b": (8, 9)}, accepted={"a": 0, "b": 1})})
    script.run()
    assert script.kinds() == ["Reserve", "Draft", "Verify"]
    part, _, reqs = decode_part(2, "a", ignore_eos=True, max_new_tokens=5)  # the rule off: a round
    reqs[0].output_ids.extend([1, 2, 3])
    script = Script(part.turn(), {Reserve: RoomResult(("a",), ()), Draft: StepResult({}),
                                  Verify: StepResult({"a": (7,)}, accepted={"a": 0})})
    script.run()
    assert script.kinds() == ["Reserve", "Draft", "Verify"]


def test_request_tokens_left_counts_the_context_bound_too():
    req = request("a", prompt_len=250, max_new_tokens=64)  # a context of 256
    assert req.tokens_left == 6
    req.output_ids.extend([1, 2])
    assert request("b", max_new_tokens=3).tokens_left == 3 and req.tokens_left == 4


@pytest.mark.parametrize(("mixes", "rule"), [(True, True), (False, True), (True, False)])
def test_speculation_pauses_while_prompts_wait_for_a_mixed_step(mixes, rule):
    """With mixed steps, a plain step carries the next prefill chunk in its own forward, which a
    round (several commands) cannot: while a prompt waits, the decode turns are plain steps."""
    policy = SpecPolicy(plain_while_prefilling=rule)
    core = Scheduler.build(max_prefill_tokens=64, num_steps=2, mixes=mixes, policy=policy)
    reqs = [in_state(rid, State.READY, ignore_eos=True) for rid in "ab"]
    core.decode.accept(reqs)
    core.prefill.accept([in_state("p", State.PREFILL)])
    round_answers = {Reserve: RoomResult(("a", "b"), ()), Draft: StepResult({}),
                     Verify: StepResult({"a": (7,), "b": (8,)}, accepted={"a": 0, "b": 0})}
    answers = {Decode: StepResult({"a": (5,), "b": (6,)}), **round_answers}
    script = Script(core.decode.turn(), answers)
    script.run()
    assert script.kinds() == (["Decode"] if mixes and rule else ["Reserve", "Draft", "Verify"])
    core.prefill.remove("p")  # its prompt is done: rounds again
    script = Script(core.decode.turn(), answers)
    script.run()
    assert script.kinds() == ["Reserve", "Draft", "Verify"]


def test_prefill_pace_sizes_a_chunk_to_about_one_decode_step():
    """While requests decode, the budget is what the latest decode step's seconds buy at the latest
    prefill's seconds per token (at least ``min_tokens``, at most the configured budget); with
    nothing decoding, or before anything was measured, it is the configured budget."""
    pace = PrefillPace(min_tokens=4)
    assert pace.budget(100) == 100  # nothing measured yet
    pace.decoding, pace.decode_seconds, pace.seconds_per_token = True, 0.02, 0.001
    assert pace.budget(100) == 20 and pace.budget(10) == 10 and pace.budget(None) == 20
    pace.seconds_per_token = 0.1
    assert pace.budget(100) == 4  # never below min_tokens: every forward makes progress
    pace.decoding = False
    assert pace.budget(100) == 100


def test_a_paced_prefill_part_measures_its_forwards_and_the_decode_steps():
    """The prefill part plans with the pace's budget and tells it its seconds per token; the decode
    part tells it each step's device time and whether it has members."""
    core = Scheduler.build(max_prefill_tokens=64, num_steps=0, chunk_tokens=50, pace=True)
    pace = core.prefill.pace
    assert pace is core.decode.pace is not None
    long = request("long", prompt_len=60, max_new_tokens=5)
    long.apply(Admitted())
    core.prefill.accept([long])
    pace.decoding, pace.decode_seconds, pace.seconds_per_token = True, 0.01, 0.001  # 10 tokens
    seen = []

    def answer(command):
        seen.append([(c.start, c.end) for c in command.chunks])
        return PrefillResult({})

    Script(core.prefill.turn(), {Prefill: answer}).run()
    assert seen == [[(0, 16)]]  # 10 tokens' worth, raised to min_tokens (16)
    assert pace.seconds_per_token is not None
