"""KV row copies on a CPU as a compiled loop (contract: ``kernels.kv_copy``), with numba.

A copy of a few hundred rows (a decode step's swap-in misses, its backups) costs torch a gather and
a scatter per layer, each paying a call's dispatch overhead on a CPU; the loop here moves each
row's bits where it lies, after checking every index against its pool (an index out of range raises
``IndexError`` before anything is written, as torch's gather refuses it). The rows are read as
integers of the element's size, so every float type (bfloat16 and float16 included) is copied
exactly. ``copy_rows(impl="auto")`` takes this path when every tensor is in CPU memory and the two
pools share one element type.
"""

from __future__ import annotations

import numba
import torch

# the integer type of each element size: a row copy moves bits, whatever the float type
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _kernel(src, dst, src_rows, dst_rows):  # pragma: no cover - compiled
    for i in range(src_rows.shape[0]):  # every index in range before anything is written, as torch's
        if not (0 <= src_rows[i] < src.shape[1] and 0 <= dst_rows[i] < dst.shape[1]):
            raise IndexError("kv row copy: an index is out of range of its pool")
    for layer in range(src.shape[0]):
        for i in range(src_rows.shape[0]):
            s = src_rows[i]
            d = dst_rows[i]
            for j in range(src.shape[2]):
                dst[layer, d, j] = src[layer, s, j]


_compiled = None


def fits(dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor) -> bool:
    """This implementation takes the call: every tensor in CPU memory, one
    element type of a size it reads as integers (arguments already checked by ``copy_rows``)."""
    return (
        dst.device.type == src.device.type == dst_idx.device.type == src_idx.device.type == "cpu"
        and src.dtype == dst.dtype
        and dst.element_size() in _BITS
    )


def copy_rows_numba(
    dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
) -> None:
    """``dst[..., dst_idx, :] = src[..., src_idx, :]`` by the compiled loop (the tensors must ``fits``)."""
    global _compiled
    if _compiled is None:
        _compiled = numba.njit(cache=True, nogil=True)(_kernel)
    bits = _BITS[dst.element_size()]
    if dst.dim() == 2:
        dst, src = dst[None], src[None]
    _compiled(src.view(bits).numpy(), dst.view(bits).numpy(), src_idx.numpy(), dst_idx.numpy())


def warm_up() -> None:
    """Compile (or load from numba's disk cache) the loop for float32 pools and int64 indices."""
    copy_rows_numba(
        torch.zeros(2, 1),
        torch.ones(1, dtype=torch.int64),
        torch.zeros(2, 1),
        torch.zeros(1, dtype=torch.int64),
    )
