"""``render_chat``: the tokenizer's chat template when it has one, else the plain fallback."""

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


def test_the_tokenizers_chat_template_with_the_generation_prompt(tmp_path):
    from transformers import PreTrainedTokenizerFast

    ByteTokenizer().write_hf_files(tmp_path)  # an HF tokenizer whose ids are the bytes
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    ids = render_chat(SimpleNamespace(tokenizer=tokenizer), MESSAGES)
    assert bytes(ids).decode() == "[system]Be brief.[user]Sort this.[assistant]"
