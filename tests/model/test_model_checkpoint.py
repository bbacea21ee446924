"""Config parsing and HF-format checkpoints (names, dtypes, MTP layer, expert layouts)."""

from __future__ import annotations

import json

import pytest
import torch
from _model_util import prefill_logits, random_model, tiny_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pipeline.model import (
    CheckpointError,
    ModelConfig,
    ModelConfigError,
    load_model,
    save_model,
)
from pipeline.model.checkpoint import DTYPES


def _hf_dict(**overrides):
    raw = tiny_config().to_hf_dict()
    raw.update(overrides)
    return raw


def test_config_round_trips_through_hf_dict():
    cfg = tiny_config()
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_config_reads_hf_spellings():
    raw = _hf_dict(num_mtp_layers=1, eos_token_id=[256, 3], rope_theta=5000.0)
    for key in ("mlp_layer_types", "num_nextn_predict_layers", "rope_parameters"):
        del raw[key]
    raw["first_k_dense_replace"] = 1
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.mlp_layer_types == ("dense", "sparse")
    assert cfg.num_nextn_predict_layers == 1
    assert cfg.eos_token_id == 256
    assert cfg.rope_theta == 5000.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(model_type="llama"), "model_type"),
        (
            dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}),
            "rope_type 'linear'",
        ),
        (dict(q_lora_rank=None), "q_lora_rank"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(mlp_layer_types=["dense"]), "one entry per hidden layer"),
        (dict(index_head_dim=4), "index_head_dim"),
    ],
)
def test_config_rejects_what_it_cannot_serve(overrides, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf_dict(_hf_dict(**overrides))


def test_checkpoint_uses_hf_names_and_the_mtp_layer_index(tmp_path):
    model = random_model(seed=1)
    save_model(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    n = model.cfg.num_hidden_layers
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.self_attn.indexer.k_norm.bias",
        f"model.layers.{n}.enorm.weight",
        f"model.layers.{n}.hnorm.weight",
        f"model.layers.{n}.eh_proj.weight",
        f"model.layers.{n}.shared_head.norm.weight",
        f"model.layers.{n}.shared_head.head.weight",
        f"model.layers.{n}.embed_tokens.weight",
        f"model.layers.{n}.self_attn.kv_b_proj.weight",
        f"model.layers.{n}.mlp.experts.0.down_proj.weight",
    ):
        assert name in names, name
    assert not any(name.startswith("mtp.") or "gate_up_proj" in name for name in names)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_save_load_round_trip_in_every_dtype(tmp_path, dtype):
    model = random_model(seed=2)
    save_model(model, tmp_path, dtype=dtype)
    loaded = load_model(tmp_path)
    assert loaded.dtype == DTYPES[dtype] and loaded.cfg.dtype == dtype
    wide = torch.float64 if dtype == "float64" else torch.float32
    assert loaded.model.layers[1].mlp.gate.weight.dtype == wide  # router stays wide, as HF keeps it
    assert loaded.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == wide
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a.to(b.dtype), b), name


def test_fused_expert_tensors_load_too(tmp_path):
    model = random_model(seed=3)
    save_model(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    fused = {}
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        e = model.cfg.n_routed_experts
        gate_up = [
            torch.cat(
                [tensors.pop(f"{prefix}.{i}.gate_proj.weight"), tensors.pop(f"{prefix}.{i}.up_proj.weight")]
            )
            for i in range(e)
        ]
        fused[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{prefix}.down_proj"] = torch.stack(
            [tensors.pop(f"{prefix}.{i}.down_proj.weight") for i in range(e)]
        )
    save_file({**tensors, **fused}, str(tmp_path / "model.safetensors"))
    ids = list(range(30))
    assert torch.equal(prefill_logits(load_model(tmp_path), ids), prefill_logits(model, ids))


def test_missing_tensor_is_named(tmp_path):
    save_model(random_model(seed=4), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.eh_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"1 missing \(model\.layers\.2\.eh_proj\.weight\)"):
        load_model(tmp_path)


def test_tied_embeddings_round_trip(tmp_path):
    model = random_model(tiny_config(tie_word_embeddings=True), seed=5)
    save_model(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    loaded = load_model(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(prefill_logits(loaded, [1, 2, 3]), prefill_logits(model, [1, 2, 3]))


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 0.5), ("float16", 0.05)])
def test_every_dtype_runs_close_to_float64(tmp_path, dtype, tol):
    model = random_model(seed=6, std=0.05)
    save_model(model, tmp_path)
    ids = list(range(40, 80))
    low = prefill_logits(load_model(tmp_path, dtype=dtype), ids)
    assert low.dtype == DTYPES[dtype]
    assert (low.double() - prefill_logits(model, ids)).abs().max() < tol


# ----- RoPE and indexer layouts read as HF reads them -----------------------------------------------

YARN_VARIANTS = {
    "mscale-both": dict(factor=40.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0),
    "mscale-differ": dict(factor=4.0, original_max_position_embeddings=32, mscale=0.9, mscale_all_dim=0.7),
    "factor-only": dict(factor=8.0, original_max_position_embeddings=16),
    "attention-factor": dict(
        factor=2.0, original_max_position_embeddings=64, attention_factor=1.3, beta_fast=16, beta_slow=2
    ),
    "no-truncate": dict(factor=3.0, original_max_position_embeddings=48, truncate=False, mscale_all_dim=0.5),
}


@pytest.mark.parametrize("variant", sorted(YARN_VARIANTS))
def test_yarn_frequencies_and_scales_equal_hfs(variant):
    from _hf_oracle import tiny_hf_config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention

    params = {"rope_type": "yarn", "rope_theta": 50000.0, **YARN_VARIANTS[variant]}
    hf_cfg = tiny_hf_config(rope_parameters=dict(params), max_position_embeddings=2048)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    cfg = ModelConfig.from_hf_dict(_hf_dict(rope_parameters=dict(params), max_position_embeddings=2048))
    assert torch.equal(cfg.rope.inv_freq(cfg.qk_rope_head_dim), inv_freq)
    assert cfg.rope.cos_sin_factor() == attention_factor
    assert cfg.attn_scale == DeepseekV32Attention(hf_cfg, 0).scaling
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_yarn_in_the_older_rope_scaling_spelling():
    raw = _hf_dict(rope_theta=10000.0, max_position_embeddings=4096)
    del raw["rope_parameters"]
    raw["rope_scaling"] = {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.rope_yarn is not None and cfg.rope_yarn.factor == 40.0 and cfg.rope_theta == 10000.0
    assert cfg.attn_scale > cfg.qk_head_dim**-0.5  # DeepSeek's mscale correction of the softmax scale


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(index_topk_freq=2),
        dict(index_topk_freq=3, index_skip_topk_offset=1),
        dict(index_topk_pattern="FSFS"),
        dict(indexer_types=["full", "full", "shared", "shared"]),
    ],
    ids=["default", "freq2", "freq3-offset1", "pattern", "explicit"],
)
def test_glm_indexer_types_equal_hfs(kwargs):
    from _hf_oracle import tiny_glm_config

    hf_cfg = tiny_glm_config(**{"indexer_types": None, **kwargs})
    raw = hf_cfg.to_dict()
    raw.pop("indexer_types")  # read from the raw schedule keys, as in a config.json that lacks the list
    raw.update(kwargs)
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.model_type == "glm_moe_dsa" and cfg.indexer_rope == "interleaved"
    assert cfg.indexer_types == tuple(hf_cfg.indexer_types)
    assert cfg.num_full_indexer_layers == hf_cfg.indexer_types.count("full")
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(model_type="deepseek_v3"),
            r"model_type 'deepseek_v3' is not supported \(supported: deepseek_v32, glm_moe_dsa\)",
        ),
        (
            dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}),
            r"rope_parameters\.rope_type 'llama3' is not supported \(supported: default, yarn\)",
        ),
        (
            dict(model_type="glm_moe_dsa", indexer_types=["shared", "full"]),
            r"indexer_types\[0\] must be 'full'",
        ),
        (dict(model_type="glm_moe_dsa", indexer_types=["full", "sparse"]), "indexer_types entries must be"),
    ],
)
def test_unsupported_architecture_and_rope_are_one_line_errors(overrides, message):
    with pytest.raises(ModelConfigError, match=message) as info:
        ModelConfig.from_hf_dict(_hf_dict(**overrides))
    assert info.value.field == "model" and "\n" not in str(info.value)
