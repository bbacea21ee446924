"""The model's shape, read from (and written back to) an HF ``config.json``.

The architectures served are listed in ``registry`` (``deepseek_v32``, ``glm_moe_dsa``); any other
``model_type`` is refused. Only what the forward pass needs is kept; everything else in the file is
ignored on read. The MTP layer count comes from ``num_nextn_predict_layers`` (HF's DeepSeek-V3 calls
it ``num_mtp_layers``; both spellings are read, 0 means no MTP layer). A checkpoint whose weights
hold no tensor of the MTP layer that ``config.json`` names (HF's ``save_pretrained`` keeps the count
but writes no MTP tensors) is served as a model without one: ``ModelConfig.from_dir`` (and the
loader) set the count to 0 and keep the named count as ``absent_mtp_layers``. RoPE is plain or YaRN
(``rope``); a ``quantization_config`` is read by the loader (``fp8``), and checked here too.

Values are read strictly (``fields``): an integer field must hold a JSON integer in its range, a
flag a JSON bool, a number a finite one in its range, ``eos_token_id`` an id of the vocabulary (or
a list of them); ``null`` counts as absent. Every error is a :class:`ModelConfigError`, a
``ConfigError`` on the field ``model``, naming the ``config.json`` field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from pipeline.errors import ConfigError
from pipeline.model.fields import FieldError, flag, integer, number, string, strings, token_ids
from pipeline.model.fp8 import Fp8Config, QuantizationError
from pipeline.model.registry import INDEXER_ROPES, Architecture, UnsupportedArchitecture, architecture
from pipeline.model.rope import Rope, Yarn

_ASSETS = Path(__file__).resolve().parent.parent / "assets"
# names that resolve to a directory bundled with the package
BUNDLED_MODELS: dict[str, Path] = {"tiny": _ASSETS / "tiny"}


class ModelConfigError(ConfigError):
    """A model hispec cannot serve (its config.json or its weights); ``field`` is ``"model"``.

    ``value`` is the model directory (or the offending value when no directory is known) and
    ``rule`` says what is wrong, in one line.
    """

    def __init__(self, rule: str, value: object = "config.json") -> None:
        super().__init__("model", value, rule)


class ModelNotFoundError(ModelConfigError, FileNotFoundError):
    """The model directory does not exist (also a ``FileNotFoundError``)."""


def resolve_model_dir(name_or_path: str | Path) -> Path:
    """A bundled model's name (``"tiny"``) or a directory path -> the directory."""
    if isinstance(name_or_path, str) and name_or_path in BUNDLED_MODELS:
        return BUNDLED_MODELS[name_or_path]
    path = Path(name_or_path)
    if not path.is_dir():
        raise ModelNotFoundError(
            f"no such model directory (bundled: {', '.join(sorted(BUNDLED_MODELS))})", str(name_or_path)
        )
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
    q_lora_rank: int = attrs.field(validator=_positive)  # the indexer reads the query latent: required
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
    model_type: str = "deepseek_v32"  # a key of registry.ARCHITECTURES
    rope_yarn: Yarn | None = None  # None = plain RoPE with rope_theta
    # per target layer "full" (runs its indexer) or "shared" (reuses the previous full layer's
    # top-k); empty = every layer full. The first layer is full; MTP layers are always full.
    indexer_types: tuple[str, ...] = ()
    # MTP layers config.json names but the checkpoint's weights lack entirely: num_nextn_predict_layers
    # is then 0 (``without_absent_mtp``); kept so that asking for speculation can say why it cannot run
    absent_mtp_layers: int = 0

    def __attrs_post_init__(self) -> None:
        try:
            architecture(self.model_type)
        except UnsupportedArchitecture as exc:
            raise ModelConfigError(str(exc)) from None
        if self.indexer_types:
            if len(self.indexer_types) != self.num_hidden_layers:
                raise ModelConfigError("indexer_types must have one entry per hidden layer")
            if set(self.indexer_types) - {"full", "shared"}:
                raise ModelConfigError(
                    f"indexer_types entries must be 'full' or 'shared': {list(self.indexer_types)}"
                )
            if self.indexer_types[0] != "full":
                raise ModelConfigError(
                    "indexer_types[0] must be 'full' (a shared layer reuses an earlier full layer)"
                )
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ModelConfigError("mlp_layer_types must have one entry per hidden layer")
        if set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ModelConfigError(
                f"mlp_layer_types entries must be 'dense' or 'sparse': {self.mlp_layer_types}"
            )
        if self.has_moe:
            if self.n_routed_experts % self.n_group:
                raise ModelConfigError("n_routed_experts must be a multiple of n_group")
            if not 0 < self.topk_group <= self.n_group:
                raise ModelConfigError("topk_group must be in 1..n_group")
            if self.n_routed_experts // self.n_group < 2:
                raise ModelConfigError(
                    "each expert group needs at least 2 experts (groups are scored by their top 2)"
                )
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ModelConfigError("num_experts_per_tok must be in 1..n_routed_experts")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ModelConfigError(
                "index_head_dim must be >= qk_rope_head_dim (the indexer rotates that many channels)"
            )
        if self.qk_rope_head_dim % 2:
            raise ModelConfigError("qk_rope_head_dim must be even")
        if self.hidden_act != "silu":
            raise ModelConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.num_nextn_predict_layers < 0:
            raise ModelConfigError("num_nextn_predict_layers must be >= 0")
        if self.dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ModelConfigError(f"unsupported dtype {self.dtype!r}")
        for name in ("moe_intermediate_size", "n_shared_experts", "n_routed_experts", "num_experts_per_tok"):
            if getattr(self, name) < 0:
                raise ModelConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.has_moe and self.moe_intermediate_size < 1:
            raise ModelConfigError("moe_intermediate_size must be positive in a model with routed experts")
        for name in ("rms_norm_eps", "rope_theta", "routed_scaling_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ModelConfigError(f"{name} must be a finite number > 0, got {value}")
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab_size:
            raise ModelConfigError(
                f"eos_token_id {self.eos_token_id} is outside the model's vocabulary of {self.vocab_size} ids"
            )

    # ----- derived values -------------------------------------------------------------------------
    @property
    def arch(self) -> Architecture:
        return architecture(self.model_type)

    @property
    def rope(self) -> Rope:
        return Rope(theta=self.rope_theta, yarn=self.rope_yarn)

    @property
    def indexer_rope(self) -> str:
        """``"half_split"`` or ``"interleaved"``: how the indexer pairs its rotated channels."""
        rope = self.arch.indexer_rope
        assert rope in INDEXER_ROPES
        return rope

    def indexer_kind(self, layer: int) -> str:
        """``"full"`` or ``"shared"`` for a target layer; MTP layers always run their own indexer."""
        if layer >= self.num_hidden_layers or not self.indexer_types:
            return "full"
        return self.indexer_types[layer]

    @property
    def num_full_indexer_layers(self) -> int:
        """Target layers that run an indexer pass per forward."""
        return sum(self.indexer_kind(i) == "full" for i in range(self.num_hidden_layers))

    @property
    def has_moe(self) -> bool:
        return "sparse" in self.mlp_layer_types or (
            self.num_nextn_predict_layers > 0 and self.n_routed_experts > 0
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_dim(self) -> int:
        """Width of one cached MLA row: ``[latent (C) | rope key (R)]``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def attn_scale(self) -> float:
        """MLA softmax scale, with YaRN's mscale correction when the config asks for it."""
        return self.rope.softmax_scale(self.qk_head_dim**-0.5)

    @property
    def index_scale(self) -> float:
        return self.index_head_dim**-0.5

    @property
    def num_cache_layers(self) -> int:
        """Target layers plus MTP layers: every one of them owns a KV pool layer."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def without_absent_mtp(self, tensor_names: Iterable[str] | None) -> ModelConfig:
        """This config as served from a checkpoint holding ``tensor_names`` (None: unknown, kept as
        it is): when none of them belongs to the first MTP layer (index ``num_hidden_layers``), the
        model has no MTP layer (``num_nextn_predict_layers`` 0, ``absent_mtp_layers`` the count
        config.json names). A layer present in part stays, and loading it names what is missing."""
        if self.num_nextn_predict_layers == 0 or tensor_names is None:
            return self
        prefix = f"model.layers.{self.num_hidden_layers}."
        if any(name.startswith(prefix) for name in tensor_names):
            return self
        return attrs.evolve(self, num_nextn_predict_layers=0, absent_mtp_layers=self.num_nextn_predict_layers)

    def mlp_kind(self, layer: int) -> str:
        """``"dense"`` or ``"sparse"`` for a target layer; MTP layers are MoE whenever experts exist
        (as in HF)."""
        if layer < self.num_hidden_layers:
            return self.mlp_layer_types[layer]
        return "sparse" if self.n_routed_experts > 0 else "dense"

    # ----- HF config.json -------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a config dict of a registered architecture; raises :class:`ModelConfigError` naming
        the field."""
        try:
            arch = architecture(raw.get("model_type"))
        except UnsupportedArchitecture as exc:
            raise ModelConfigError(str(exc)) from None
        try:
            rope = Rope.from_hf_dict(raw)
        except FieldError as exc:  # RopeError among them
            raise ModelConfigError(str(exc)) from None
        raw = {**arch.defaults, **{k: v for k, v in raw.items() if v is not None}}
        try:
            return cls._from_hf_dict(raw, arch, rope)
        except KeyError as exc:
            raise ModelConfigError(f"config.json lacks the field {exc.args[0]!r}") from None
        except FieldError as exc:
            raise ModelConfigError(str(exc)) from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ModelConfigError):
                raise
            raise ModelConfigError(f"config.json has a malformed field ({exc})") from None

    @classmethod
    def _from_hf_dict(cls, raw: dict[str, Any], arch: Architecture, rope: Rope) -> ModelConfig:
        if raw.get("q_lora_rank") is None:
            raise ModelConfigError("q_lora_rank is required (the DSA indexer reads the query latent)")
        if flag(raw.get("attention_bias", False), "attention_bias"):
            raise ModelConfigError("attention_bias=True is not supported")

        def size(name: str, default: int | None = None, minimum: int = 1) -> int:
            """An integer field (required without a default): a KeyError names a missing one."""
            return integer(raw[name] if default is None else raw.get(name, default), name, minimum)

        vocab_size = size("vocab_size")
        num_layers = size("num_hidden_layers")
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            dense = min(size("first_k_dense_replace", 3, minimum=0), num_layers)
            mlp_types = ["dense"] * dense + ["sparse"] * (num_layers - dense)
        mtp_name = "num_nextn_predict_layers" if "num_nextn_predict_layers" in raw else "num_mtp_layers"
        dtype_name = "dtype" if "dtype" in raw else "torch_dtype"
        eos = token_ids(raw.get("eos_token_id"), "eos_token_id", vocab_size)
        return cls(
            vocab_size=vocab_size,
            hidden_size=size("hidden_size"),
            intermediate_size=size("intermediate_size"),
            moe_intermediate_size=size("moe_intermediate_size", 0, minimum=0),
            num_hidden_layers=num_layers,
            num_attention_heads=size("num_attention_heads"),
            n_shared_experts=size("n_shared_experts", 0, minimum=0),
            n_routed_experts=size("n_routed_experts", 0, minimum=0),
            routed_scaling_factor=number(
                raw.get("routed_scaling_factor", 1.0), "routed_scaling_factor", positive=True
            ),
            kv_lora_rank=size("kv_lora_rank"),
            q_lora_rank=size("q_lora_rank"),
            qk_rope_head_dim=size("qk_rope_head_dim"),
            v_head_dim=size("v_head_dim"),
            qk_nope_head_dim=size("qk_nope_head_dim"),
            n_group=size("n_group", 1),
            topk_group=size("topk_group", 1),
            num_experts_per_tok=size("num_experts_per_tok", 0, minimum=0),
            norm_topk_prob=flag(raw.get("norm_topk_prob", True), "norm_topk_prob"),
            mlp_layer_types=strings(mlp_types, "mlp_layer_types"),
            hidden_act=string(raw.get("hidden_act", "silu"), "hidden_act"),
            max_position_embeddings=size("max_position_embeddings"),
            rms_norm_eps=number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", positive=True),
            rope_theta=rope.theta,
            index_topk=size("index_topk"),
            index_head_dim=size("index_head_dim"),
            index_n_heads=size("index_n_heads"),
            tie_word_embeddings=flag(raw.get("tie_word_embeddings", False), "tie_word_embeddings"),
            eos_token_id=eos[0] if eos else None,
            num_nextn_predict_layers=size(mtp_name, 0, minimum=0),
            dtype=string(raw.get(dtype_name, "float32"), dtype_name) or "float32",
            model_type=arch.model_type,
            rope_yarn=rope.yarn,
            indexer_types=arch.indexer_types(raw, num_layers),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` HF transformers 5.x reads as a ``DeepseekV32Config``."""
        out: dict[str, Any] = {
            "architectures": [self.arch.hf_class],
            "attention_bias": False,
            "num_key_value_heads": self.num_attention_heads,
            "first_k_dense_replace": _leading_dense(self.mlp_layer_types),
            "rope_parameters": self.rope.to_hf(),
            "bos_token_id": None,
            "pad_token_id": None,
            **self.arch.hf_extra(self),
        }
        for field in attrs.fields(ModelConfig):
            if field.name in ("rope_theta", "rope_yarn", "indexer_types", "absent_mtp_layers"):
                continue
            value = getattr(self, field.name)
            out[field.name] = list(value) if isinstance(value, tuple) else value
        return dict(sorted(out.items()))

    @classmethod
    def from_dir(cls, name_or_path: str | Path) -> ModelConfig:
        """Read ``config.json`` of a model directory; every problem is a :class:`ModelConfigError` on it.

        An MTP layer the weights lack entirely is set aside (``without_absent_mtp``; the tensor
        names come from the index or the files' headers, no weight is read)."""
        path = resolve_model_dir(name_or_path)
        raw = read_config_json(path)
        try:
            cfg = cls.from_hf_dict(raw)
            Fp8Config.from_hf_dict(raw)  # read by the loader; checked here before any weight is read
        except ModelConfigError as exc:
            if exc.value != "config.json":
                raise
            raise ModelConfigError(f"config.json: {exc.rule}", str(path)) from None
        except QuantizationError as exc:
            raise ModelConfigError(f"config.json: {exc}", str(path)) from None
        return cfg.without_absent_mtp(tensor_names(path)) if cfg.num_nextn_predict_layers else cfg


INDEX_FILE = "model.safetensors.index.json"  # HF's sharded checkpoints: tensor name -> shard file


def tensor_names(path: Path) -> list[str] | None:
    """The tensor names of a checkpoint directory, from its index file (else its safetensors files'
    headers), without reading a tensor; None when it holds no weights or they cannot be read
    (loading them then says why: ``weights.CheckpointFiles``)."""
    index = path / INDEX_FILE
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return [str(name) for name in weight_map] if isinstance(weight_map, dict) else None
        names: list[str] = []
        for file in sorted(path.glob("*.safetensors")):
            with open(file, "rb") as f:  # [u64 little-endian N][N bytes of JSON header]
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            names += [name for name in header if name != "__metadata__"]
        return names or None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return None


def read_config_json(path: Path) -> dict[str, Any]:
    """``path/config.json`` as a dict; a missing or unreadable file raises :class:`ModelConfigError`."""
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise ModelConfigError("the directory has no config.json", str(path)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"config.json is not readable JSON ({exc})", str(path)) from None
    if not isinstance(raw, dict):
        raise ModelConfigError("config.json must hold a JSON object", str(path))
    return raw


def _leading_dense(types: tuple[str, ...]) -> int:
    count = 0
    for kind in types:
        if kind != "dense":
            break
        count += 1
    return count
