"""The bundled checkpoint (``"tiny"``): loads in HF transformers, agrees with it, and speculates.

HF runs patched (see ``_hf_oracle``): in float32 the patches change nothing but the indexer's top-k
tie-break (a stable descending sort, hispec's contract); in float64 they also keep RMSNorm, router,
indexer scores and softmax in float64 instead of HF's float32.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from _hf_oracle import hf_float64_patches
from _model_util import new_backend, run
from transformers import AutoTokenizer, DeepseekV32Config, DeepseekV32ForCausalLM
from transformers.modeling_layers import MtpLayer
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

import pipeline.model.corpus
from pipeline.model import ForwardLayout, ModelConfig, load_model, resolve_model_dir
from pipeline.model.reference import ReferenceDecoder, ReferenceSpecDecoder
from pipeline.model.tokenizer import ByteTokenizer
from pipeline.model.train import build_parser, model_config

# Python source, longer than index_topk (64), so the indexer really selects
TEXT = inspect.getsource(pipeline.model.corpus.is_held_out) + inspect.getsource(pipeline.model.corpus._tokens)


@pytest.fixture(scope="module")
def path():
    return resolve_model_dir("tiny")


@pytest.fixture(scope="module")
def model32(path):
    return load_model(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def model64(path):
    return load_model(path, dtype=torch.float64)


def _hidden(model, ids):
    n = len(ids)
    backend = new_backend(model, num_rows=n, num_requests=1, max_ctx=n)
    positions = torch.arange(n)
    backend.begin(ForwardLayout(torch.zeros(n, dtype=torch.int64), positions, positions))
    with torch.no_grad():
        return model(torch.tensor(ids), positions, backend)


def test_bundled_name_resolves(path):
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    with pytest.raises(FileNotFoundError):
        resolve_model_dir("no-such-model")


def test_bundled_model_agrees_with_hf_float32(path, model32):
    ids = ByteTokenizer().encode(TEXT)
    assert len(ids) > 4 * model32.cfg.index_topk
    hf_model = DeepseekV32ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with hf_float64_patches(), torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    got = run(model32, new_backend(model32, len(ids), 1, len(ids)), ids, range(len(ids)))
    assert torch.allclose(got, out.logits[0], atol=1e-4, rtol=0), (got - out.logits[0]).abs().max()
    # the hidden state our MTP layer reads is HF's last hidden_states entry (after the final norm)
    assert torch.allclose(_hidden(model32, ids), out.hidden_states[-1][0], atol=1e-4, rtol=0)


def test_bundled_tokenizer_loads_in_hf(path):
    hf_tok = AutoTokenizer.from_pretrained(path)
    assert hf_tok(TEXT, add_special_tokens=False).input_ids == ByteTokenizer().encode(TEXT)
    assert hf_tok.eos_token_id == ByteTokenizer().eos_token_id


def _hf_mtp_layer(model) -> MtpLayer:
    """HF's own ``MtpLayer`` (DeepSeek-V3 MTP) around a V3.2 decoder layer, holding our MTP weights."""
    cfg = DeepseekV32Config(**{
        **{k: v for k, v in model.cfg.to_hf_dict().items() if k in DeepseekV32Config.__dataclass_fields__},
        "num_hidden_layers": 1, "mlp_layer_types": ["sparse"], "first_k_dense_replace": 0,
    })
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    layer = MtpLayer(cfg, hf.DeepseekV32DecoderLayer, hf.DeepseekV32RMSNorm, 0).to(torch.float64)
    state = {}
    for name, tensor in model.mtp[0].state_dict().items():
        name = name.replace("block.", "mtp_block.", 1).replace("shared_head.norm.", "post_norm.")
        state[name] = tensor
    layer.load_state_dict(state, strict=True)
    return layer.eval()


def test_mtp_layer_matches_hf_mtp_formula(model64):
    """hnorm(previous hidden) and enorm(next embedding), embedding first, one V3.2 decoder layer,
    shared_head.norm."""
    ids = ByteTokenizer().encode(TEXT)[:160]
    n = len(ids) - 1
    hidden = _hidden(model64, ids[:-1])  # [n, D] final-normed target hidden at positions 0..n-1
    backend = new_backend(model64, num_rows=n, num_requests=1, max_ctx=n)
    positions = torch.arange(n)
    backend.begin(ForwardLayout(torch.zeros(n, dtype=torch.int64), positions, positions))
    with torch.no_grad():
        ours = model64.mtp_forward(torch.tensor(ids[1:]), positions, hidden, backend)
    layer = _hf_mtp_layer(model64)
    rotary = hf.DeepseekV32RotaryEmbedding(layer.config)
    embeds = model64.model.embed_tokens(torch.tensor([ids[1:]]))
    mask = torch.full((n, n), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
    with hf_float64_patches(), torch.no_grad():
        theirs = layer(embeds, hidden[None], rotary(embeds, positions[None]), mask, positions[None], None)[0]
    assert torch.allclose(ours.hidden, theirs, atol=1e-9, rtol=0), (ours.hidden - theirs).abs().max()
    assert torch.allclose(ours.logits, model64.lm_head(theirs), atol=1e-9, rtol=0)


def test_spec_equals_greedy_on_the_bundled_model(model64):
    prompt = ByteTokenizer().encode(TEXT)[:200]
    plain = ReferenceDecoder(model64).generate(prompt, 48, stop_at_eos=False)
    spec = ReferenceSpecDecoder(model64, 3).generate(prompt, 48, stop_at_eos=False)
    assert spec.token_ids == plain.token_ids
    assert spec.mean_accept_length > 1.5  # the trained MTP head really drafts


def test_train_defaults_build_the_bundled_architecture(path):
    """``hispec train`` with no architecture flags builds exactly the bundled model's shape."""
    assert model_config(build_parser().parse_args(["--out", "unused"]), 256) == ModelConfig.from_dir(path)
