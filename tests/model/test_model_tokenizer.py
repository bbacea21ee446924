"""The byte-level tokenizer: round trips, <eos>, invalid UTF-8, streamed multi-byte characters."""

from __future__ import annotations

from pipeline.model.tokenizer import ByteTokenizer


def test_round_trip_and_eos():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo 😀'\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode())
    assert tok.decode([*ids, tok.eos_token_id]) == text
    assert tok.vocab_size == 257


def test_invalid_utf8_does_not_raise():
    tok = ByteTokenizer()
    assert tok.decode([0xFF, ord("a"), 0xC3]) == "\ufffda\ufffd"


def test_stream_holds_back_a_partial_character():
    tok = ByteTokenizer()
    stream = tok.stream()
    pieces = [stream.push([b]) for b in "a😀é".encode()]
    assert pieces == ["a", "", "", "", "😀", "", "é"]
    assert stream.finish() == ""


def test_stream_cut_inside_a_character_ends_with_a_replacement():
    stream = ByteTokenizer().stream()
    assert stream.push(list("é".encode())[:1]) == ""
    assert stream.push([256]) == ""  # <eos> carries no bytes
    assert stream.finish() == "\ufffd"
