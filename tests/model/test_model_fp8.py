"""FP8 block-quantized checkpoints: dequantized at load bit for bit as HF does, then HF's tokens.

A random HF DeepSeek-V3.2 (plus an MTP layer) is rewritten as real FP8 checkpoints are stored:
linear weights ``float8_e4m3fn`` with one float32 ``weight_scale_inv`` per 128x128 block, the rest
in bfloat16, in shards with ``model.safetensors.index.json``. Widths are multiples of 128 or below
it, where HF's dequantization (which derives the block from the scale grid) is defined.
"""

from __future__ import annotations

import json

import pytest
import torch
from _checkpoints import add_mtp_layer, quantize_fp8, read_dir, write_fp8_checkpoint
from _hf_oracle import hf_float64_patches, random_hf_model, tiny_hf_config
from _model_util import prefill_logits
from safetensors.torch import save_file
from transformers import DeepseekV32ForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from pipeline.model import CheckpointError, ModelConfigError, load_model
from pipeline.model.fp8 import Fp8Config, dequantize_into
from pipeline.model.loader import destinations
from pipeline.model.reference import ReferenceDecoder, ReferenceSpecDecoder
from pipeline.model.weights import INDEX_FILE

DIMS = dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=64, q_lora_rank=128)


def hf_dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float64)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """(FP8 checkpoint dir, names of its quantized weights, HF's model of the dequantized weights)."""
    root = tmp_path_factory.mktemp("fp8")
    random_hf_model(tiny_hf_config(**DIMS), seed=31).save_pretrained(root / "src")
    add_mtp_layer(root / "src", seed=6)
    quantized = write_fp8_checkpoint(root / "src", root / "fp8", max_shard_bytes=200_000)
    # HF's own dequantization of every quantized weight -> an unquantized float64 checkpoint for HF
    stored = read_dir(root / "fp8")
    plain = {}
    for name, tensor in stored.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale = name.removesuffix("weight") + "weight_scale_inv"
        plain[name] = hf_dequantize(tensor, stored[scale]) if scale in stored else tensor.to(torch.float64)
    (root / "hf").mkdir()
    save_file(plain, str(root / "hf" / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((root / "fp8" / "config.json").read_text())
    del raw["quantization_config"]
    raw["dtype"] = "float64"
    (root / "hf" / "config.json").write_text(json.dumps(raw))
    hf_model = DeepseekV32ForCausalLM.from_pretrained(root / "hf", dtype=torch.float64)
    hf_model.set_attn_implementation("eager")
    hf_model.set_experts_implementation("eager")
    return root / "fp8", quantized, plain, hf_model.eval()


def test_the_checkpoint_is_stored_like_real_ones(fp8):
    path, quantized, _, _ = fp8
    stored = read_dir(path)
    assert len(list(path.glob("model-*.safetensors"))) > 2 and (path / INDEX_FILE).is_file()
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in quantized
    assert "model.layers.3.self_attn.kv_b_proj.weight" in quantized  # the MTP layer's too
    w = stored["model.layers.0.mlp.down_proj.weight"]  # [256, 384]: a 2 x 3 grid of blocks
    assert w.dtype == torch.float8_e4m3fn
    assert stored["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 3)
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_dequantized_weights_equal_hfs_bit_for_bit(fp8):
    path, quantized, plain, _ = fp8
    ours = load_model(path, dtype=torch.float64)
    dests, _ = destinations(ours)
    for name in quantized:
        assert torch.equal(dests[name], plain[name]), name
    for name, tensor in dests.items():  # the unquantized ones too
        assert torch.equal(tensor, plain[name]), name
    assert len(quantized) > 40


def test_greedy_tokens_equal_hf_on_the_dequantized_model(fp8):
    path, _, _, hf_model = fp8
    ours = load_model(path, dtype=torch.float64)
    ids = torch.randint(0, ours.cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(4))
    with hf_float64_patches(), torch.no_grad():
        logits = hf_model(ids[None]).logits[0]
        expected = hf_model.generate(ids[None, :12], max_new_tokens=32, do_sample=False)[0, 12:].tolist()
    assert torch.allclose(prefill_logits(ours, ids), logits, atol=1e-9, rtol=0)
    assert (
        list(ReferenceDecoder(ours).generate(ids[:12].tolist(), 32, stop_at_eos=False).token_ids) == expected
    )
    spec = ReferenceSpecDecoder(ours, 2).generate(ids[:12].tolist(), 32, stop_at_eos=False)
    assert list(spec.token_ids) == expected
    assert len(set(expected)) > 3


def test_partial_blocks_use_the_block_that_covers_them():
    """Widths that are not multiples of the block (DeepSeek's kv_a_proj: 576 rows): ceil-sized grid."""
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q, s = quantize_fp8(w)
    assert s.shape == (2, 3)
    out = torch.empty(200, 300, dtype=torch.float64)
    dequantize_into(out, q, s, Fp8Config(block=(128, 128)), "w")
    rows = torch.arange(200)[:, None] // 128
    cols = torch.arange(300)[None, :] // 128
    assert torch.equal(out, (q.to(torch.float32) * s[rows, cols]).to(torch.float64))
    assert (out - w).abs().max() < 0.07 * w.abs().max()  # e4m3: 3 mantissa bits


def test_scale_grid_that_does_not_fit_is_named(fp8, tmp_path):
    path, _, _, _ = fp8
    for file in path.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    stored = read_dir(tmp_path)
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    weight_map = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    shard = weight_map[name]
    tensors = {k: v for k, v in stored.items() if weight_map[k] == shard}
    tensors[name] = torch.ones(2, 2)
    save_file(tensors, str(tmp_path / shard))
    with pytest.raises(
        CheckpointError, match=r"0\.mlp\.down_proj\.weight_scale_inv has shape \[2, 2\], expected \[2, 3\]"
    ):
        load_model(tmp_path, dtype=torch.float64)


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        (
            {"quant_method": "awq", "bits": 4},
            r"quantization_config\.quant_method 'awq' is not supported \(supported: fp8\)",
        ),
        ({"quant_method": "fp8", "fmt": "e5m2"}, r"quantization_config\.fmt 'e5m2'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size must be two positive ints"),
    ],
)
def test_unsupported_quantization_is_refused_in_one_line(fp8, tmp_path, quant, message):
    path, _, _, _ = fp8
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match=message) as info:
        load_model(tmp_path)
    assert info.value.field == "model" and "\n" not in str(info.value)
