"""Small building blocks: the wide dtype rule, RMSNorm, RoPE, and the dense MLP.

Precision rule: where HF transformers computes in float32 whatever the model dtype (RMSNorm, the MoE
router, the indexer scores and weights, the softmax), hispec computes in ``wide_dtype(dtype)`` =
max(float32, dtype). For float32, bfloat16 and float16 models that is exactly HF's float32; a float64
model stays float64 throughout, so float64 tests can demand near bit-exact agreement.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import small_ops_numba


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every narrower float computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, the normalisation done in the wide dtype, then cast back (as HF)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # the compiled loop's handle on the weight (``small_ops_numba.CompiledNorm``), made at the
        # first call without a gradient, made again when the weight is replaced or moved
        self._compiled: small_ops_numba.CompiledNorm | None = None

    def __getstate__(self) -> dict:
        # a copy (deepcopy, pickle) makes its own handle on its own weight
        return {**super().__getstate__(), "_compiled": None}

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            weight, compiled = self.weight, getattr(self, "_compiled", None)
            if compiled is None or not compiled.current(weight):
                compiled = self._compiled = small_ops_numba.CompiledNorm(weight, self.eps)
            if compiled.takes(x):  # a CPU: one compiled loop, the same values to rounding
                return compiled(x)
        in_dtype = x.dtype
        if in_dtype == wide_dtype(in_dtype) and self.weight.dtype == in_dtype and not torch.is_grad_enabled():
            return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # the same values, one call
        xw = x.to(wide_dtype(in_dtype))
        xw = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xw.to(in_dtype)


class DenseMLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``; also the shape of one shared expert."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ----- RoPE -----------------------------------------------------------------------------------------
#
# Angles follow HF exactly: inv_freq and position * inv_freq are float32 whatever the model dtype, the
# cos/sin are taken in float32 and only then cast to the activations' dtype. MLA rotates its rope
# channels as interleaved pairs (x0, x1), (x2, x3), ... and writes the result de-interleaved
# ([even rotated | odd rotated], HF's layout, kept in the cache); the DeepSeek-V3.2 indexer rotates
# half-split pairs (x_i, x_{i + R/2}), the GLM-5 indexer interleaved pairs as MLA does.


def rope_inv_freq(rope_dim: int, theta: float) -> Tensor:  # [R/2] float32
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))


def rope_cos_sin(
    positions: Tensor, inv_freq: Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[Tensor, Tensor]:
    """``positions [...]`` -> ``(cos, sin)`` each ``[..., R]`` (the R/2 angles twice, HF's layout).

    ``scale`` multiplies both in float32 before the cast (YaRN's attention factor; 1 otherwise).
    """
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(device=positions.device, dtype=torch.float32)
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """MLA rope. ``x [..., heads, R]``, ``cos/sin [..., R]`` (broadcast over heads)."""
    half = cos.shape[-1] // 2
    c = cos[..., None, :half]
    s = sin[..., None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * c - odd * s, odd * c + even * s], dim=-1)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_half_split(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Indexer rope. ``x [..., heads, R]``, ``cos/sin [..., R]`` (broadcast over heads)."""
    c = cos[..., None, :]
    s = sin[..., None, :]
    return x * c + _rotate_half(x) * s
