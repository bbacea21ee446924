"""The loader: sharded checkpoints, layers not served left unread, peak memory, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _checkpoints import to_fp8, write_fp8_config
from _model_util import prefill_logits, random_model, tiny_config
from safetensors.torch import load_file, save_file

from pipeline.errors import ConfigError
from pipeline.model import (
    CheckpointError,
    DeepseekV32,
    ModelConfigError,
    ModelNotFoundError,
    load_model,
    save_model,
)
from pipeline.model.checkpoint import model_tensors, write_shards
from pipeline.model.weights import INDEX_FILE, CheckpointFiles

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    model = random_model(seed=8)
    path = save_model(model, tmp_path_factory.mktemp("sharded"), max_shard_bytes=60_000)
    return model, path


def test_sharded_checkpoint_round_trips(sharded):
    model, path = sharded
    shards = sorted(path.glob("model-*.safetensors"))
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    assert len(shards) > 3 and set(weight_map.values()) == {s.name for s in shards}
    loaded = load_model(path)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(prefill_logits(loaded, list(range(30))), prefill_logits(model, list(range(30))))


def test_layers_not_served_are_not_read(sharded, monkeypatch):
    _, path = sharded
    read: list[str] = []
    real = CheckpointFiles._read_bytes
    monkeypatch.setattr(
        CheckpointFiles,
        "_read_bytes",
        lambda self, entry, out: read.append(entry.name) or real(self, entry, out),
    )
    model = load_model(path, mtp_layers=0)
    assert len(model.mtp) == 0 and model.cfg.num_nextn_predict_layers == 0
    assert read and not any(name.startswith("model.layers.2.") for name in read)  # the MTP layer
    read.clear()
    load_model(path)
    mtp_read = {name for name in read if name.startswith("model.layers.2.")}
    assert "model.layers.2.eh_proj.weight" in mtp_read
    assert "model.layers.2.embed_tokens.weight" not in mtp_read  # the MTP layer's copy of a shared tensor


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def _edit_config(path: Path, **changes) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def _first_shard(path: Path) -> Path:
    return sorted(path.glob("model-*.safetensors"))[0]


def _breakers():
    def no_config(p):
        (p / "config.json").unlink()

    def bad_json(p):
        (p / "config.json").write_text("{not json")

    def missing_field(p):
        raw = json.loads((p / "config.json").read_text())
        del raw["hidden_size"]
        (p / "config.json").write_text(json.dumps(raw))

    def garbage_shard(p):
        _first_shard(p).write_bytes(b"\xff" * 64)

    def truncated_shard(p):
        shard = _first_shard(p)
        shard.write_bytes(shard.read_bytes()[:-100])

    def index_names_missing_shard(p):
        _first_shard(p).unlink()

    def unknown_tensor(p):
        shard = _first_shard(p)
        tensors = load_file(str(shard))
        tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
        save_file(tensors, str(shard))
        table = json.loads((p / INDEX_FILE).read_text())
        table["weight_map"]["model.layers.0.self_attn.extra.weight"] = shard.name
        (p / INDEX_FILE).write_text(json.dumps(table))

    def wrong_shape(p):
        _edit_config(p, index_head_dim=24)

    def model_type(p):
        _edit_config(p, model_type="deepseek_v3")

    def rope_type(p):
        _edit_config(p, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})

    return [
        (no_config, "the directory has no config.json"),
        (bad_json, "config.json is not readable JSON"),
        (missing_field, "config.json: config.json lacks the field 'hidden_size'"),
        (garbage_shard, r"model-00001-of-\d+\.safetensors is not a readable safetensors file"),
        (truncated_shard, r"does not fit its byte range"),
        (
            index_names_missing_shard,
            r"model\.safetensors\.index\.json names model-00001-of-\d+\.safetensors, which does not exist",
        ),
        (unknown_tensor, r"1 unexpected \(model\.layers\.0\.self_attn\.extra\.weight\)"),
        (wrong_shape, r"indexer\.k_norm\.bias has shape \[16\], the config implies \[24\]"),
        (model_type, r"model_type 'deepseek_v3' is not supported \(supported: deepseek_v32, glm_moe_dsa\)"),
        (rope_type, r"rope_parameters\.rope_type 'dynamic' is not supported \(supported: default, yarn\)"),
    ]


@pytest.mark.parametrize(("breaker", "message"), _breakers(), ids=lambda x: getattr(x, "__name__", ""))
def test_loading_problems_are_one_line_config_errors(sharded, tmp_path, breaker, message):
    _, path = sharded
    broken = _copy(path, tmp_path / "broken")
    breaker(broken)
    with pytest.raises(ModelConfigError, match=message) as info:
        load_model(broken)
    error = info.value
    assert isinstance(error, ConfigError) and error.field == "model" and error.value == str(broken)
    assert "\n" not in str(error)


def test_missing_directory_is_a_config_error_and_file_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such model directory") as info:
        load_model(tmp_path / "nope")
    assert isinstance(info.value, FileNotFoundError) and info.value.field == "model"


def test_a_float8_tensor_without_scales_is_refused(tmp_path):
    model = random_model(seed=9)
    tensors = model_tensors(model, torch.float64)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(
        torch.float8_e4m3fn
    )
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(model.cfg.to_hf_dict()))
    with pytest.raises(CheckpointError, match=r"up_proj\.weight is float8 but has no .*weight_scale_inv"):
        load_model(tmp_path)


# ----- peak host memory while loading ----------------------------------------------------------------

_MEASURE = """
import json, resource, sys, time
import torch
torch.set_num_threads(1)
from pipeline.model.loader import load_model

def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

with torch.device("meta"):  # a first meta-device init imports ~900 modules: a constant, not the load's
    torch.nn.Embedding(2, 2)
before = rss()
start = time.perf_counter()
model = load_model(sys.argv[1], dtype=sys.argv[2])
seconds = time.perf_counter() - start
tensors = [*model.parameters(), *model.buffers()]
print(json.dumps({
    "before": before, "peak": rss(), "seconds": seconds,
    "model_bytes": sum(t.numel() * t.element_size() for t in tensors),
    "largest": max(t.numel() * t.element_size() for t in tensors),
}))
"""
_SLACK = 32 << 20  # headers, Python objects, allocator slack


def _measure(path: Path, dtype: str) -> dict:
    # Through a shell that forks the interpreter: a process started straight from pytest would
    # inherit pytest's own high-water mark as its ru_maxrss (the pre-exec memory counts), one
    # forked from the shell starts from the shell's few MB.
    out = subprocess.run(
        ["/bin/sh", "-c", '"$0" -c "$1" "$2" "$3"; true', sys.executable, _MEASURE, str(path), dtype],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _big_config(**overrides):
    kw = dict(
        vocab_size=16384,
        hidden_size=512,
        intermediate_size=2048,
        moe_intermediate_size=512,
        num_hidden_layers=2,
        n_routed_experts=4,
        q_lora_rank=128,
        kv_lora_rank=64,
        eos_token_id=None,
    )
    kw.update(overrides)
    return tiny_config(**kw)


def _uninitialised(cfg) -> DeepseekV32:
    with torch.device("meta"):
        model = DeepseekV32(cfg)
    model = model.to_empty(device="cpu")  # the values do not matter here, only the sizes ...
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.zero_()  # ... but they must be finite: empty memory may hold NaN, which fails a load
    return model


def test_peak_memory_while_loading_a_sharded_checkpoint(tmp_path):
    """~100 MB float32 in 16 MB shards: the loader's peak stays under model + largest tensor + slack
    (reading every tensor first, or mapping the shards, would cost a second model)."""
    model = _uninitialised(_big_config())
    save_model(model, tmp_path, max_shard_bytes=16 << 20)
    size = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert size > 90 << 20
    m = _measure(tmp_path, "float32")
    assert m["peak"] - m["before"] <= m["model_bytes"] + m["largest"] + _SLACK, m


@pytest.mark.slow
def test_peak_memory_while_loading_a_large_fp8_checkpoint(tmp_path):
    """A few hundred MB of FP8 shards dequantized to bfloat16 at load: the same bound."""
    cfg = _big_config(
        vocab_size=32768,
        hidden_size=1024,
        intermediate_size=4096,
        moe_intermediate_size=1024,
        num_hidden_layers=4,
        n_routed_experts=16,
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
    )
    model = _uninitialised(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    tensors, _ = to_fp8(model_tensors(model, torch.bfloat16))
    del model
    write_shards(tensors, tmp_path, 64 << 20)
    write_fp8_config(cfg.to_hf_dict(), tmp_path)
    size = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert size > 300 << 20
    m = _measure(tmp_path, "bfloat16")
    print(
        f"fp8 checkpoint {size / 2**20:.0f} MiB -> bf16 model {m['model_bytes'] / 2**20:.0f} MiB: "
        f"peak {(m['peak'] - m['before']) / 2**20:.0f} MiB over the baseline, {m['seconds']:.2f} s "
        f"({m['seconds'] / (size / 2**30):.2f} s per GiB of checkpoint)"
    )
    assert m["peak"] - m["before"] <= m["model_bytes"] + m["largest"] + _SLACK, m
