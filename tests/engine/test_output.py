"""The caller's side of a request (output buffers) and the stage waker, with hand-built requests."""

from __future__ import annotations

import anyio
import pytest

from pipeline.errors import RequestFailed
from pipeline.messages import Wake
from pipeline.model.tokenizer import ByteTokenizer
from pipeline.request import Request
from pipeline.sampling import SamplingParams
from pipeline.stages.context import StageWaker
from pipeline.stages.output import OutputBuffer
from statemachines.request import (
    Admitted,
    Crashed,
    DraftDone,
    DraftStarted,
    Finished,
    JoinedBatch,
    PrefillDone,
    StagingDone,
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
        req.apply(DraftDone(num_steps=2))
    return req


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
        req.apply(Crashed("device fell over"))
        buffer.notify()
    assert got[0].token_ids == (65,)


@pytest.mark.asyncio
async def test_waker_keeps_one_wake_outstanding_and_never_blocks():
    send, receive = anyio.create_memory_object_stream(1)
    waker = StageWaker({"decode": send})
    waker.wake("decode", reason="memory")
    waker.wake("decode", reason="memory")  # one outstanding already: not sent again
    assert receive.statistics().current_buffer_used == 1
    assert isinstance(receive.receive_nowait(), Wake)
    waker.heard("decode")
    send.send_nowait("other message")  # a full inbox: the Wake is dropped, nothing blocks
    waker.wake("decode", reason="abort")
    assert receive.receive_nowait() == "other message"
    waker.close()
    waker.wake("decode", reason="late")  # closed: ignored
    receive.close()


def test_deltas_carry_the_logprobs_of_their_tokens_and_a_stop_drops_the_rest():
    from pipeline.messages import TokenLogprob

    req = decoding("r", max_new_tokens=20, logprobs=1, stop_token_ids=(33,))
    buffer = OutputBuffer(req)
    entries = [TokenLogprob(t, -0.5 * i, ((t, -0.5 * i),)) for i, t in enumerate((65, 66, 33, 67))]
    assert req.append((65, 66), logprobs=tuple(entries[:2])) is None
    first = buffer.take()
    assert first.token_ids == (65, 66) and first.logprobs == tuple(entries[:2])
    assert req.append((33, 67), logprobs=tuple(entries[2:])) == "stop"  # 67 comes after the stop id
    assert buffer.take().logprobs == (entries[2],)
    with pytest.raises(ValueError):
        req.append((68,))  # a request that asks for them gets them with every token
    plain = decoding("p", max_new_tokens=4)
    plain.append((65,))
    assert OutputBuffer(plain).take().logprobs is None
