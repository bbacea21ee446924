"""RMSNorm and the RoPE rotation on a CPU as compiled loops, with numba.

A decode step of a small model normalises and rotates a few vectors per layer. ``torch.rms_norm`` on a
CPU is a composite of half a dozen tensor calls, and the rotation is five (a de-interleave copy, two
products, a roll, a sum): for a few rows their dispatch costs more than the loops here
(docs/performance-notes.md). Both loops compute what the torch ops compute:

* ``rms_norm``: ``weight * (x * (1 / sqrt(mean(x * x) + eps)))`` per row, in the tensors' dtype
  (float32 or float64, as the wide-dtype RMSNorm does); the sum of squares runs in the order the
  compiler vectorises it, so the result agrees with ``torch.rms_norm``'s to rounding.
* ``rotate``: ``y = x' * cos + roll(x', R/2) * sin'`` with ``x'`` the channels, de-interleaved
  (``[even | odd]``) first when ``interleaved``, and ``sin' = [-sin | sin]`` (``pipeline.model.fused``'s
  ``_RopeTables``): each element the same two products and one sum, no contraction into a fused
  multiply-add, so the bits equal the torch ops'.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

DTYPES = (torch.float32, torch.float64)


def _jit(**options):
    return numba.njit(cache=True, nogil=True, **options)


@_jit(fastmath={"reassoc", "nsz"})
def _rms_norm(x, weight, eps, size, out):  # pragma: no cover - compiled
    rows, dim = x.shape
    zero = eps - eps
    one = eps / eps  # constants of the tensors' dtype (a literal would be float64)
    for i in range(rows):
        total = zero
        for j in range(dim):
            total += x[i, j] * x[i, j]
        scale = one / np.sqrt(total / size + eps)
        for j in range(dim):
            out[i, j] = weight[j] * (x[i, j] * scale)


@_jit()
def _rotate(x, cos, sin, interleaved, out):  # pragma: no cover - compiled
    tokens, heads, dim = x.shape
    half = dim // 2
    src = np.empty(dim, x.dtype)
    for t in range(tokens):
        for h in range(heads):
            if interleaved:
                for i in range(half):
                    src[i] = x[t, h, 2 * i]
                    src[half + i] = x[t, h, 2 * i + 1]
            else:
                for i in range(dim):
                    src[i] = x[t, h, i]
            for i in range(half):
                out[t, h, i] = src[i] * cos[t, i] + src[i + half] * sin[t, i]
            for i in range(half, dim):
                out[t, h, i] = src[i] * cos[t, i] + src[i - half] * sin[t, i]


def fits(*tensors: torch.Tensor) -> bool:
    """The loops take the call: CPU tensors of one float32/64 dtype. They record
    no gradient: callers use them only where none is recorded."""
    first = tensors[0]
    return (
        first.dtype in DTYPES
        and all(t.device.type == "cpu" and t.dtype == first.dtype for t in tensors)
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., D]`` normalised over its last dimension and scaled by ``weight [D]`` (``fits``)."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"weight: shape {tuple(weight.shape)} does not match x's last dimension {x.shape[-1]}"
        )
    return CompiledNorm(weight, eps)(x)


class CompiledNorm:
    """``rms_norm`` for one weight, its numpy view and constants taken once: a decode step of a
    small model normalises a few vectors per layer, and the wrapper's per-call conversions cost
    many times the loop for one row (docs/performance-notes.md). The same loop on the same
    arrays, so the same bits as ``rms_norm``. ``current(weight)`` says whether it still reads that
    weight's memory (a replaced parameter, or one re-pointed, needs a new one)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight = weight
        self.ptr = weight.data_ptr()
        self.dtype = weight.dtype
        self.dim = weight.shape[-1]
        # the loop takes this weight (``fits``, one dimension); where it does not, the handle still
        # remembers the weight, so that the question is asked again only when the weight changes
        self.usable = weight.dim() == 1 and fits(weight)
        if self.usable:
            self._w = weight.detach().numpy()
            wide = np.float64 if weight.dtype == torch.float64 else np.float32
            self._eps, self._size = wide(eps), wide(weight.shape[0])

    def current(self, weight: torch.Tensor) -> bool:
        return weight is self.weight and weight.data_ptr() == self.ptr

    def takes(self, x: torch.Tensor) -> bool:
        """``x`` is a CPU tensor of the weight's dtype whose last dimension is the weight's."""
        return self.usable and x.dtype == self.dtype and x.is_cpu and x.shape[-1] == self.dim

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``rms_norm(x, weight, eps)`` for an ``x`` the norm ``takes``, without a gradient."""
        two = x.dim() == 2
        flat = x.detach().numpy() if two else x.detach().reshape(-1, self.dim).numpy()
        out = np.empty(flat.shape, flat.dtype)
        if flat.shape[0]:
            _rms_norm(flat, self._w, self._eps, self._size, out)
        result = torch.from_numpy(out)
        return result if two else result.view(x.shape)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x [T, heads, R]`` rotated by ``cos, sin [T, R]`` (``sin`` signed ``[-s | s]``), de-interleaved
    first when ``interleaved``; a new contiguous tensor (``fits``)."""
    table = (x.shape[0], x.shape[-1])
    if x.dim() != 3 or x.shape[-1] % 2 or cos.shape != table or sin.shape != table:
        raise ValueError(
            f"cos, sin: shapes {tuple(cos.shape)}, {tuple(sin.shape)} do not fit x {tuple(x.shape)}"
        )
    return rotate_with_tables(x, cos.detach().numpy(), sin.detach().numpy(), interleaved)


def rotate_with_tables(x: torch.Tensor, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> torch.Tensor:
    """``rotate`` over tables already in numpy form (``cos``, ``sin`` ``[T, R]`` of ``x``'s dtype),
    without its checks: for a caller that checked ``x`` against them (a forward's rope tables, built
    once for all its layers). The same loop on the same arrays, so the same bits."""
    values = x.detach().numpy()
    out = np.empty(values.shape, values.dtype)
    if x.numel():
        _rotate(values, cos, sin, interleaved, out)
    return torch.from_numpy(out)


def warm_up(dtype: torch.dtype = torch.float32) -> None:
    """Compile (or load from numba's disk cache) both loops for ``dtype``, for contiguous inputs and
    for the strided views the fused layer hands them."""
    if dtype not in DTYPES:
        return
    base = torch.ones(2, 4, dtype=dtype)
    weight = torch.ones(2, dtype=dtype)
    rms_norm(base[:, :2].contiguous(), weight, 1e-6)
    rms_norm(base[:, :2], weight, 1e-6)
    table = torch.ones(2, 2, dtype=dtype)
    for interleaved in (False, True):
        rotate(torch.ones(2, 1, 2, dtype=dtype), table, table, interleaved)
        rotate(torch.ones(2, 2, 2, dtype=dtype)[:, :1], table, table, interleaved)
