"""The stages' synchronous cores with hand-built results: no model, no event loop for the policy."""

from __future__ import annotations

import anyio
import pytest

from pipeline.errors import RequestFailed
from pipeline.executor import PrefillResult, StepResult
from pipeline.messages import AdmitAnswer, Wake
from pipeline.model.tokenizer import ByteTokenizer
from pipeline.request import Request
from pipeline.sampling import SamplingParams
from pipeline.stages.admission import AdmissionQueue
from pipeline.stages.context import Bells
from pipeline.stages.decode import DecodeBatch, settle
from pipeline.stages.output import OutputBuffer
from pipeline.stages.prefill import sort_prefilled
from statemachines.request import (
    AbortRequested,
    Admitted,
    Crashed,
    DraftDone,
    DraftStarted,
    Finished,
    FinishedAtPrefill,
    JoinedBatch,
    PrefillDone,
    StagingDone,
    State,
)

TOKENIZER = ByteTokenizer()


def request(rid: str, prompt_len: int = 4, **params) -> Request:
    return Request(rid, tuple(range(65, 65 + prompt_len)), SamplingParams(**params), TOKENIZER, 256)


def decoding(rid: str, *, verifying: bool = False, **params) -> Request:
    req = request(rid, **params)
    for event in (Admitted(), PrefillDone(), StagingDone(), JoinedBatch()):
        req.apply(event)
    if verifying:
        req.apply(DraftStarted())
        req.apply(DraftDone(num_drafts=2))
    return req


def test_admission_takes_the_longest_fitting_prefix_in_order():
    queue = AdmissionQueue(max_prefill_tokens=10)
    reqs = [request(f"r{i}", n) for i, n in enumerate([4, 5, 3, 2])]
    for r in reqs:
        queue.push(r)
    candidates = queue.candidates()
    assert [r.request_id for r in candidates] == ["r0", "r1"]  # budget 10: 4 + 5, then 3 is over
    batch = queue.take(candidates, AdmitAnswer(fits=(True, False), free_rows=8))
    assert [r.request_id for r in batch] == ["r0"] and [r.request_id for r in queue] == ["r1", "r2", "r3"]
    # nobody overtakes a head that does not fit
    assert queue.take(queue.candidates(), AdmitAnswer(fits=(False, True), free_rows=8)) == []
    # free rows cap the batch
    batch = queue.take(queue.candidates(), AdmitAnswer(fits=(True, True, True), free_rows=1))
    assert [r.request_id for r in batch] == ["r1"]


def test_admission_head_longer_than_the_budget_goes_alone_and_retracted_go_first():
    queue = AdmissionQueue(max_prefill_tokens=3)
    long, short = request("long", 9), request("short", 1)
    queue.push(long)
    queue.push(short)
    assert [r.request_id for r in queue.candidates()] == ["long"]
    back = [request("a"), request("b")]
    queue.requeue(back)
    assert [r.request_id for r in queue] == ["a", "b", "long", "short"]
    queue.remove({"b", "short"})
    assert [r.request_id for r in queue] == ["a", "long"]


def test_prefill_results_are_sorted_like_the_driver():
    reqs = [request(rid, max_new_tokens=n) for rid, n in [("ok", 5), ("one", 1), ("gone", 5), ("full", 5)]]
    for r in reqs:
        r.apply(Admitted())
    result = PrefillResult(first_tokens={"ok": 70, "one": 71, "gone": 72}, refused=("full",))
    refused, ending, staged = sort_prefilled(reqs, result, lambda rid: rid == "gone")
    assert [r.request_id for r in refused] == ["full"]
    assert [(r.request_id, type(e)) for r, e in ending] == [("one", FinishedAtPrefill), ("gone", AbortRequested)]
    assert [r.request_id for r in staged] == ["ok"] and staged[0].output_ids == [70]
    assert ending[0][1].reason == "length"


def test_settle_applies_step_events_and_returns_the_ends():
    batch = DecodeBatch()
    for rid, n in [("a", 10), ("b", 2), ("c", 10), ("d", 10)]:
        batch.join(decoding(rid, verifying=True, max_new_tokens=n))
    batch.members["d"].output_ids.append(1)
    result = StepResult(
        tokens={"a": (66, 67), "b": (68, 69, 70), "d": (256,)},  # b hits its length, d emits EOS
        accepted={"a": 1, "b": 2, "d": 0},
        failed={"c": "boom"},
    )
    ending = settle(batch, result, num_draft_steps=2, figures={"batch_size": 4})
    ends = {r.request_id: e for r, e in ending}
    assert isinstance(ends["b"], Finished) and ends["b"].reason == "length"
    assert batch.members["b"].output_ids == [68, 69]  # the token after the end is dropped
    assert isinstance(ends["d"], Finished) and ends["d"].reason == "stop"
    assert isinstance(ends["c"], Crashed) and ends["c"].reason == "boom"
    assert batch.members["a"].state is State.DECODE and batch.members["a"].output_ids == [66, 67]
    assert batch.members["a"].metrics.spec.accepted_drafts == 1


@pytest.mark.asyncio
async def test_output_buffer_coalesces_and_holds_back_partial_text():
    req = decoding("r", max_new_tokens=20, stop=("END",))
    buffer = OutputBuffer(req)
    assert not buffer.has_news()
    req.append(tuple("héllo E".encode()[:2]))  # "h" and the first byte of "é"
    delta = buffer.take()
    assert delta.token_ids == (104, 195) and delta.text == ""  # half a character, and "h" is too close
    req.append(tuple("héllo E".encode()[2:]))
    req.append(tuple(b"N"))
    delta = buffer.take()  # one delta for two appends
    assert delta.text == "héllo " and not delta.finished  # "EN" may still become the stop string
    req.append(tuple(b"D!"))
    req.finish_reason = "stop"
    req.apply(Finished("stop"))
    delta = buffer.take()
    assert delta.finished and delta.finish_reason == "stop" and delta.metrics is req.metrics
    assert delta.text == "" and req.text == "héllo "


@pytest.mark.asyncio
async def test_output_buffer_wakes_its_reader_and_raises_on_failure():
    req = decoding("r")
    buffer = OutputBuffer(req)
    got = []

    async def reader():
        got.append(await buffer.next())
        with pytest.raises(RequestFailed, match="device fell over"):
            await buffer.next()

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.sleep(0)
        req.append((65,))
        buffer.notify()
        await anyio.sleep(0.01)
        req.error = "device fell over"
        req.apply(Crashed("device fell over"))
        buffer.notify()
    assert got[0].token_ids == (65,)


@pytest.mark.asyncio
async def test_bells_keep_one_wake_outstanding_and_never_block():
    send, receive = anyio.create_memory_object_stream(1)
    bells = Bells({"decode": send})
    bells.ring("decode", reason="memory")
    bells.ring("decode", reason="memory")  # one outstanding already: not sent again
    assert receive.statistics().current_buffer_used == 1
    assert isinstance(receive.receive_nowait(), Wake)
    bells.heard("decode")
    send.send_nowait("other message")  # a full inbox: the Wake is dropped, nothing blocks
    bells.ring("decode", reason="abort")
    assert receive.receive_nowait() == "other message"
    bells.close()
    bells.ring("decode", reason="late")  # closed: ignored
    receive.close()
