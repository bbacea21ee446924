"""FP8 block-quantized checkpoints (``quantization_config.quant_method: fp8``), dequantized at load.

DeepSeek-V3.x and GLM-5 FP8 checkpoints store a linear weight ``W [rows, cols]`` as
``float8_e4m3fn`` plus ``weight_scale_inv [ceil(rows / bm), ceil(cols / bn)]``, one float per
``bm x bn`` block (``weight_block_size``, [128, 128] in practice; the last blocks may be partial):

    W[r, c] = float32(W_fp8[r, c]) * float32(weight_scale_inv[r // bm, c // bn])

The product is taken in float32 and then cast to the run dtype, exactly as HF transformers 5.24
dequantizes (so the weights are bit-for-bit HF's). It is done one row of blocks at a time, so the
float32 temporaries are ``bm x cols``, never a whole tensor, let alone the checkpoint. Tensors
without a ``weight_scale_inv`` sibling (embeddings, norms, router, head) are stored unquantized.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import Tensor

from pipeline.model.fields import is_integer

SUPPORTED_QUANT_METHODS = ("fp8",)
FP8_DTYPES = (torch.float8_e4m3fn,)


class QuantizationError(ValueError):
    """A quantization setting or tensor hispec cannot load; the message names the field."""


@attrs.frozen
class Fp8Config:
    """What the loader needs of ``quantization_config``."""

    # (bm, bn) rows x columns of a scale block; None = one scale per tensor
    block: tuple[int, int] | None

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> Fp8Config | None:
        """``config.json`` -> the FP8 settings, None for an unquantized checkpoint."""
        q = raw.get("quantization_config")
        if q is None:
            return None
        if not isinstance(q, dict):
            raise QuantizationError("quantization_config must be an object")
        method = q.get("quant_method")
        if method not in SUPPORTED_QUANT_METHODS:
            raise QuantizationError(
                f"quantization_config.quant_method {method!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_QUANT_METHODS)})"
            )
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantizationError(f"quantization_config.fmt {fmt!r} is not supported (supported: e4m3)")
        block = q.get("weight_block_size")
        if block is None:
            return cls(block=None)
        if not (
            isinstance(block, list | tuple)
            and len(block) == 2
            and all(is_integer(b) and b > 0 for b in block)
        ):
            raise QuantizationError(
                f"quantization_config.weight_block_size must be two positive ints, got {block!r}"
            )
        return cls(block=(int(block[0]), int(block[1])))

    def grid(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """Scale rows and columns for a weight of ``shape [..., rows, cols]``."""
        rows, cols = shape[-2:]
        if self.block is None:
            return 1, 1
        bm, bn = self.block
        return -(-rows // bm), -(-cols // bn)


def dequantize_into(dest: Tensor, weight: Tensor, scale_inv: Tensor, cfg: Fp8Config, name: str) -> None:
    """``dest [..., rows, cols] = weight * scale_inv`` blockwise (float32 product, cast to ``dest.dtype``).

    ``weight`` is ``float8_e4m3fn [..., rows, cols]``, ``scale_inv [..., grid_rows, grid_cols]``
    (or a single scale when the config has no block size). Raises :class:`QuantizationError` naming
    ``name`` when dtypes or shapes disagree.
    """
    if weight.dtype not in FP8_DTYPES:
        raise QuantizationError(f"{name} has a weight_scale_inv but is {weight.dtype}, not float8_e4m3fn")
    if weight.ndim < 2 or tuple(dest.shape) != tuple(weight.shape):
        raise QuantizationError(
            f"{name} has shape {list(weight.shape)}, the config implies {list(dest.shape)}"
        )
    rows, cols = weight.shape[-2:]
    grid = cfg.grid(tuple(weight.shape))
    scale = scale_inv.to(torch.float32)
    if cfg.block is None and scale.numel() == 1:
        scale = scale.reshape(1, 1)
    lead = tuple(weight.shape[:-2])
    if tuple(scale.shape) != (*lead, *grid):
        raise QuantizationError(
            f"{name.removesuffix('weight')}weight_scale_inv has shape {list(scale_inv.shape)}, "
            f"expected {[*lead, *grid]} for a {list(weight.shape)} weight"
        )
    bm = rows if cfg.block is None else cfg.block[0]
    bn = cols if cfg.block is None else cfg.block[1]
    for i in range(grid[0]):
        r0, r1 = i * bm, min(rows, (i + 1) * bm)
        block_rows = weight[..., r0:r1, :].to(torch.float32)  # [..., <=bm, cols]
        col_scale = scale[..., i, :].repeat_interleave(bn, dim=-1)[..., :cols]  # [..., cols]
        dest[..., r0:r1, :].copy_(block_rows * col_scale[..., None, :])
