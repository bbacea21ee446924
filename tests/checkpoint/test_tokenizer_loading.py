"""Which tokenizer a model directory gets, its end ids, and agreement with HF's tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest

from pipeline.errors import ConfigError, RequestError
from pipeline.model.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    end_token_ids,
    load_tokenizer,
    tokenizer_for_model,
)

TEXTS = [
    "the quick brown fox",
    "The Quick Brown Fox, café naïve façade 🙂🚀 日本語",
    "def fibonacci(n):\n    return n",
    "  leading spaces and trailing  ",
    "<|user|>special tokens in text<|end|>",
    "",
]


def test_the_bundled_model_keeps_the_byte_tokenizer_by_its_marker():
    tokenizer = load_tokenizer("tiny")
    assert tokenizer == ByteTokenizer(eos_token_id=256)
    assert tokenizer.eos_token_ids == {256}


def test_a_directory_without_tokenizer_files_gets_the_byte_tokenizer(checkpoint, tmp_path):
    shutil.copy(checkpoint.path / "config.json", tmp_path / "config.json")
    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer, ByteTokenizer) and tokenizer.eos_token_ids == {checkpoint.eos_id}


def test_a_checkpoint_tokenizer_encodes_and_decodes_as_hf(tokenizer, hf_tokenizer, checkpoint):
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.vocab_size == len(hf_tokenizer) == checkpoint.vocab_size
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer(text).input_ids, text
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text
    assert len(tokenizer.byte_piece_ids) == 256  # <0x00>..<0xFF>


def test_every_end_id_of_config_and_generation_config(checkpoint, tokenizer):
    assert end_token_ids(checkpoint.path) == (checkpoint.eos_id, checkpoint.end_id)
    assert tokenizer.eos_token_ids == {checkpoint.eos_id, checkpoint.end_id}


def test_end_ids_as_lists_ints_or_absent(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 3]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert end_token_ids(tmp_path) == (7, 3)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
    assert end_token_ids(tmp_path) == (7, 3, 9)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    (tmp_path / "generation_config.json").unlink()
    assert end_token_ids(tmp_path) == ()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ConfigError) as info:
        end_token_ids(tmp_path)
    assert info.value.field == "model" and "eos_token_id" in info.value.rule


def test_without_end_ids_in_the_model_files_the_tokenizers_eos_ends(checkpoint, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint.path / name, tmp_path / name)
    assert load_tokenizer(tmp_path).eos_token_ids == {checkpoint.eos_id}  # eos_token "</s>"


def test_chat_template_from_tokenizer_config_or_its_own_file(checkpoint, tokenizer, hf_tokenizer, tmp_path):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, café?"},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "🙂"},
    ]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert tokenizer.apply_chat_template(messages) == expected
    no_prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=False)["input_ids"]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == no_prompt
    # transformers 5 writes the template to chat_template.jinja: read from there too
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(checkpoint.path / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "chat_template.jinja").write_text(config.pop("chat_template"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(tmp_path).apply_chat_template(messages) == expected


def test_no_chat_template_or_bad_messages_is_a_request_error(checkpoint, tokenizer, tmp_path):
    with pytest.raises(RequestError) as info:
        tokenizer.apply_chat_template("hello")
    assert info.value.field == "messages"
    with pytest.raises(RequestError) as info:
        tokenizer.apply_chat_template([{"content": "no role"}])
    assert info.value.field == "messages"
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(checkpoint.path / name, tmp_path / name)
    with pytest.raises(RequestError) as info:
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
    assert info.value.field == "messages" and "no chat template" in info.value.rule
    with pytest.raises(RequestError) as info:
        ByteTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    assert info.value.field == "messages"


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(checkpoint):
    with pytest.raises(ConfigError) as info:
        tokenizer_for_model(checkpoint.path, vocab_size=checkpoint.vocab_size - 1, eos_token_id=None)
    assert info.value.field == "model" and "vocab_size" in info.value.rule
    assert isinstance(tokenizer_for_model(None, vocab_size=300, eos_token_id=None), ByteTokenizer)


def test_without_tokenizer_json_the_other_files_load_through_transformers(tmp_path):
    """A GPT-2-style directory (vocab.json + merges.txt): AutoTokenizer builds it, offline."""
    from _checkpoint import TEXT
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 4, trainer)
    tok.model.save(str(tmp_path))
    special = "<|endoftext|>"
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "eos_token": special,
        "bos_token": special,
        "unk_token": special,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(tmp_path)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.eos_token_ids == {0}
    for text in TEXTS:
        assert tokenizer.encode(text) == reference(text).input_ids
        assert tokenizer.decode(tokenizer.encode(text)) == text
