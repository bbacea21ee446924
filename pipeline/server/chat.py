"""A conversation -> the prompt the model continues.

``render_chat`` uses the checkpoint's chat template when it has one (``Engine.chat_prompt``, with the
generation prompt appended, exactly what ``Engine.chat`` sends). The bundled byte-level tokenizer has
none: the conversation is then written as one ``role: content`` line per message, followed by
``assistant: `` for the model to continue::

    system: You are terse.
    user: Name a sorting algorithm.
    assistant:
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.server.protocol import ChatMessage

ASSISTANT_CUE = "assistant: "


def plain_template(messages: Sequence[ChatMessage]) -> str:
    """The fallback template: ``role: content`` lines, then the assistant's cue (no trailing newline)."""
    lines = [f"{m.role}: {m.text()}\n" for m in messages]
    return "".join(lines) + ASSISTANT_CUE


def render_chat(engine: Any, messages: Sequence[ChatMessage]) -> list[int]:
    """The prompt token ids for ``messages``: ``engine.chat_prompt`` (the checkpoint's chat template,
    generation prompt added) when the checkpoint has a template, else the plain fallback."""
    if getattr(engine.tokenizer, "chat_template", None) is None:
        return list(engine.tokenizer.encode(plain_template(messages)))
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    return [int(t) for t in engine.chat_prompt(conversation)]
