"""Triton row copy (contract: ``kernels.kv_copy``); imported only when a Triton path is taken.

Grid ``(cdiv(n, BLOCK_R), L)``: a program copies ``BLOCK_R`` rows of one layer, ``BLOCK_D`` columns
at a time. Pairs with a negative index are skipped, which lets swap-in hand over its copy plan
(``-1`` where an entry loads nothing) without compacting it first; the public wrapper never passes
negative indices. Either pool may be pinned host memory (``kernels.kv_copy.copy_rows_mapped``
decides): the kernel then loads or stores its rows through the device address the driver maps
them at, and the index tensors must be on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import next_power_of_2


@triton.jit
def _copy_rows_kernel(
    dst_ptr, dst_idx_ptr, src_ptr, src_idx_ptr, n,
    dst_stride_l, dst_stride_r, src_stride_l, src_stride_r,
    DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    layer = tl.program_id(1).to(tl.int64)  # layer * stride can pass 2**31
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = r < n
    di = tl.load(dst_idx_ptr + r, mask=in_range, other=-1).to(tl.int64)
    si = tl.load(src_idx_ptr + r, mask=in_range, other=-1).to(tl.int64)
    ok = in_range & (di >= 0) & (si >= 0)
    dst_row = dst_ptr + layer * dst_stride_l + di * dst_stride_r  # [BLOCK_R] pointers
    src_row = src_ptr + layer * src_stride_l + si * src_stride_r
    for d0 in range(0, DIM, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = ok[:, None] & (d < DIM)[None, :]
        vals = tl.load(src_row[:, None] + d[None, :], mask=m)
        tl.store(dst_row[:, None] + d[None, :], vals, mask=m)


def copy_rows_triton(
    dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
) -> None:
    """Launch the copy; ``dst``/``src`` are ``[rows, dim]`` or ``[L, rows, dim]`` (checked by the caller)."""
    n = dst_idx.shape[0]
    if n == 0:
        return
    dst3 = dst if dst.dim() == 3 else dst.unsqueeze(0)
    src3 = src if src.dim() == 3 else src.unsqueeze(0)
    dim = dst3.shape[-1]
    block_d = min(next_power_of_2(dim), 256)
    block_r = max(1, min(64, 2048 // block_d, next_power_of_2(n)))
    grid = (triton.cdiv(n, block_r), dst3.shape[0])
    _copy_rows_kernel[grid](
        dst3,
        dst_idx.contiguous(),
        src3,
        src_idx.contiguous(),
        n,
        dst3.stride(0),
        dst3.stride(1),
        src3.stride(0),
        src3.stride(1),
        DIM=dim,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
