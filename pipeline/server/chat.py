"""A conversation -> the prompt the model continues.

``render_chat`` uses the tokenizer's chat template when it has one (an HF tokenizer's
``apply_chat_template``, with the generation prompt appended). The bundled byte-level tokenizer has
none: the conversation is then written as one ``role: content`` line per message, followed by
``assistant: `` for the model to continue::

    system: You are terse.
    user: Name a sorting algorithm.
    assistant:
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.server.protocol import ChatMessage

ASSISTANT_CUE = "assistant: "


def plain_template(messages: Sequence[ChatMessage]) -> str:
    """The fallback template: ``role: content`` lines, then the assistant's cue (no trailing newline)."""
    lines = [f"{m.role}: {m.text()}\n" for m in messages]
    return "".join(lines) + ASSISTANT_CUE


def render_chat(engine: Any, messages: Sequence[ChatMessage]) -> list[int]:
    """The prompt token ids for ``messages``, through the checkpoint's chat template if it has one."""
    tokenizer = engine.tokenizer
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is None:
        return list(tokenizer.encode(plain_template(messages)))
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    rendered = apply(conversation, add_generation_prompt=True, tokenize=True)
    if isinstance(rendered, Mapping):  # tokenizers that return an encoding (input_ids, attention_mask)
        rendered = rendered["input_ids"]
    return [int(t) for t in rendered]
