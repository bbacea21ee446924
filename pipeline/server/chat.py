"""A conversation -> the prompt the model continues.

``render_chat`` uses the checkpoint's chat template when it has one (``Engine.chat_prompt``, with the
generation prompt appended, exactly what ``Engine.chat`` sends). The bundled byte-level tokenizer has
none: the conversation is then written as one ``role: content`` line per message, followed by
``assistant: `` for the model to continue::

    system: You are terse.
    user: Name a sorting algorithm.
    assistant:

The endpoints render through ``pipeline.server.prompts.encode_chat``: the same ids, with the
rendered text measured against the context before it is tokenized, off the event loop when long.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.server.protocol import ChatMessage

ASSISTANT_CUE = "assistant: "


def plain_template(messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
    """The fallback template: ``role: content`` lines, then the assistant's cue (no trailing newline)."""
    lines = [f"{m.role}: {m.text()}\n" for m in messages]
    return "".join(lines) + (ASSISTANT_CUE if add_generation_prompt else "")


def render_chat(
    engine: Any, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True
) -> list[int]:
    """The prompt token ids for ``messages``: ``engine.chat_prompt`` (the checkpoint's chat template,
    generation prompt added) when the checkpoint has a template, else the plain fallback.
    ``add_generation_prompt=False`` (``/tokenize``): the conversation alone, without the assistant's cue."""
    tokenizer = engine.tokenizer
    if getattr(tokenizer, "chat_template", None) is None:
        return list(tokenizer.encode(plain_template(messages, add_generation_prompt)))
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    if not add_generation_prompt:
        return [int(t) for t in tokenizer.apply_chat_template(conversation, add_generation_prompt=False)]
    return [int(t) for t in engine.chat_prompt(conversation)]
