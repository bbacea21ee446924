"""The prompt length bound (``pipeline.server.prompts``) against real HF tokenizers.

* Where a bound is given, it holds: a text of ``n`` characters is never fewer than
  ``ceil(n / chars_per_token)`` tokens (texts with multi-byte characters, runs of spaces and digits,
  characters outside the vocabulary, the special tokens' own text).
* Tokenizers that can drop or merge characters (a whitespace splitter, NFKC, accents stripped,
  truncation, an unknown token for a whole run) get none.
* The server's own encoding (``encode_batch``, off the loop) gives exactly ``HFTokenizer.encode``'s
  ids, and a chat renders exactly as ``apply_chat_template`` does.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import anyio
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from pipeline.model.tokenizer import ByteTokenizer, HFTokenizer
from pipeline.server import prompts
from pipeline.server.generation import ApiError
from pipeline.server.protocol import ChatMessage

CORPUS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Größe, café, naïve — 東京 und 北京; emoji 🙂🙂 and    spaced     words 1234567890",
]
TEXTS = [
    *CORPUS,
    " " * 300,
    "=" * 500,
    "9" * 401,
    "🙂" * 50,
    "e\u0301" * 40,  # combining accents (NFC would merge them)
    "ﬁ" * 30 + "Ⅻ" * 10,  # compatibility characters (NFKC rewrites them)
    "<|user|>hello<|end|>",
    "\t\n\r  mixed \x00 control \x7f",
]
SPECIALS = ["<|user|>", "<|end|>"]


def byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=False), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def metaspace_bpe(*, byte_pieces: bool = True, unk: str | None = None) -> Tokenizer:
    """Spaces written as ``▁`` (Prepend and Replace), byte fallback for what the vocabulary lacks."""
    letters = sorted(set("".join(CORPUS[:2]).replace(" ", "▁")))
    pieces = [*SPECIALS, *(f"<0x{b:02X}>" for b in range(256) if byte_pieces), *letters, "▁t", "▁th", "▁the"]
    if unk is not None:
        pieces.append(unk)
    vocab = {piece: i for i, piece in enumerate(dict.fromkeys(pieces))}
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token=unk))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.add_special_tokens(SPECIALS)
    return tok


def metaspace_bpe_with_unk() -> Tokenizer:
    return metaspace_bpe(byte_pieces=False, unk="<unk>")


@pytest.mark.parametrize("build", [byte_level_bpe, metaspace_bpe, metaspace_bpe_with_unk])
def test_the_bound_holds_for_tokenizers_that_keep_every_character(build):
    tokenizer = HFTokenizer(build())
    per_token = prompts.chars_per_token(tokenizer)
    assert per_token is not None and per_token >= max(len(s) for s in SPECIALS)
    for text in TEXTS:
        count = len(tokenizer.encode(text))
        assert count >= math.ceil(len(text) / per_token), (text, count, per_token)


def test_the_byte_tokenizer_is_one_character_per_token_at_most():
    assert prompts.chars_per_token(ByteTokenizer()) == 1
    for text in TEXTS:
        assert len(ByteTokenizer().encode(text)) >= len(text)


def without_a_bound() -> list[Tokenizer]:
    whitespace = byte_level_bpe()
    whitespace.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # spaces are dropped
    nfkc = byte_level_bpe()
    nfkc.normalizer = normalizers.NFKC()  # may merge characters
    accents = byte_level_bpe()
    accents.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    truncated = byte_level_bpe()
    truncated.enable_truncation(64)
    regex_replace = byte_level_bpe()
    regex_replace.normalizer = normalizers.Replace(__import__("tokenizers").Regex(" +"), " ")
    fused = Tokenizer(models.BPE(vocab={"<unk>": 0, "a": 1}, merges=[], unk_token="<unk>", fuse_unk=True))
    wordpiece = Tokenizer(models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    dropping = metaspace_bpe(byte_pieces=False)  # no byte pieces, no unknown token: drops what it lacks
    assert len(dropping.encode("=" * 50).ids) < 50
    return [whitespace, nfkc, accents, truncated, regex_replace, fused, wordpiece, dropping]


@pytest.mark.parametrize(
    "backend",
    without_a_bound(),
    ids=[
        "whitespace-split", "nfkc", "strip-accents", "truncation", "regex-replace", "fused-unk", "wordpiece",
        "drops-unknown",
    ],
)
def test_tokenizers_that_may_drop_characters_get_no_bound(backend):
    assert prompts.chars_per_token(HFTokenizer(backend)) is None
    prompts.check_fits(HFTokenizer(backend), 10**9, 16, "prompt", room=1)  # no bound: nothing refused


def test_check_fits_refuses_only_what_cannot_fit():
    byte = ByteTokenizer()
    prompts.check_fits(byte, 15, 16, "prompt", room=1)  # 15 tokens at least: one left for output
    with pytest.raises(ApiError) as info:
        prompts.check_fits(byte, 16, 16, "prompt", room=1)
    assert info.value.param == "prompt" and info.value.code == "context_length_exceeded"
    prompts.check_fits(byte, 16, 16, "messages", room=0)  # /tokenize: it may fill the context
    with pytest.raises(ApiError):
        prompts.check_fits(byte, 17, 16, "messages", room=0)


TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize("build", [byte_level_bpe, metaspace_bpe])
def test_the_server_encodes_as_the_tokenizer_does(build):
    tokenizer = HFTokenizer(build(), chat_template=TEMPLATE)
    engine = SimpleNamespace(tokenizer=tokenizer)
    long = CORPUS[2] * (prompts.OFF_LOOP_CHARS // len(CORPUS[2]) + 1)  # tokenized off the loop

    async def check() -> None:
        for text in [*TEXTS, long]:
            ids = await prompts.encode_text(tokenizer, text, 10**9, room=1)
            assert ids == tokenizer.encode(text)
            assert await prompts.decode_tokens(tokenizer, ids * 40) == tokenizer.decode(ids * 40)
        messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content=long)]
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        for cue in (True, False):
            ids = await prompts.encode_chat(engine, messages, 10**9, room=1, add_generation_prompt=cue)
            assert ids == tokenizer.apply_chat_template(conversation, add_generation_prompt=cue)

    anyio.run(check)
