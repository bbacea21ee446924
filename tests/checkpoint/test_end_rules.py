"""Where a request ends, token by token, with the checkpoint's tokenizer: every end id,
``stop_token_ids``, ``ignore_eos`` (as vLLM), and stop strings across token boundaries."""

from __future__ import annotations

import pytest

from pipeline.request import Request
from pipeline.sampling import SamplingParams
from statemachines.request import Admitted, Finished, JoinedBatch, PrefillDone, StagingDone


def run(tokenizer, tokens, **params) -> Request:
    """Commit ``tokens`` one per step, as plain decoding does, until one ends the request; it then
    ends with the terminal event carrying the reason (which sets ``finish_reason``)."""
    req = Request("r", (1,), SamplingParams(**{"max_new_tokens": 64, **params}), tokenizer, 1024)
    for event in (Admitted(), PrefillDone(), StagingDone(), JoinedBatch()):
        req.apply(event)
    for token in tokens:
        reason = req.append([token])
        if reason is not None:
            req.apply(Finished(reason))
            break
    return req


def words(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)[1:]  # without <s>


@pytest.mark.parametrize("which", ["eos_id", "end_id"])
def test_every_end_id_stops_and_stays_out_of_the_text(tokenizer, checkpoint, which):
    end = getattr(checkpoint, which)
    fox = words(tokenizer, "the fox")
    req = run(tokenizer, [*fox, end, *fox])
    assert req.finish_reason == "stop" and req.output_ids == [*fox, end]
    assert req.text == "the fox"


def test_ignore_eos_keeps_going_and_stop_token_ids_still_stop(tokenizer, checkpoint):
    fox, dog = words(tokenizer, "the fox"), words(tokenizer, "lazy dog")
    ids = [*fox, checkpoint.eos_id, checkpoint.end_id, *dog]
    req = run(tokenizer, ids, ignore_eos=True, max_new_tokens=len(ids))
    assert req.finish_reason == "length" and req.output_ids == ids
    assert req.text == "the fox lazy dog"  # special end tokens are not text
    req = run(tokenizer, ids, ignore_eos=True, stop_token_ids=(dog[0],))
    assert req.finish_reason == "stop" and req.output_ids == ids[: len(fox) + 3]
    req = run(tokenizer, [*fox, *dog], stop_token_ids=(fox[-1],))  # an ordinary token as a stop id
    assert req.finish_reason == "stop" and req.output_ids == fox and req.text == tokenizer.decode(fox[:-1])


def test_a_stop_string_across_two_tokens(tokenizer):
    ids = words(tokenizer, "the quick brown fox")
    texts = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    # every pair of neighbouring tokens that both add text: the last character of the first and the
    # first character of the second, as a stop string (where it is new)
    pairs = [
        k for k in range(1, len(ids))
        if len(texts[k + 1]) > len(texts[k]) > len(texts[k - 1]) and texts[k + 1].startswith(texts[k])
        and texts[k][-1] + texts[k + 1][len(texts[k])] not in texts[k]
    ]
    assert len(pairs) >= 3
    for k in pairs:
        stop = texts[k][-1] + texts[k + 1][len(texts[k])]
        req = run(tokenizer, ids, stop=(stop,))
        assert req.finish_reason == "stop" and req.output_ids == ids[: k + 1], stop
        assert req.text == texts[k + 1][: texts[k + 1].index(stop)]


def test_a_stop_string_completed_by_byte_pieces_ends_at_the_last_piece(tokenizer):
    fox = words(tokenizer, "fox")
    euro = [tokenizer.backend.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    req = run(tokenizer, [*fox, *euro, *fox], stop=("x€",))
    assert req.finish_reason == "stop" and req.output_ids == [*fox, *euro] and req.text == "fo"
    req = run(tokenizer, [*fox, *euro, *fox], max_new_tokens=len(fox) + 2)  # ends inside the character
    assert req.finish_reason == "length" and req.text == "fox\ufffd\ufffd"


def test_length_when_nothing_else_ends_it(tokenizer):
    ids = words(tokenizer, "the quick brown fox jumps")
    req = run(tokenizer, ids, max_new_tokens=3)
    assert (
        req.finish_reason == "length" and req.output_ids == ids[:3] and req.text == tokenizer.decode(ids[:3])
    )
