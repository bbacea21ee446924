"""``render_chat``: the checkpoint's chat template (through ``Engine.chat_prompt``) when it has one, else
the plain fallback."""

from __future__ import annotations

from types import SimpleNamespace

from pipeline.model.tokenizer import ByteTokenizer
from pipeline.server.chat import render_chat
from pipeline.server.protocol import ChatMessage

MESSAGES = [
    ChatMessage(role="system", content="Be brief."),
    ChatMessage(role="user", content=[{"type": "text", "text": "Sort "}, {"type": "text", "text": "this."}]),
]


def test_plain_template_without_a_chat_template():
    ids = render_chat(SimpleNamespace(tokenizer=ByteTokenizer()), MESSAGES)
    assert bytes(ids).decode() == "system: Be brief.\nuser: Sort this.\nassistant: "


def test_a_checkpoint_template_goes_through_engine_chat_prompt():
    """With a template, the server sends exactly what ``Engine.chat`` would: ``engine.chat_prompt`` of
    the conversation as role/content mappings (its ids equal ``apply_chat_template(...,
    add_generation_prompt=True)``, checked in tests/checkpoint)."""
    seen = []

    def chat_prompt(conversation):
        seen.append(conversation)
        return [7, 8, 9]

    engine = SimpleNamespace(
        tokenizer=SimpleNamespace(chat_template="{{ messages }}"), chat_prompt=chat_prompt
    )
    assert render_chat(engine, MESSAGES) == [7, 8, 9]
    assert seen == [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort this."}]]
