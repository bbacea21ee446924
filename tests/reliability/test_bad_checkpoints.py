"""Broken checkpoints a user may bring: each is refused when it is read, in one line naming what is
wrong (a ``config.json`` field, the tensors that hold NaN or Inf, the tokenizer file), never
accepted with a value it does not hold and never a traceback.

* ``config.json`` is read strictly: an integer field must be a JSON integer (not a float, a bool or
  a string) in its range, a flag a JSON bool, a float finite and in its range, ``eos_token_id`` an
  id (or a list of ids) of the model's vocabulary;
* a weight holding NaN or Inf fails the load, the error listing every such tensor;
* a ``tokenizer.json`` that is not a tokenizer (random bytes, cut JSON, JSON of another shape) is a
  ``ConfigError`` on ``model`` (``tokenizer`` for a ``--tokenizer`` directory) naming the file.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import pipeline.cli as cli
from pipeline.errors import ConfigError
from pipeline.model import CheckpointError, ModelConfig, ModelConfigError, load_model, save_model
from pipeline.model.tokenizer import load_tokenizer, tokenizer_for_model
from pipeline.startup import preflight

from tiny_models import TINY_CONFIG, build_tiny_model

NAN, INF = math.nan, math.inf
ROOT = Path(__file__).resolve().parents[2]


def _set(path: str, value):
    """A change to the config dict: ``path`` is a key, or ``outer.inner`` for a nested object."""

    def change(raw: dict) -> None:
        *outer, key = path.split(".")
        target = raw
        for name in outer:
            target = target.setdefault(name, {})
        target[key] = value

    return change


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512}


def _yarn(**changes):
    def change(raw: dict) -> None:
        raw["rope_parameters"] = {**YARN, **changes}

    return change


# (the field the error must name, the change that breaks it); each starts from TINY_CONFIG, a valid
# config of the small test model
BROKEN = [
    # flags: a JSON bool, never a string or a number ("false" used to be read as true)
    ("norm_topk_prob", _set("norm_topk_prob", "false")),
    ("norm_topk_prob", _set("norm_topk_prob", 0)),
    ("tie_word_embeddings", _set("tie_word_embeddings", "true")),
    ("attention_bias", _set("attention_bias", "false")),
    # sizes: JSON integers (256.7 used to be read as 256), positive
    ("hidden_size", _set("hidden_size", 256.7)),
    ("hidden_size", _set("hidden_size", 64.0)),
    ("hidden_size", _set("hidden_size", "64")),
    ("hidden_size", _set("hidden_size", True)),
    ("hidden_size", _set("hidden_size", 0)),
    ("vocab_size", _set("vocab_size", -257)),
    ("vocab_size", _set("vocab_size", 257.5)),
    ("intermediate_size", _set("intermediate_size", 0)),
    ("moe_intermediate_size", _set("moe_intermediate_size", -32)),
    ("moe_intermediate_size", _set("moe_intermediate_size", 32.5)),
    ("num_hidden_layers", _set("num_hidden_layers", 2.0)),
    ("num_hidden_layers", _set("num_hidden_layers", 0)),
    ("num_attention_heads", _set("num_attention_heads", "4")),
    ("num_attention_heads", _set("num_attention_heads", 0)),
    ("n_shared_experts", _set("n_shared_experts", -1)),
    ("n_routed_experts", _set("n_routed_experts", 4.5)),
    ("kv_lora_rank", _set("kv_lora_rank", 0)),
    ("q_lora_rank", _set("q_lora_rank", 32.0)),
    ("qk_rope_head_dim", _set("qk_rope_head_dim", 7)),
    ("qk_rope_head_dim", _set("qk_rope_head_dim", -8)),
    ("qk_nope_head_dim", _set("qk_nope_head_dim", 0)),
    ("v_head_dim", _set("v_head_dim", 16.5)),
    ("n_group", _set("n_group", 3)),
    ("n_group", _set("n_group", 0)),
    ("topk_group", _set("topk_group", 2)),
    ("num_experts_per_tok", _set("num_experts_per_tok", 5)),
    ("num_experts_per_tok", _set("num_experts_per_tok", 2.0)),
    ("first_k_dense_replace", _set("first_k_dense_replace", -1)),
    ("first_k_dense_replace", _set("first_k_dense_replace", 1.5)),
    ("mlp_layer_types", _set("mlp_layer_types", "dense")),
    ("mlp_layer_types", _set("mlp_layer_types", ["dense", 3])),
    ("hidden_act", _set("hidden_act", 3)),
    ("max_position_embeddings", _set("max_position_embeddings", 0)),
    ("max_position_embeddings", _set("max_position_embeddings", 2048.5)),
    ("max_position_embeddings", _set("max_position_embeddings", INF)),
    ("index_topk", _set("index_topk", 0)),
    ("index_topk", _set("index_topk", 8.5)),
    ("index_head_dim", _set("index_head_dim", 16.0)),
    ("index_n_heads", _set("index_n_heads", -2)),
    ("num_nextn_predict_layers", _set("num_nextn_predict_layers", -1)),
    ("num_nextn_predict_layers", _set("num_nextn_predict_layers", 1.5)),
    ("num_nextn_predict_layers", _set("num_nextn_predict_layers", True)),
    ("dtype", _set("dtype", "float8")),
    ("dtype", _set("dtype", 32)),
    # floats: finite, in range (a NaN rms_norm_eps used to load, then fail every request)
    ("rms_norm_eps", _set("rms_norm_eps", NAN)),
    ("rms_norm_eps", _set("rms_norm_eps", INF)),
    ("rms_norm_eps", _set("rms_norm_eps", 0.0)),
    ("rms_norm_eps", _set("rms_norm_eps", -1e-6)),
    ("rms_norm_eps", _set("rms_norm_eps", "1e-6")),
    ("rms_norm_eps", _set("rms_norm_eps", True)),
    ("rope_theta", _set("rope_theta", NAN)),
    ("rope_theta", _set("rope_theta", 0)),
    ("rope_theta", _set("rope_theta", -10000.0)),
    ("rope_theta", _set("rope_theta", "10000")),
    ("rope_theta", _set("rope_parameters.rope_theta", INF)),
    ("routed_scaling_factor", _set("routed_scaling_factor", NAN)),
    ("routed_scaling_factor", _set("routed_scaling_factor", -INF)),
    ("routed_scaling_factor", _set("routed_scaling_factor", 0)),
    ("routed_scaling_factor", _set("routed_scaling_factor", "2.5")),
    ("rope_parameters", _set("rope_parameters", "yarn")),
    ("rope_parameters.factor", _yarn(factor=NAN)),
    ("rope_parameters.factor", _yarn(factor="4")),
    ("rope_parameters.original_max_position_embeddings", _yarn(original_max_position_embeddings=0)),
    ("rope_parameters.original_max_position_embeddings", _yarn(original_max_position_embeddings=512.5)),
    ("rope_parameters.beta_fast", _yarn(beta_fast=INF)),
    ("rope_parameters.mscale_all_dim", _yarn(mscale_all_dim=NAN)),
    ("rope_parameters.truncate", _yarn(truncate="false")),
    # end ids: ids of the model's vocabulary (257 here)
    ("eos_token_id", _set("eos_token_id", -1)),
    ("eos_token_id", _set("eos_token_id", 257)),
    ("eos_token_id", _set("eos_token_id", 999)),
    ("eos_token_id", _set("eos_token_id", [256, -1])),
    ("eos_token_id", _set("eos_token_id", [256, "1"])),
    ("eos_token_id", _set("eos_token_id", 1.5)),
    ("eos_token_id", _set("eos_token_id", "256")),
    ("eos_token_id", _set("eos_token_id", True)),
    # quantization: block sizes are JSON integers
    ("quantization_config.weight_block_size", _set("quantization_config", {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [True, 128]})),
    ("quantization_config.weight_block_size", _set("quantization_config", {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128.0, 128]})),
]
# GLM-5's own fields
BROKEN_GLM = [
    ("indexer_types", _set("indexer_types", ["full", 3])),
    ("indexer_types", _set("indexer_types", "full")),
    ("index_topk_freq", _set("index_topk_freq", 1.5)),
    ("index_topk_freq", _set("index_topk_freq", "2")),
    ("index_skip_topk_offset", _set("index_skip_topk_offset", "2")),
    ("index_topk_pattern", _set("index_topk_pattern", 7)),
]
CASES = [("deepseek_v32", *case) for case in BROKEN] + [("glm_moe_dsa", *case) for case in BROKEN_GLM]


def broken_config(model_type: str, change) -> dict:
    raw = json.loads(json.dumps({**TINY_CONFIG, "model_type": model_type}))
    change(raw)
    return raw


def _ids(cases):
    return [f"{i}-{case[1]}" for i, case in enumerate(cases)]


def test_the_base_config_is_valid():
    for model_type in ("deepseek_v32", "glm_moe_dsa"):
        ModelConfig.from_hf_dict(broken_config(model_type, lambda raw: None))


@pytest.mark.parametrize(("model_type", "field", "change"), CASES, ids=_ids(CASES))
def test_a_broken_config_field_is_named(model_type, field, change):
    from pipeline.model.fp8 import Fp8Config, QuantizationError

    raw = broken_config(model_type, change)
    with pytest.raises((ModelConfigError, QuantizationError)) as info:
        ModelConfig.from_hf_dict(raw)
        Fp8Config.from_hf_dict(raw)
    assert field in str(info.value), str(info.value)
    if isinstance(info.value, ConfigError):
        assert info.value.field == "model"


@pytest.mark.parametrize(("model_type", "field", "change"), CASES, ids=_ids(CASES))
def test_a_broken_config_json_is_refused_at_preflight_naming_the_field(model_type, field, change, tmp_path):
    """The engine's start-up reads the same file the same way: a ``ConfigError`` on ``model``, the
    directory as its value, ``config.json`` and the field in its rule, before anything is loaded."""
    from pipeline.config import EngineConfig

    (tmp_path / "config.json").write_text(json.dumps(broken_config(model_type, change)))
    with pytest.raises(ConfigError) as info:
        preflight(EngineConfig(model=str(tmp_path)))
    assert info.value.field == "model" and info.value.value == str(tmp_path)
    assert "config.json" in info.value.rule and field in info.value.rule, info.value.rule
    assert "\n" not in str(info.value)


def test_an_end_id_outside_the_vocabulary_names_eos_token_id_not_the_tokenizer(tmp_path):
    """``eos_token_id: 999`` of a 257-id model was reported as "the tokenizer has 1000 ids" (the
    byte-level tokenizer grew to hold it); config.json's and generation_config.json's alike."""
    raw = dict(TINY_CONFIG, eos_token_id=999)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match=r"eos_token_id 999 is outside the model's vocabulary of 257"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, 999]}))
    with pytest.raises(ConfigError, match=r"generation_config.json: eos_token_id 999 is outside the model's "
                                          r"vocabulary of 257") as info:
        tokenizer_for_model(tmp_path, vocab_size=257, eos_token_id=256)
    assert info.value.field == "model"
    from pipeline.config import EngineConfig

    with pytest.raises(ConfigError, match="eos_token_id 999"):  # before the weights are read
        preflight(EngineConfig(model=str(tmp_path)))


def test_a_valid_config_json_still_reads_every_spelling():
    """Integral floats in float fields, null for absent, an empty end-id list, a list of end ids."""
    raw = dict(TINY_CONFIG, rms_norm_eps=1e-5, rope_theta=10000, routed_scaling_factor=2,
               eos_token_id=[256, 3], n_shared_experts=None)
    cfg = ModelConfig.from_hf_dict(raw)
    assert (cfg.rope_theta, cfg.routed_scaling_factor, cfg.eos_token_id) == (10000.0, 2.0, 256)
    assert cfg.n_shared_experts == 0
    assert ModelConfig.from_hf_dict(dict(TINY_CONFIG, eos_token_id=[])).eos_token_id is None


# ----- weights that hold NaN or Inf ------------------------------------------------------------------
NAN_TENSOR = "model.layers.0.self_attn.q_a_proj.weight"
INF_TENSOR = "model.layers.1.mlp.experts.2.down_proj.weight"


def _poisoned_checkpoint(out: Path) -> Path:
    """The small model saved (float32, no MTP layer), then one NaN in one tensor and one Inf in another."""
    save_model(build_tiny_model(dtype=torch.float32, num_nextn_predict_layers=0), out)
    file = out / "model.safetensors"
    tensors = load_file(str(file))
    tensors[NAN_TENSOR][1, 2] = math.nan
    tensors[INF_TENSOR][0, -1] = -math.inf
    save_file(tensors, str(file), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    return _poisoned_checkpoint(tmp_path_factory.mktemp("poisoned"))


def test_non_finite_weights_fail_the_load_naming_every_tensor(poisoned):
    with pytest.raises(CheckpointError) as info:
        load_model(poisoned)
    message = str(info.value)
    assert NAN_TENSOR in message and INF_TENSOR in message, message
    assert "NaN or Inf" in message and "\n" not in message
    assert info.value.field == "model" and info.value.value == str(poisoned)


def test_a_tensor_that_overflows_the_served_dtype_is_named_too(tmp_path):
    """A float32 weight of 1e6 is Inf in float16: the model as served holds it."""
    save_model(build_tiny_model(dtype=torch.float32, num_nextn_predict_layers=0), tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    tensors[NAN_TENSOR][0, 0] = 1e6
    save_file(tensors, str(file), metadata={"format": "pt"})
    load_model(tmp_path)  # float32, as saved: finite
    with pytest.raises(CheckpointError, match=f"{NAN_TENSOR}.*float16"):
        load_model(tmp_path, dtype="float16")


def test_non_finite_fp8_weights_and_scales_are_named(tmp_path):
    """FP8 checkpoints are checked after dequantization: a NaN weight code and an Inf scale both show."""
    from _checkpoints import to_fp8, write_fp8_config

    src = save_model(build_tiny_model(dtype=torch.float32, num_nextn_predict_layers=0), tmp_path / "src")
    tensors, quantized = to_fp8(load_file(str(src / "model.safetensors")))
    weight, scaled = quantized[0], quantized[1]
    tensors[weight].view(torch.uint8)[0, 0] = 0x7F  # float8_e4m3fn's NaN
    tensors[scaled.removesuffix("weight") + "weight_scale_inv"][0, 0] = math.inf
    out = tmp_path / "fp8"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_fp8_config(json.loads((src / "config.json").read_text()), out)
    with pytest.raises(CheckpointError) as info:
        load_model(out, dtype="float32")
    assert weight in str(info.value) and scaled in str(info.value), str(info.value)


def test_the_cli_reports_non_finite_weights_in_one_line(poisoned, capsys):
    status = cli.main(["generate", "--model", str(poisoned), "x"])
    err = capsys.readouterr().err.splitlines()
    assert status == 2, err
    assert len(err) == 1 and err[0].startswith("hispec generate: model="), err
    assert NAN_TENSOR in err[0] and INF_TENSOR in err[0]


# ----- a tokenizer.json that is not a tokenizer ------------------------------------------------------
GARBAGE = {
    "random bytes": bytes(range(256)) * 8,
    "truncated json": b'{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0',
    "a json list": b"[1, 2, 3]",
    "an object of the wrong shape": b'{"version": "1.0", "model": 7}',
    "empty": b"",
}


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("small")
    return save_model(build_tiny_model(dtype=torch.float32, num_nextn_predict_layers=0), out)


def _with_tokenizer_file(src: Path, out: Path, data: bytes, name: str = "tokenizer.json") -> Path:
    out.mkdir()
    for file in src.iterdir():
        os.symlink(file, out / file.name)
    (out / name).write_bytes(data)
    return out


@pytest.mark.parametrize("kind", list(GARBAGE))
def test_a_garbage_tokenizer_json_is_a_config_error_naming_the_file(small_checkpoint, tmp_path, kind):
    model = _with_tokenizer_file(small_checkpoint, tmp_path / "m", GARBAGE[kind])
    with pytest.raises(ConfigError) as info:
        load_tokenizer(model)
    assert info.value.field == "model" and "tokenizer.json" in info.value.rule, str(info.value)
    assert "\n" not in str(info.value)
    other = tmp_path / "tok"
    other.mkdir()
    (other / "tokenizer.json").write_bytes(GARBAGE[kind])
    with pytest.raises(ConfigError) as info:
        load_tokenizer(small_checkpoint, tokenizer=other)
    assert info.value.field == "tokenizer" and info.value.value == str(other), str(info.value)
    assert "tokenizer.json" in info.value.rule


def test_a_garbage_tokenizer_config_of_a_tokenizer_directory_names_tokenizer(small_checkpoint, tmp_path):
    other = tmp_path / "tok"
    other.mkdir()
    (other / "tokenizer_config.json").write_bytes(b"{not json")
    with pytest.raises(ConfigError) as info:
        load_tokenizer(small_checkpoint, tokenizer=other)
    assert info.value.field == "tokenizer" and "tokenizer_config.json" in info.value.rule


@pytest.mark.parametrize("kind", ["random bytes", "truncated json", "a json list"])
def test_generate_with_a_garbage_tokenizer_json_is_one_line(small_checkpoint, tmp_path, capsys, kind):
    model = _with_tokenizer_file(small_checkpoint, tmp_path / "m", GARBAGE[kind])
    status = cli.main(["generate", "--model", str(model), "x"])
    err = capsys.readouterr().err.splitlines()
    assert status == 2, err
    assert len(err) == 1 and err[0].startswith(f"hispec generate: model={str(model)!r}"), err
    assert "tokenizer.json" in err[0]
    other = tmp_path / "tok"
    other.mkdir()
    (other / "tokenizer.json").write_bytes(GARBAGE[kind])
    status = cli.main(["generate", "--model", str(small_checkpoint), "--tokenizer", str(other), "x"])
    err = capsys.readouterr().err.splitlines()
    assert status == 2, err
    assert len(err) == 1 and err[0].startswith(f"hispec generate: tokenizer={str(other)!r}"), err


def test_serve_with_a_garbage_tokenizer_json_exits_2_with_one_line(small_checkpoint, tmp_path):
    pytest.importorskip("uvicorn")
    model = _with_tokenizer_file(small_checkpoint, tmp_path / "m", GARBAGE["random bytes"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "serve", "--model", str(model), "--port", "0"],
        capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL, cwd=ROOT,
    )
    err = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert len(err) == 1 and "Traceback" not in done.stderr, done.stderr
    assert err[0].startswith("hispec serve: model=") and "tokenizer.json" in err[0], err
