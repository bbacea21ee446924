"""The engine's per-token log-probabilities in OpenAI's two response shapes.

A token's text is the tokenizer's decoding of that id alone (so a piece of a multi-byte character
reads as U+FFFD, and a special token the decoding leaves out as ``""``); its ``bytes`` are that
text's UTF-8 bytes. A log-probability the engine gives as ``-inf`` (a token the request's
distribution cannot draw: cut by top-k or top-p, or masked) is written as ``-9999.0``, as vLLM
writes it, since JSON has no infinity.

* completions (``logprobs: k``): ``{tokens, token_logprobs, top_logprobs, text_offset}``, one entry
  per output token; ``top_logprobs[i]`` maps the k most likely tokens' texts, and the chosen token's
  (so up to k + 1 entries, as OpenAI's), to their logprobs. ``text_offset[i]``: where token i's
  text starts in the choice's text (the token texts laid end to end, after the echoed prompt);
* chat (``logprobs: true``, ``top_logprobs: k``): ``content[i] = {token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}, ...]}`` with the k most likely, most likely first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pipeline.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

if TYPE_CHECKING:
    from pipeline.messages import TokenLogprob

FLOOR = -9999.0  # what -inf (and a NaN) is written as


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


class TokenTexts:
    """Each token id's text (the tokenizer's ``decode([id])``), decoded once."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode([token_id])
        return text


def completion_logprobs(
    entries: Sequence[TokenLogprob], texts: TokenTexts, offset: int = 0
) -> tuple[CompletionLogprobs, int]:
    """The completions shape for ``entries`` whose first token's text starts at ``offset``; also the
    offset after the last one (where the next chunk's tokens start)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for entry in entries:
        text = texts(entry.token_id)
        tokens.append(text)
        token_logprobs.append(finite(entry.logprob))
        top: dict[str, float] = {}
        for token_id, logprob in (*entry.top, (entry.token_id, entry.logprob)):
            top.setdefault(texts(token_id), finite(logprob))  # two ids of one text: the likelier
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    body = CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=text_offset
    )
    return body, offset


def _top(token_id: int, logprob: float, texts: TokenTexts) -> TopLogprob:
    text = texts(token_id)
    return TopLogprob(token=text, logprob=finite(logprob), bytes=list(text.encode("utf-8")))


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> ChatLogprobs:
    """The chat shape for ``entries``."""
    content = []
    for entry in entries:
        chosen = _top(entry.token_id, entry.logprob, texts)
        content.append(
            ChatTokenLogprob(**chosen.model_dump(), top_logprobs=[_top(t, lp, texts) for t, lp in entry.top])
        )
    return ChatLogprobs(content=content)
