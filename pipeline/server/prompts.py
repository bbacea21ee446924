"""Prompt text -> token ids for the server, without holding the event loop.

Two things keep a long prompt from holding every other request:

* **A length bound before tokenizing.** ``chars_per_token`` reads from the tokenizer the most
  characters one token can stand for; a text of ``n`` characters is then at least
  ``ceil(n / chars_per_token)`` tokens, and one that cannot fit the context is refused (400,
  ``code: "context_length_exceeded"``) before it is tokenized at all.
* **Long texts are tokenized in a worker thread** (over ``OFF_LOOP_CHARS`` characters; a chat
  template is rendered there too). An HF tokenizer's ``encode`` keeps the GIL for its whole run, so
  there it goes through ``encode_batch``, which lets go of it while it works.

The bound is sound only where every character of the text ends up in some token: the byte-level
tokenizer (a token is one byte: at least one token per character), and an HF tokenizer whose
normalizer and pre-tokenizer never drop or merge characters, with a BPE model that has a token for
whatever it meets: every byte (a byte-level BPE with its whole alphabet, or byte fallback with all
256 byte pieces), or an unknown token standing for one character (not ``fuse_unk``). A BPE with
none of these silently drops the characters it has no token for. A token then covers at most as
many characters as its own string has (a byte-level BPE's token string has one character per byte).
Other tokenizers get no bound (None): their prompts are tokenized in full, off the loop when long;
the request body limit bounds that work.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.to_thread

from pipeline.errors import RequestError
from pipeline.model.tokenizer import ByteTokenizer, HFTokenizer
from pipeline.server.chat import plain_template
from pipeline.server.generation import ApiError
from pipeline.server.protocol import ChatMessage
from pipeline.validation import encode_prompt

OFF_LOOP_CHARS = 64 * 1024  # texts longer than this are tokenized in a worker thread
OFF_LOOP_TOKENS = 64 * 1024  # token lists longer than this are decoded in a worker thread

# HF normalizers and pre-tokenizers that keep every character (or add some); Replace and Split are
# checked further (``_keeps_characters``)
_NORMALIZERS = {"Sequence", "NFD", "NFKD", "Lowercase", "Prepend", "Replace", "ByteLevel"}
_PRE_TOKENIZERS = {"Sequence", "ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}

_per_token: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of a text one token can stand for; None when no sound bound is known."""
    if isinstance(tokenizer, ByteTokenizer):
        return 1
    if not isinstance(tokenizer, HFTokenizer):
        return None
    if tokenizer not in _per_token:
        _per_token[tokenizer] = _hf_chars_per_token(tokenizer.backend)
    return _per_token[tokenizer]


def _hf_chars_per_token(backend: Any) -> int | None:
    if backend.truncation is not None:  # it cuts long texts itself
        return None
    kinds: set[str] = set()
    for part, known in ((backend.normalizer, _NORMALIZERS), (backend.pre_tokenizer, _PRE_TOKENIZERS)):
        if part is not None and not _keeps_characters(json.loads(part.__getstate__()), known, kinds):
            return None
    model = backend.model
    if type(model).__name__ != "BPE":
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    every_byte = ("ByteLevel" in kinds and all(ch in vocab for ch in _byte_level_alphabet())) or (
        model.byte_fallback and all(f"<0x{b:02X}>" in vocab for b in range(256))
    )
    if not (every_byte or (model.unk_token is not None and not model.fuse_unk)):
        return None
    return max((len(token) for token in vocab), default=None)


def _byte_level_alphabet() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return ByteLevel.alphabet()


def _keeps_characters(config: dict[str, Any], known: set[str], kinds: set[str]) -> bool:
    kind = config.get("type")
    if kind not in known:
        return False
    kinds.add(kind)
    if kind == "Sequence":
        parts = config.get("normalizers", config.get("pretokenizers", []))
        return all(_keeps_characters(part, known, kinds) for part in parts)
    if kind == "Replace":
        pattern = config.get("pattern", {})
        return "String" in pattern and len(config.get("content", "")) >= len(pattern["String"])
    if kind in ("Split", "Punctuation"):
        return config.get("behavior") != "Removed"
    return True


def check_fits(tokenizer: Any, num_chars: int, context: int, field: str, *, room: int) -> None:
    """``ApiError`` if a text of ``num_chars`` characters is certainly more than ``context - room``
    tokens (``room``: the output tokens it must leave)."""
    per_token = chars_per_token(tokenizer)
    if per_token is None:
        return
    least = -(-num_chars // per_token)
    if least + room > context:
        leaves = ", which leaves no room for output" if room else ""
        raise ApiError(
            f"{field}: the prompt is {num_chars} characters, so at least {least} tokens (a token is at "
            f"most {per_token} characters); the context is {context} tokens{leaves}",
            param=field,
            code="context_length_exceeded",
        )


class _Encoder:
    """``tokenizer.encode``; an HF tokenizer's through ``encode_batch``, which lets go of the GIL."""

    def __init__(self, tokenizer: Any, *, special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = special_tokens

    def encode(self, text: str) -> list[int]:
        if isinstance(self.tokenizer, HFTokenizer):
            encoded = self.tokenizer.backend.encode_batch([text], add_special_tokens=self.special_tokens)
            return list(encoded[0].ids)
        return list(self.tokenizer.encode(text))


async def _maybe_off_loop(long: bool, work: Callable[[], Any]) -> Any:
    return await anyio.to_thread.run_sync(work) if long else work()


async def encode_text(tokenizer: Any, prompt: str | list[int], context: int, *, room: int) -> list[int]:
    """A completion's (or ``/tokenize``'s) ``prompt`` as token ids: ``ApiError`` naming ``prompt`` if
    it certainly cannot fit, or cannot be encoded."""
    if isinstance(prompt, str):
        check_fits(tokenizer, len(prompt), context, "prompt", room=room)

    def work() -> list[int]:
        try:
            return encode_prompt(prompt, _Encoder(tokenizer))
        except RequestError as exc:
            raise ApiError(f"prompt: {exc.rule}", param="prompt") from exc

    return await _maybe_off_loop(isinstance(prompt, str) and len(prompt) > OFF_LOOP_CHARS, work)


async def encode_chat(
    engine: Any,
    messages: Sequence[ChatMessage],
    context: int,
    *,
    room: int,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The prompt ids of a conversation (as ``pipeline.server.chat.render_chat`` renders them); the
    rendered text is measured (``check_fits``, naming ``messages``) before it is tokenized."""
    tokenizer = engine.tokenizer
    long = sum(len(m.text()) for m in messages) > OFF_LOOP_CHARS

    def work() -> list[int]:
        if getattr(tokenizer, "chat_template", None) is None:
            text = plain_template(messages, add_generation_prompt)
            check_fits(tokenizer, len(text), context, "messages", room=room)
            return _Encoder(tokenizer).encode(text)
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        if isinstance(tokenizer, HFTokenizer):
            # what apply_chat_template (and so Engine.chat_prompt) does, measured in between
            text = tokenizer.render_chat(conversation, add_generation_prompt)
            check_fits(tokenizer, len(text), context, "messages", room=room)
            return _Encoder(tokenizer, special_tokens=False).encode(text)
        return [int(t) for t in tokenizer.apply_chat_template(conversation, add_generation_prompt)]

    return await _maybe_off_loop(long, work)


async def decode_tokens(tokenizer: Any, ids: list[int]) -> str:
    """``tokenizer.decode(ids)``, in a worker thread for a long list (an HF tokenizer's through
    ``decode_batch``, which lets go of the GIL)."""

    def work() -> str:
        if isinstance(tokenizer, HFTokenizer):
            return tokenizer.backend.decode_batch([ids], skip_special_tokens=True)[0]
        return tokenizer.decode(ids)

    long = len(ids) > OFF_LOOP_TOKENS
    return await _maybe_off_loop(long, work) if long else tokenizer.decode(ids)
