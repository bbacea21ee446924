"""Checkpoint directories written the way real ones are: an MTP layer after the decoder layers,
FP8 block-quantized linear weights with ``weight_scale_inv``, shards with an index file."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from _model_util import random_model
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from pipeline.model import ModelConfig
from pipeline.model.checkpoint import model_tensors, write_shards
from pipeline.model.weights import INDEX_FILE

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
BLOCK = 128
# left unquantized in DeepSeek / GLM FP8 checkpoints: embeddings, head, norms, router, indexer weights
_KEEP = ("embed_tokens.", "lm_head.", "shared_head.head.", "mlp.gate.weight", "weights_proj.", "eh_proj.")


def add_mtp_layer(ckpt: Path, seed: int) -> None:
    """Give a checkpoint HF wrote (HF has no MTP layer) a random MTP layer at index num_hidden_layers."""
    raw = json.loads((ckpt / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    cfg = ModelConfig.from_hf_dict(raw)
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    donor = random_model(cfg, seed=seed)
    tensors = {k: v for k, v in model_tensors(donor, torch.float64).items() if k.startswith(prefix)}
    save_file(tensors, str(ckpt / "mtp.safetensors"))
    index = ckpt / INDEX_FILE
    if index.is_file():
        table = json.loads(index.read_text())
        table["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
        index.write_text(json.dumps(table))
    (ckpt / "config.json").write_text(json.dumps(raw, indent=2))


def read_dir(ckpt: Path) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def quantize_fp8(w: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """``w [rows, cols]`` -> (float8_e4m3fn weight, float32 ``weight_scale_inv``
    ``[ceil(rows/b), ceil(cols/b)]``), one scale per block: ``scale_inv = amax(|block|) / 448``,
    ``w_fp8 = w / scale_inv`` (DeepSeek's recipe)."""
    rows, cols = w.shape
    gr, gc = -(-rows // block), -(-cols // block)
    w32 = w.to(torch.float32)
    padded = torch.zeros(gr * block, gc * block, dtype=torch.float32)
    padded[:rows, :cols] = w32
    amax = padded.reshape(gr, block, gc, block).abs().amax(dim=(1, 3))  # [gr, gc]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    expanded = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    q = (w32 / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv


def is_quantized(name: str, tensor: Tensor) -> bool:
    return tensor.ndim == 2 and name.endswith(".weight") and not any(k in name for k in _KEEP)


def to_fp8(tensors: dict[str, Tensor], rest_dtype=torch.bfloat16) -> tuple[dict[str, Tensor], list[str]]:
    """Checkpoint tensors -> FP8 checkpoint tensors (linear weights block-quantized with their
    ``weight_scale_inv``, the rest in ``rest_dtype``) and the names of the quantized weights."""
    out: dict[str, Tensor] = {}
    quantized: list[str] = []
    for name, tensor in tensors.items():
        if is_quantized(name, tensor):
            q, s = quantize_fp8(tensor)
            out[name] = q
            out[name.removesuffix("weight") + "weight_scale_inv"] = s
            quantized.append(name)
        else:
            out[name] = (tensor.to(rest_dtype) if tensor.is_floating_point() else tensor).contiguous()
    return out, quantized


def write_fp8_checkpoint(src: Path, out: Path, max_shard_bytes: int) -> list[str]:
    """Rewrite checkpoint ``src`` into ``out`` as an FP8 checkpoint (see :func:`to_fp8`), sharded with
    an index file. Returns the names of the quantized weights."""
    out.mkdir(parents=True, exist_ok=True)
    tensors, quantized = to_fp8(read_dir(src))
    write_shards(tensors, out, max_shard_bytes)
    raw = json.loads((src / "config.json").read_text())
    write_fp8_config(raw, out)
    return quantized


def write_fp8_config(raw: dict, out: Path) -> None:
    raw = dict(raw)
    raw["dtype"] = "bfloat16"
    raw["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (out / "config.json").write_text(json.dumps(raw, indent=2))
