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

On load, fused expert tensors (``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``, HF's in-memory
form) are accepted too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from pipeline.model.config import ModelConfig, resolve_model_dir
from pipeline.model.layers import wide_dtype
from pipeline.model.model import _WIDE_SUFFIXES, DeepseekV32

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
_MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(ValueError):
    """Tensors missing from, or unknown to, a checkpoint."""


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
def _to_checkpoint_name(name: str, num_layers: int) -> str:
    m = re.match(r"^mtp\.(\d+)\.(.*)$", name)
    if m is None:
        return name
    layer, rest = num_layers + int(m.group(1)), m.group(2)
    rest = rest.removeprefix("block.")
    return f"model.layers.{layer}.{rest}"


def _to_model_name(name: str, num_layers: int) -> str | None:
    """Checkpoint name -> our state-dict name; None for the MTP layer's copies of shared tensors."""
    m = re.match(r"^model\.layers\.(\d+)\.(.*)$", name)
    if m is None or int(m.group(1)) < num_layers:
        return name
    depth, rest = int(m.group(1)) - num_layers, m.group(2)
    if rest in _MTP_SHARED_COPIES:
        return None
    if rest.startswith(_MTP_OWN):
        return f"mtp.{depth}.{rest}"
    return f"mtp.{depth}.block.{rest}"


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


def _fuse_experts(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-expert checkpoint tensors -> fused ``gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]``."""
    groups: dict[str, dict[int, dict[str, Tensor]]] = {}
    out: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = tensor
            continue
        groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = tensor
    for prefix, experts in groups.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))) or any(len(experts[e]) != 3 for e in ids):
            raise CheckpointError(f"incomplete per-expert tensors under {prefix}")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], dim=0) for e in ids]
        )
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in ids])
    return out


# ----- load / save ----------------------------------------------------------------------------------
def read_tensors(path: Path) -> dict[str, Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    tensors: dict[str, Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[key] = f.get_tensor(key)
    return tensors


def load_model(
    name_or_path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"
) -> DeepseekV32:
    """Build the model from an HF-format directory (or a bundled name such as ``"tiny"``).

    ``dtype`` defaults to the checkpoint's own. Raises :class:`CheckpointError` on missing or unknown tensors.
    """
    path = resolve_model_dir(name_or_path)
    cfg = ModelConfig.from_dir(path)
    target = parse_dtype(dtype if dtype is not None else cfg.dtype)
    with torch.device("meta"):
        model = DeepseekV32(cfg)
    # cast before loading, so a float64 checkpoint is not rounded through float32 on the way in
    model.to_empty(device=device).to_dtype(target)
    state = _checkpoint_to_state(read_tensors(path), cfg)
    expected = set(model.state_dict())
    missing, unknown = expected - set(state), set(state) - expected
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    if missing or unknown:
        raise CheckpointError(f"checkpoint {path}: missing {sorted(missing)}, unexpected {sorted(unknown)}")
    model.load_state_dict(state, strict=not cfg.tie_word_embeddings, assign=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _checkpoint_to_state(tensors: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    state: dict[str, Tensor] = {}
    for name, tensor in _fuse_experts(tensors).items():
        if "rotary_emb" in name:
            continue
        ours = _to_model_name(name, cfg.num_hidden_layers)
        if ours is not None:
            state[ours] = tensor
    return state


def model_tensors(model: DeepseekV32, dtype: torch.dtype) -> dict[str, Tensor]:
    """The checkpoint tensors of ``model`` in HF naming (router/indexer weights kept wide)."""
    cfg = model.cfg
    out: dict[str, Tensor] = {}
    for name, tensor in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        cast = wide_dtype(dtype) if name.endswith(_WIDE_SUFFIXES) else dtype
        tensor = tensor.detach().to("cpu", cast)
        ckpt = _to_checkpoint_name(name, cfg.num_hidden_layers)
        if ckpt.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            out.update(_split_experts(ckpt, tensor))
        else:
            out[ckpt] = tensor
    for depth in range(cfg.num_nextn_predict_layers):
        prefix = f"model.layers.{cfg.num_hidden_layers + depth}."
        # copies, not views: safetensors refuses tensors that share memory
        out[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().to("cpu", dtype).clone()
        out[prefix + "shared_head.head.weight"] = model.lm_head.weight.detach().to("cpu", dtype).clone()
    return {k: v.contiguous() for k, v in sorted(out.items())}


def save_model(model: DeepseekV32, path: str | Path, dtype: str | torch.dtype | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (HF names) into ``path``; returns the directory."""
    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = parse_dtype(dtype) if dtype is not None else model.dtype
    cfg = model.cfg
    raw = cfg.to_hf_dict()
    raw["dtype"] = dtype_name(target)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_file(model_tensors(model, target), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
