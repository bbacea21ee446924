"""The model's shape, read from (and written back to) an HF ``config.json`` of ``deepseek_v32``.

Only what the forward pass needs is kept; everything else in the file is ignored on read. The MTP
layer count comes from ``num_nextn_predict_layers`` (HF's DeepSeek-V3 calls it ``num_mtp_layers``;
both spellings are read, 0 means no MTP layer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

_ASSETS = Path(__file__).resolve().parent.parent / "assets"
# names that resolve to a directory bundled with the package
BUNDLED_MODELS: dict[str, Path] = {"tiny": _ASSETS / "tiny"}


class ModelConfigError(ValueError):
    """A ``config.json`` that hispec cannot serve (wrong model type, unsupported RoPE, bad field)."""


def resolve_model_dir(name_or_path: str | Path) -> Path:
    """A bundled model's name (``"tiny"``) or a directory path -> the directory."""
    if isinstance(name_or_path, str) and name_or_path in BUNDLED_MODELS:
        return BUNDLED_MODELS[name_or_path]
    path = Path(name_or_path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {name_or_path!r} (bundled: {sorted(BUNDLED_MODELS)})")
    return path


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value <= 0:
        raise ModelConfigError(f"{attribute.name} must be positive, got {value}")


@attrs.frozen
class ModelConfig:
    """Hyper-parameters of a DeepSeek-V3.2-style model (MLA + DSA indexer + MoE + MTP)."""

    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)  # dense MLP width
    moe_intermediate_size: int  # width of one routed (and one shared) expert
    num_hidden_layers: int = attrs.field(validator=_positive)
    num_attention_heads: int = attrs.field(validator=_positive)
    n_shared_experts: int
    n_routed_experts: int
    routed_scaling_factor: float
    kv_lora_rank: int = attrs.field(validator=_positive)  # C: width of the cached latent
    q_lora_rank: int = attrs.field(validator=_positive)  # the indexer reads the query latent, so it is required
    qk_rope_head_dim: int = attrs.field(validator=_positive)  # R: rotated part of a query/key head
    v_head_dim: int = attrs.field(validator=_positive)
    qk_nope_head_dim: int = attrs.field(validator=_positive)
    n_group: int
    topk_group: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    # one entry per target layer: "dense" or "sparse" (MoE)
    mlp_layer_types: tuple[str, ...]
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    index_topk: int = attrs.field(validator=_positive)
    index_head_dim: int = attrs.field(validator=_positive)
    index_n_heads: int = attrs.field(validator=_positive)
    tie_word_embeddings: bool
    eos_token_id: int | None
    num_nextn_predict_layers: int  # MTP layers; 0 = none
    dtype: str = "float32"  # the dtype the checkpoint was saved in

    def __attrs_post_init__(self) -> None:
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ModelConfigError("mlp_layer_types must have one entry per hidden layer")
        if set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ModelConfigError(f"mlp_layer_types entries must be 'dense' or 'sparse': {self.mlp_layer_types}")
        if self.has_moe:
            if self.n_routed_experts % self.n_group:
                raise ModelConfigError("n_routed_experts must be a multiple of n_group")
            if not 0 < self.topk_group <= self.n_group:
                raise ModelConfigError("topk_group must be in 1..n_group")
            if self.n_routed_experts // self.n_group < 2:
                raise ModelConfigError("each expert group needs at least 2 experts (groups are scored by their top 2)")
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ModelConfigError("num_experts_per_tok must be in 1..n_routed_experts")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ModelConfigError("index_head_dim must be >= qk_rope_head_dim (the indexer rotates that many channels)")
        if self.qk_rope_head_dim % 2:
            raise ModelConfigError("qk_rope_head_dim must be even")
        if self.hidden_act != "silu":
            raise ModelConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.num_nextn_predict_layers < 0:
            raise ModelConfigError("num_nextn_predict_layers must be >= 0")
        if self.dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ModelConfigError(f"unsupported dtype {self.dtype!r}")

    # ----- derived values -------------------------------------------------------------------------
    @property
    def has_moe(self) -> bool:
        return "sparse" in self.mlp_layer_types or (self.num_nextn_predict_layers > 0 and self.n_routed_experts > 0)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_dim(self) -> int:
        """Width of one cached MLA row: ``[latent (C) | rope key (R)]``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def attn_scale(self) -> float:
        return self.qk_head_dim**-0.5

    @property
    def index_scale(self) -> float:
        return self.index_head_dim**-0.5

    @property
    def num_cache_layers(self) -> int:
        """Target layers plus MTP layers: every one of them owns a KV pool layer."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def mlp_kind(self, layer: int) -> str:
        """``"dense"`` or ``"sparse"`` for a target layer; MTP layers are MoE whenever experts exist (as in HF)."""
        if layer < self.num_hidden_layers:
            return self.mlp_layer_types[layer]
        return "sparse" if self.n_routed_experts > 0 else "dense"

    # ----- HF config.json -------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a ``deepseek_v32`` config dict; raises :class:`ModelConfigError` naming the bad field."""
        if raw.get("model_type") != "deepseek_v32":
            raise ModelConfigError(f"model_type must be 'deepseek_v32', got {raw.get('model_type')!r}")
        if raw.get("q_lora_rank") is None:
            raise ModelConfigError("q_lora_rank is required (the DSA indexer reads the query latent)")
        if raw.get("attention_bias"):
            raise ModelConfigError("attention_bias=True is not supported")
        num_layers = int(raw["num_hidden_layers"])
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            dense = min(int(raw.get("first_k_dense_replace", 3)), num_layers)
            mlp_types = ["dense"] * dense + ["sparse"] * (num_layers - dense)
        mtp = raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 0))
        eos = raw.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
            num_hidden_layers=num_layers,
            num_attention_heads=int(raw["num_attention_heads"]),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            n_routed_experts=int(raw.get("n_routed_experts") or 0),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            q_lora_rank=int(raw["q_lora_rank"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            mlp_layer_types=tuple(mlp_types),
            hidden_act=str(raw.get("hidden_act", "silu")),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            index_topk=int(raw["index_topk"]),
            index_head_dim=int(raw["index_head_dim"]),
            index_n_heads=int(raw["index_n_heads"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_id=None if eos is None else int(eos),
            num_nextn_predict_layers=int(mtp or 0),
            dtype=str(raw.get("dtype", raw.get("torch_dtype", "float32")) or "float32"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` HF transformers 5.x reads as a ``DeepseekV32Config``."""
        out: dict[str, Any] = {
            "architectures": ["DeepseekV32ForCausalLM"],
            "model_type": "deepseek_v32",
            "attention_bias": False,
            "num_key_value_heads": self.num_attention_heads,
            "first_k_dense_replace": _leading_dense(self.mlp_layer_types),
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "bos_token_id": None,
            "pad_token_id": None,
        }
        for field in attrs.fields(ModelConfig):
            if field.name in ("rope_theta",):
                continue
            value = getattr(self, field.name)
            out[field.name] = list(value) if isinstance(value, tuple) else value
        return dict(sorted(out.items()))

    @classmethod
    def from_dir(cls, name_or_path: str | Path) -> ModelConfig:
        path = resolve_model_dir(name_or_path) / "config.json"
        return cls.from_hf_dict(json.loads(path.read_text()))


def _leading_dense(types: tuple[str, ...]) -> int:
    count = 0
    for kind in types:
        if kind != "dense":
            break
        count += 1
    return count


def _rope_theta(raw: dict[str, Any]) -> float:
    """Default RoPE only: YaRN and friends change the angles and the softmax scale, so refuse them."""
    params = raw.get("rope_parameters")
    if params is None:
        scaling = raw.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ModelConfigError(f"rope_scaling {scaling!r} is not supported (default RoPE only)")
        return float(raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ModelConfigError(f"rope_parameters.rope_type {rope_type!r} is not supported (default RoPE only)")
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
