"""A user's checkpoint built offline: a random HF ``DeepseekV32ForCausalLM`` with a BPE tokenizer
trained here on a few KB of text (``build_checkpoint``), and the checkpoints users bring as
``save_pretrained`` writes them (``build_saved_checkpoint``, ``resave_without_mtp``).

The tokenizer is SentencePiece-style (spaces as ``▁``, pieces within words, a decoder that strips the text's
first space), with byte fallback (``<0x00>``..``<0xFF>``: characters outside its small alphabet, capitals and
most non-ASCII among them, are spelt as byte pieces), special tokens ``<s>`` (prepended to every text),
``</s>``, ``<|user|>``, ``<|assistant|>``, ``<|end|>``, and a chat template in ``tokenizer_config.json``.
``config.json`` ends generation with ``</s>``; ``generation_config.json`` adds ``<|end|>``. The model has no
MTP layer.

So that the end tokens show up early in greedy output, rows of the embedding and of the head are
swapped: two tokens that greedy decoding emits early after :data:`PROMPT` become ``<|end|>`` and
``</s>`` (a relabelling of the vocabulary: the rest of the sequence is unchanged).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import attrs
import torch

TEXT = """\
The quick brown fox jumps over the lazy dog. A serving engine reads a checkpoint directory: its
configuration, its weights, its tokenizer and its chat template. Tokens are decoded as they come,
so a reader sees the text grow word by word; a stop string may span two tokens, and an end token
finishes the answer. Sparse attention keeps a few hot rows of the cache on the device and the
rest on the host; speculative decoding drafts tokens and verifies them in one pass.
café, naïve, façade, résumé; €5, £3, ¥100; Ελληνικά, русский, 日本語, 中文, 한국어; emoji: 🙂🚀.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
"""
SPECIALS = ("<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = "the quick brown fox"


def train_tokenizer(vocab_size: int = 700):
    """The BPE (ids: specials, then the 256 byte pieces, then the alphabet and the learned pieces).

    Trained here by a small BPE trainer of our own: ``tokenizers``' trainer breaks ties between
    equally frequent merges differently from run to run, and the tests name pieces; this one breaks
    them by the pair itself (highest count, then the lowest pair), so every run learns the same
    vocabulary. The alphabet is the 40 most frequent characters (the rest are spelt in bytes)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")  # pieces never span words
    words: dict[str, int] = {}
    for text in [TEXT * 4] + [line for line in TEXT.splitlines() if line]:
        for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)):
            words[word] = words.get(word, 0) + 1
    chars: dict[str, int] = {}
    for word, count in words.items():
        for ch in word:
            chars[ch] = chars.get(ch, 0) + count
    alphabet = sorted(sorted(chars), key=lambda ch: -chars[ch])[:40]
    pieces = [*SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *sorted(alphabet)]
    known = set(alphabet)
    # each word as a list of symbols; a character outside the alphabet is a barrier (byte fallback)
    spelt = {word: [ch if ch in known else None for ch in word] for word in words}
    merges: list[tuple[str, str]] = []
    while len(pieces) < vocab_size:
        pairs: dict[tuple[str, str], int] = {}
        for word, symbols in spelt.items():
            for a, b in itertools.pairwise(symbols):
                if a is not None and b is not None:
                    pairs[(a, b)] = pairs.get((a, b), 0) + words[word]
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        pieces.append(best[0] + best[1])
        for word, symbols in spelt.items():
            out, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            spelt[word] = out
    vocab = {piece: i for i, piece in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(list(SPECIALS))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


@attrs.frozen
class Checkpoint:
    path: Path
    eos_id: int  # </s>: config.json
    end_id: int  # <|end|>: generation_config.json adds it
    prompt_ids: tuple[int, ...]  # PROMPT encoded (with <s>)
    vocab_size: int
    end_at: int  # greedy output after PROMPT: the first <|end|> is at this position
    eos_at: int  # ... and the first </s> here (later)


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF greedy continuation by plain forward passes (the indexer tie-break aligned)."""
    from _hf_oracle import hf_float64_patches

    with torch.no_grad(), hf_float64_patches():
        ids = torch.tensor([prompt])
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def _end_positions(greedy: list[int], avoid: set[int]) -> tuple[int, int] | None:
    """Two positions (from the 3rd on) whose tokens are new there and distinct, or None."""
    fresh = [p for p in range(2, len(greedy)) if greedy[p] not in greedy[:p] and greedy[p] not in avoid]
    return (fresh[0], fresh[1]) if len(fresh) >= 2 else None


def build_checkpoint(out: Path, *, seed: int = 0, with_chat_template: bool = True) -> Checkpoint:
    """Write the checkpoint into ``out`` (created) and describe it.

    The first model seed (from ``seed``) whose greedy output has two fresh tokens to relabel as the
    end tokens is kept.
    """
    from _hf_oracle import random_hf_model, tiny_hf_config
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    backend = train_tokenizer()
    vocab = backend.get_vocab_size()
    eos_id, end_id = backend.token_to_id("</s>"), backend.token_to_id("<|end|>")
    cfg = tiny_hf_config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        n_routed_experts=4,
        n_group=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        max_position_embeddings=256,
        eos_token_id=eos_id,
    )
    prompt = backend.encode(PROMPT).ids
    for model_seed in range(seed, seed + 50):
        model = random_hf_model(cfg, model_seed)
        positions = _end_positions(_greedy(model, prompt, 10), {eos_id, end_id, *prompt})
        if positions is not None:
            break
    else:
        raise AssertionError("no model seed gave a usable greedy output")
    greedy = _greedy(model, prompt, 10)
    with torch.no_grad():
        for position, special in zip(positions, (end_id, eos_id)):
            token = greedy[position]
            for weight in (model.model.embed_tokens.weight, model.lm_head.weight):
                weight[[token, special]] = weight[[special, token]]
    relabelled = _greedy(model, prompt, 10)
    assert (relabelled.index(end_id), relabelled.index(eos_id)) == positions, (greedy, relabelled)
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [eos_id, end_id], "pad_token_id": eos_id, "do_sample": False}, indent=2)
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    (out / "chat_template.jinja").unlink(missing_ok=True)
    if with_chat_template:
        tok_config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(tok_config, indent=2))
    return Checkpoint(out, eos_id, end_id, tuple(prompt), vocab, *positions)


# ----- checkpoints as users have them ----------------------------------------------------------------
# sampling fields of generation_config.json, as DeepSeek's and GLM's checkpoints ship them
DEEPSEEK_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
GLM_SAMPLING = {"do_sample": True, "temperature": 1.0, "top_p": 0.9, "top_k": 40, "max_new_tokens": 12}


@attrs.frozen
class SavedCheckpoint:
    path: Path
    model_type: str  # "deepseek_v32" or "glm_moe_dsa"
    mtp: bool  # the weights hold an MTP layer (layer num_hidden_layers)
    sampling: dict  # the sampling fields of its generation_config.json
    eos_id: int


def build_saved_checkpoint(
    out: Path, *, model_type: str = "deepseek_v32", mtp: bool = False, seed: int = 0, tokenizer=None
) -> SavedCheckpoint:
    """A random tiny model written by HF ``save_pretrained`` in bfloat16 in two shards (with HF's
    index file), the trained tokenizer with its chat template, and a ``generation_config.json`` with
    sampling fields (:data:`DEEPSEEK_SAMPLING`, or :data:`GLM_SAMPLING` for ``glm_moe_dsa``).

    ``mtp``: add a DeepSeek-style MTP layer (``model.layers.{num_hidden_layers}.*``, hispec's
    names, its copies of the embedding and head included) in a third shard, the shards renamed
    ``-of-00003`` and the index updated, and ``num_nextn_predict_layers: 1`` in ``config.json``."""
    from _hf_oracle import random_hf_model, tiny_glm_config, tiny_hf_config
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    backend = tokenizer if tokenizer is not None else train_tokenizer()
    vocab, eos_id = backend.get_vocab_size(), backend.token_to_id("</s>")
    shape = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        n_routed_experts=4,
        n_group=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        max_position_embeddings=256,
        eos_token_id=eos_id,
    )
    glm = model_type == "glm_moe_dsa"
    cfg = tiny_glm_config(**shape, indexer_types=["full", "shared"]) if glm else tiny_hf_config(**shape)
    model = random_hf_model(cfg, seed).to(torch.bfloat16)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(out, max_shard_size=total * 3 // 5)  # two shards
    shards = sorted(out.glob("*.safetensors"))
    assert [f.name for f in shards] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    sampling = GLM_SAMPLING if glm else DEEPSEEK_SAMPLING
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id, **sampling}, indent=2))
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config_path = out / "tokenizer_config.json"
    config_path.write_text(
        json.dumps({**json.loads(config_path.read_text()), "chat_template": CHAT_TEMPLATE})
    )
    if mtp:
        _add_mtp_shard(out, seed)
    return SavedCheckpoint(out, model_type, mtp, sampling, eos_id)


def _add_mtp_shard(out: Path, seed: int) -> None:
    """A random MTP layer in a third shard (see ``build_saved_checkpoint``)."""
    from _model_util import random_model
    from safetensors.torch import save_file

    from pipeline.model import ModelConfig
    from pipeline.model.checkpoint import model_tensors
    from pipeline.model.weights import INDEX_FILE

    raw = json.loads((out / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    cfg = ModelConfig.from_hf_dict(raw)
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    donor = random_model(cfg, seed=seed + 1)
    tensors = {k: v for k, v in model_tensors(donor, torch.bfloat16).items() if k.startswith(prefix)}
    index = json.loads((out / INDEX_FILE).read_text())
    renamed = {}
    for i in (1, 2):
        old, new = f"model-0000{i}-of-00002.safetensors", f"model-0000{i}-of-00003.safetensors"
        (out / old).rename(out / new)
        renamed[old] = new
    third = "model-00003-of-00003.safetensors"
    save_file(tensors, str(out / third), metadata={"format": "pt"})
    index["weight_map"] = {name: renamed[file] for name, file in index["weight_map"].items()}
    index["weight_map"].update(dict.fromkeys(tensors, third))
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(raw, indent=2))


def resave_without_mtp(src: SavedCheckpoint, out: Path) -> SavedCheckpoint:
    """``src`` (no MTP layer in its weights) with ``num_nextn_predict_layers: 1`` in ``config.json``:
    what loading a DeepSeek checkpoint in HF and saving it again writes (HF keeps the count, drops
    the MTP tensors)."""
    import shutil

    assert not src.mtp
    shutil.copytree(src.path, out)
    raw = json.loads((out / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return attrs.evolve(src, path=out)
