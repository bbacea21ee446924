"""HF-format checkpoints: ``config.json`` + ``*.safetensors``, with HF's tensor names.

Names are what HF transformers 5.24 ``save_pretrained`` writes for ``DeepseekV32ForCausalLM``, plus the
MTP layer of original DeepSeek-V3 checkpoints:

    model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent when tied)
    model.layers.{i}.self_attn.{q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj}.weight
    model.layers.{i}.self_attn.{q_a_layernorm,kv_a_layernorm}.weight
    model.layers.{i}.self_attn.indexer.{wq_b,wk,weights_proj}.weight, ...indexer.k_norm.{weight,bias}
    model.layers.{i}.mlp.{gate,up,down}_proj.weight                              (dense layers)
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight                  (MoE, per expert)
    model.layers.{i}.mlp.gate.weight, ...mlp.gate.e_score_correction_bias, ...mlp.shared_experts.*
    model.layers.{L+d}.{enorm,hnorm,eh_proj,shared_head.norm}.*  + the decoder layer's names  (MTP depth d)
    model.layers.{L+d}.{embed_tokens,shared_head.head}.weight    copies of the shared tensors (written,
                                                                 ignored on load, as HF ignores them)

Loading (sharded, lazy, FP8) lives in ``loader.py``; this module holds the names and the writer.
``save_model`` writes one ``model.safetensors``, or shards plus ``model.safetensors.index.json``
when given ``max_shard_bytes``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from pipeline.model.layers import wide_dtype
from pipeline.model.model import _WIDE_SUFFIXES, DeepseekV32
from pipeline.model.weights import INDEX_FILE

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
# tensors of an MTP layer that copy the model's own (written for other readers, ignored on load)
MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


# ----- names ----------------------------------------------------------------------------------------
def to_checkpoint_name(name: str, num_layers: int) -> str:
    m = re.match(r"^mtp\.(\d+)\.(.*)$", name)
    if m is None:
        return name
    layer, rest = num_layers + int(m.group(1)), m.group(2)
    rest = rest.removeprefix("block.")
    return f"model.layers.{layer}.{rest}"


def _split_experts(name: str, tensor: Tensor) -> dict[str, Tensor]:
    """Our fused expert tensors -> HF's per-expert checkpoint tensors."""
    prefix = name.rsplit(".", 1)[0]  # "...mlp.experts"
    out: dict[str, Tensor] = {}
    for e in range(tensor.shape[0]):
        if name.endswith("gate_up_proj"):
            gate, up = tensor[e].chunk(2, dim=0)
            out[f"{prefix}.{e}.gate_proj.weight"] = gate
            out[f"{prefix}.{e}.up_proj.weight"] = up
        else:
            out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
    return out


def model_tensors(model: DeepseekV32, dtype: torch.dtype) -> dict[str, Tensor]:
    """The checkpoint tensors of ``model`` in HF naming (router/indexer weights kept wide)."""
    cfg = model.cfg
    out: dict[str, Tensor] = {}
    for name, tensor in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        cast = wide_dtype(dtype) if name.endswith(_WIDE_SUFFIXES) else dtype
        tensor = tensor.detach().to("cpu", cast)
        ckpt = to_checkpoint_name(name, cfg.num_hidden_layers)
        if ckpt.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            out.update(_split_experts(ckpt, tensor))
        else:
            out[ckpt] = tensor
    for depth in range(cfg.num_nextn_predict_layers):
        prefix = f"model.layers.{cfg.num_hidden_layers + depth}."
        # copies, not views: safetensors refuses tensors that share memory
        out[prefix + "embed_tokens.weight"] = (
            model.model.embed_tokens.weight.detach().to("cpu", dtype).clone()
        )
        out[prefix + "shared_head.head.weight"] = model.lm_head.weight.detach().to("cpu", dtype).clone()
    return {k: v.contiguous() for k, v in sorted(out.items())}


def save_model(
    model: DeepseekV32,
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write ``config.json`` and the weights (HF names) into ``path``; returns the directory.

    Without ``max_shard_bytes``: one ``model.safetensors``. With it: shards
    ``model-0000i-of-0000n.safetensors`` of at most that size (a larger tensor gets a shard of its
    own) and ``model.safetensors.index.json``, as HF writes sharded checkpoints.
    """
    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = parse_dtype(dtype) if dtype is not None else model.dtype
    raw = model.cfg.to_hf_dict()
    raw["dtype"] = dtype_name(target)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tensors = model_tensors(model, target)
    if max_shard_bytes is None:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        write_shards(tensors, out_dir, max_shard_bytes)
    return out_dir


def write_shards(tensors: dict[str, Tensor], out_dir: Path, max_shard_bytes: int) -> list[Path]:
    """Split ``tensors`` (in order) into safetensors shards plus HF's index file; returns the shards."""
    groups: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += nbytes
    files, weight_map = [], {}
    for i, group in enumerate(groups):
        file = out_dir / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(file), metadata={"format": "pt"})
        files.append(file)
        weight_map.update(dict.fromkeys(group, file.name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files
