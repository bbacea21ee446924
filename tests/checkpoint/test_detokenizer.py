"""Incremental detokenization: for any token stream, cut into pushes of any size, the deltas add up to
the full decode, and the text emitted so far is always a prefix of the decode of the ids so far (so
nothing is ever taken back and no delta ends inside a character)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from pipeline.detokenizer import IncrementalDetokenizer
from pipeline.model.tokenizer import ByteTokenizer, HFTokenizer

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def byte_level_bpe():
    """A GPT-2-style byte-level BPE (characters split across tokens at the byte level)."""
    from _checkpoint import TEXT
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        [TEXT] * 4,
        trainers.BpeTrainer(
            vocab_size=500, initial_alphabet=alphabet, special_tokens=["<eos>"], show_progress=False
        ),
    )
    return HFTokenizer(tok, eos_token_ids=[0])


def stream(tokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    """Push ``ids`` in pieces of the sizes in ``cuts`` (cycled); check the prefix rule at every push."""
    detok = IncrementalDetokenizer(tokenizer)
    deltas, i, k = [], 0, 0
    while i < len(ids):
        n = cuts[k % len(cuts)]
        deltas.append(detok.push(ids[i : i + n]))
        i, k = i + n, k + 1
        so_far = tokenizer.decode(ids[:i])
        assert so_far.startswith("".join(deltas)), (ids[:i], deltas, so_far)
    deltas.append(detok.finish())
    assert detok.text == "".join(deltas)
    return deltas


def token_streams(tokenizer: HFTokenizer):
    """Ids from the whole vocabulary, with the byte pieces of whole or cut characters mixed in."""
    vocab = tokenizer.vocab_size
    pieces = {
        int(t[3:5], 16): i for t, i in tokenizer.backend.get_vocab().items() if i in tokenizer.byte_piece_ids
    }

    def spelt(char: str, cut: int) -> list[int]:
        data = char.encode()
        return [pieces[b] for b in data[: len(data) - cut]]

    any_id = st.integers(0, vocab - 1).map(lambda i: [i])
    char = st.characters(codec="utf-8", exclude_categories=["Cs"])
    bytes_of = st.tuples(char, st.sampled_from([0, 0, 0, 1, 2])).map(lambda c: spelt(*c))
    parts = st.lists(st.one_of(any_id, bytes_of) if pieces else any_id, max_size=24)
    return parts.map(lambda groups: [i for g in groups for i in g])


cuts = st.lists(st.integers(1, 4), min_size=1, max_size=5)


@SETTINGS
@given(data=st.data(), cut=cuts)
def test_checkpoint_tokenizer_random_streams(tokenizer, data, cut):
    ids = data.draw(token_streams(tokenizer))
    assert "".join(stream(tokenizer, ids, cut)) == tokenizer.decode(ids)


@SETTINGS
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40), cut=cuts)
def test_checkpoint_tokenizer_encoded_text_streams_back(tokenizer, text, cut):
    ids = tokenizer.encode(text)
    assert "".join(stream(tokenizer, ids, cut)) == tokenizer.decode(ids)


@SETTINGS
@given(data=st.data(), cut=cuts)
def test_byte_level_bpe_random_streams(byte_level_bpe, data, cut):
    ids = data.draw(st.lists(st.integers(0, byte_level_bpe.vocab_size - 1), max_size=30))
    assert "".join(stream(byte_level_bpe, ids, cut)) == byte_level_bpe.decode(ids)


@SETTINGS
@given(ids=st.lists(st.integers(0, 256), max_size=40), cut=cuts)
def test_byte_tokenizer_random_streams(ids, cut):
    tokenizer = ByteTokenizer()
    assert "".join(stream(tokenizer, ids, cut)) == tokenizer.decode(ids)


def test_a_character_spelt_in_byte_pieces_comes_out_whole(tokenizer):
    euro = [tokenizer.backend.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    word = tokenizer.encode("fox")[1:]  # without <s>
    assert stream(tokenizer, [*word, *euro, *word], [1]) == ["fox", "", "", "", "€ fox", ""]


def test_a_run_of_byte_pieces_cut_short_is_never_shown_before_it_ends(tokenizer):
    """A run that stops mid-character decodes as one U+FFFD per piece, even its valid first byte:
    so no piece of a run is emitted before the run ends."""
    a, e2 = (tokenizer.backend.token_to_id(t) for t in ("<0x41>", "<0xE2>"))
    fox = tokenizer.encode("fox")[1:]
    assert tokenizer.decode([a]) == "A" and tokenizer.decode([a, e2, *fox]) == "\ufffd\ufffd fox"
    assert stream(tokenizer, [a, e2, *fox], [1]) == ["", "", "\ufffd\ufffd fox", ""]


def test_a_cut_character_at_the_end_is_flushed_as_replacement(byte_level_bpe):
    ids = byte_level_bpe.encode("é")
    tokenizer = ByteTokenizer()
    assert stream(tokenizer, list("é".encode())[:1], [1]) == ["", "\ufffd"]
    assert "".join(stream(byte_level_bpe, ids, [1])) == "é"


def test_a_special_token_does_not_end_a_run_of_byte_pieces(tokenizer):
    """Decoding leaves special tokens out, so the pieces on both sides of one form a single run."""
    nul, unk, cont = (tokenizer.backend.token_to_id(t) for t in ("<0x00>", "<unk>", "<0x80>"))
    assert tokenizer.decode([nul, unk]) == "\x00" and tokenizer.decode([nul, unk, cont]) == "\ufffd\ufffd"
    assert "".join(stream(tokenizer, [nul, unk, cont], [1])) == "\ufffd\ufffd"
