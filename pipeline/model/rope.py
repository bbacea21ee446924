"""RoPE parameters of a checkpoint: plain RoPE or YaRN, computed exactly as HF transformers 5.24 does.

YaRN (``rope_type: yarn``) stretches the low frequencies of a model trained on
``original_max_position_embeddings`` positions by ``factor`` and keeps the high ones:

    pos_freq[i]   = theta ** (2i / R)                              i = 0 .. R/2 - 1   (float32)
    ramp[i]       = clamp((i - low) / (high - low), 0, 1)          low/high from beta_fast / beta_slow
    inv_freq[i]   = 1 / (factor * pos_freq[i]) * ramp[i] + 1 / pos_freq[i] * (1 - ramp[i])

Two scale corrections come with it, and DeepSeek-style models apply both:

* ``attention_factor`` multiplies cos and sin (so the rotated query/key channels of attention and of
  the indexer): ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else
  ``mscale(factor, 1)``, where ``mscale(s, m) = 0.1 m ln(s) + 1`` (1 for ``s <= 1``);
* the MLA softmax scale is multiplied by ``mscale(factor, mscale_all_dim) ** 2`` when
  ``mscale_all_dim`` is set (the indexer's own scale is left alone).

Any other ``rope_type`` is refused, and so is a value of the wrong JSON type or out of range (a
``theta`` or ``factor`` that is not a finite number > 0, say), naming the field.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
from torch import Tensor

from pipeline.model.fields import FieldError, flag, integer, number

SUPPORTED_ROPE_TYPES = ("default", "yarn")


class RopeError(FieldError):
    """A RoPE setting hispec does not implement or cannot read; the message names the field."""


def _mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@attrs.frozen
class Yarn:
    """The YaRN parameters of ``rope_parameters`` (HF's names and defaults)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # None: derived from factor / mscale / mscale_all_dim
    truncate: bool = True

    def cos_sin_factor(self) -> float:
        """What HF multiplies cos and sin by (its ``attention_scaling``)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(_mscale(self.factor, self.mscale) / _mscale(self.factor, self.mscale_all_dim))
        return _mscale(self.factor)

    def softmax_scale(self, scale: float) -> float:
        """DeepSeek's correction of the MLA softmax scale (HF's ``yarn_apply_mscale``)."""
        if self.mscale_all_dim:
            m = _mscale(self.factor, self.mscale_all_dim)
            scale = scale * m * m
        return scale

    def inv_freq(self, dim: int, theta: float) -> Tensor:  # [dim/2] float32
        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(theta)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as HF: avoid a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        keep = 1 - ramp  # share of the original (extrapolated) frequency
        return interpolation * (1 - keep) + extrapolation * keep

    def to_hf(self) -> dict[str, Any]:
        out = {"rope_type": "yarn", **attrs.asdict(self)}
        return {k: v for k, v in out.items() if v is not None}


@attrs.frozen
class Rope:
    """``theta`` and, for YaRN, its parameters; ``yarn is None`` = plain RoPE."""

    theta: float
    yarn: Yarn | None = None

    def inv_freq(self, dim: int) -> Tensor:  # [dim/2] float32
        if self.yarn is not None:
            return self.yarn.inv_freq(dim, self.theta)
        return 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def cos_sin_factor(self) -> float:
        return 1.0 if self.yarn is None else self.yarn.cos_sin_factor()

    def softmax_scale(self, scale: float) -> float:
        return scale if self.yarn is None else self.yarn.softmax_scale(scale)

    def to_hf(self) -> dict[str, Any]:
        if self.yarn is None:
            return {"rope_theta": self.theta, "rope_type": "default"}
        return {"rope_theta": self.theta, **self.yarn.to_hf()}

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> Rope:
        """Read ``rope_parameters`` (HF 5.x) or ``rope_scaling`` + ``rope_theta`` (the older spelling)."""
        key = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
        params = raw.get(key) or {}
        if not isinstance(params, dict):
            raise RopeError(f"{key} must be an object, got {type(params).__name__}")
        params = {k: v for k, v in params.items() if v is not None}  # null counts as absent
        if "rope_theta" in params:
            theta = number(params["rope_theta"], f"{key}.rope_theta", positive=True)
        else:
            top = raw.get("rope_theta")
            theta = number(10000.0 if top is None else top, "rope_theta", positive=True)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            return cls(theta=theta)
        if rope_type != "yarn":
            raise RopeError(
                f"{key}.rope_type {rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        max_pos = raw.get("max_position_embeddings")
        # as HF: a top-level original_max_position_embeddings wins over the one in the rope dict
        if raw.get("original_max_position_embeddings") is not None:
            original = integer(raw["original_max_position_embeddings"], "original_max_position_embeddings")
        elif "original_max_position_embeddings" in params:
            original = integer(
                params["original_max_position_embeddings"], f"{key}.original_max_position_embeddings"
            )
        elif max_pos is not None:
            original = integer(max_pos, "max_position_embeddings")
        else:
            raise RopeError(f"{key}.original_max_position_embeddings is required for yarn")
        if "factor" in params:
            factor = number(params["factor"], f"{key}.factor", positive=True)
        elif max_pos is None:
            raise RopeError(f"{key}.factor is required for yarn")
        else:
            factor = integer(max_pos, "max_position_embeddings") / original

        def opt(name: str, default: float | None = None, *, positive: bool = False) -> float | None:
            value = params.get(name)
            return default if value is None else number(value, f"{key}.{name}", positive=positive)

        return cls(
            theta=theta,
            yarn=Yarn(
                factor=factor,
                original_max_position_embeddings=original,
                beta_fast=opt("beta_fast") or 32.0,
                beta_slow=opt("beta_slow") or 1.0,
                mscale=opt("mscale"),
                mscale_all_dim=opt("mscale_all_dim"),
                attention_factor=opt("attention_factor", positive=True),
                truncate=flag(params.get("truncate", True), f"{key}.truncate"),
            ),
        )
