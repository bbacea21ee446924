"""KV row movement: one primitive, four uses.

    dst[..., dst_idx[i], :] = src[..., src_idx[i], :]     for every i

over one layer (``[rows, dim]``) or every layer at once (``[L, rows, dim]``, the same rows of each
layer). The four movements of the cache are thin names for it:

=================  =========================================  ==================================
movement           call                                       used for
=================  =========================================  ==================================
scatter new rows   ``scatter_rows(pool, slots, rows)``        a forward's fresh KV into the pool
host -> device     ``load_rows(device, d_slots, host, h)``    staging reuse, explicit reloads
device -> host     ``backup_rows(host, h_slots, device, d)``  prefill staging, finalize backups
device -> device   ``move_rows(kv, dst_slots, src_slots)``    last accepted token -> newest column
=================  =========================================  ==================================

Destinations must be distinct (otherwise the result would depend on the copy order), and when source
and destination are the same tensor the two index sets must be disjoint for the same reason. The
wrapper checks both and the index ranges (``validate=True``, the default; it synchronises on CUDA).
The Triton kernel runs when every tensor is on CUDA; a copy between host and device memory goes
through torch (a Triton kernel cannot address host memory); a copy in CPU memory between pools of
one element type runs a compiled loop over the rows' bits (``kernels.kv_copy_numba``).
"""

from __future__ import annotations

import torch

from kernels.checks import check_index_range, check_tensor, check_unique, resolve_impl

INDEX_DTYPES = (torch.int32, torch.int64)


def copy_rows_reference(
    dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
) -> None:
    """Plain torch: a gather and a scatter per layer (crosses devices when ``src`` and ``dst`` differ).

    ``index_select`` / ``index_copy_`` on one layer's ``[rows, dim]``: on a CPU they beat advanced
    indexing and the same calls along dim 1 of ``[L, rows, dim]`` (docs/performance-notes.md).
    """
    si, di = src_idx.to(src.device).long(), dst_idx.to(dst.device).long()
    # Non-blocking only towards a device: the host-side index_copy_ below would read a non-blocking
    # device->host copy before it has landed (torch returns at once into pinned memory).
    non_blocking = dst.device.type != "cpu"
    pairs = zip(src, dst) if dst.dim() == 3 else [(src, dst)]
    for src_layer, dst_layer in pairs:
        dst_layer.index_copy_(0, di, src_layer.index_select(0, si).to(dst.device, non_blocking=non_blocking))


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def check_copy_args(dst, dst_idx, src, src_idx, *, validate: bool) -> None:
    """Shapes, dtypes and strides always; index values when ``validate``."""
    check_tensor("dst", dst, ndim=(2, 3), contiguous_last=True)
    check_tensor("src", src, ndim=dst.dim(), dtype=dst.dtype, contiguous_last=True)
    if src.shape[-1] != dst.shape[-1] or (dst.dim() == 3 and src.shape[0] != dst.shape[0]):
        raise ValueError(
            f"src shape {tuple(src.shape)} does not match dst shape {tuple(dst.shape)} "
            "(same row width, and the same number of layers)"
        )
    check_tensor("dst_idx", dst_idx, ndim=1, dtype=INDEX_DTYPES)
    check_tensor("src_idx", src_idx, ndim=1, dtype=INDEX_DTYPES, shape=(dst_idx.shape[0],))
    if not validate:
        return
    check_index_range("dst_idx", dst_idx, dst.shape[-2])
    check_index_range("src_idx", src_idx, src.shape[-2])
    check_unique("dst_idx", dst_idx)
    if _shares_memory(dst, src):
        both = torch.cat([dst_idx.long(), src_idx.to(dst_idx.device).long()])
        if torch.unique(both).numel() != both.numel():
            raise ValueError("dst_idx and src_idx must be disjoint when src and dst are the same tensor")


def copy_rows(
    dst: torch.Tensor,  # [rows, dim] or [L, rows, dim], mutated
    dst_idx: torch.Tensor,  # [n] int32/int64, distinct
    src: torch.Tensor,  # [rows', dim] or [L, rows', dim], same dtype
    src_idx: torch.Tensor,  # [n] int32/int64
    *,
    impl: str = "auto",
    validate: bool = True,
) -> None:
    """``dst[..., dst_idx, :] = src[..., src_idx, :]`` (module docstring for the rules)."""
    check_copy_args(dst, dst_idx, src, src_idx, validate=validate)
    copy_rows_unchecked(dst, dst_idx, src, src_idx, impl=impl)


def copy_rows_unchecked(
    dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor, *, impl: str = "auto"
) -> None:
    """``copy_rows`` without the argument checks: for callers that built every argument themselves
    (a swap-in's misses), where the checks are per-call overhead only. ``impl="auto"`` on CPU
    tensors of one element type runs the compiled loop (``kernels.kv_copy_numba``)."""
    if dst_idx.numel() == 0:
        return
    if impl == "auto":
        from kernels import kv_copy_numba

        if kv_copy_numba.fits(dst, dst_idx, src, src_idx):
            kv_copy_numba.copy_rows_numba(dst, dst_idx, src, src_idx)
            return
    if resolve_impl(impl, (dst, dst_idx, src, src_idx)) == "triton":
        from kernels.kv_copy_triton import copy_rows_triton

        copy_rows_triton(dst, dst_idx, src, src_idx)
    else:
        copy_rows_reference(dst, dst_idx, src, src_idx)


def scatter_rows(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, **kw) -> None:
    """Write fresh rows (``rows [n, dim]`` or ``[L, n, dim]``) into ``pool`` at ``slots [n]``."""
    src_idx = torch.arange(slots.shape[0], device=slots.device, dtype=slots.dtype)
    copy_rows(pool, slots, rows, src_idx, **kw)


def load_rows(
    device_kv: torch.Tensor, device_slots: torch.Tensor, host_kv: torch.Tensor, host_slots: torch.Tensor, **kw
) -> None:
    """Host -> device: ``device_kv[..., device_slots, :] = host_kv[..., host_slots, :]``."""
    copy_rows(device_kv, device_slots, host_kv, host_slots, **kw)


def backup_rows(
    host_kv: torch.Tensor, host_slots: torch.Tensor, device_kv: torch.Tensor, device_slots: torch.Tensor, **kw
) -> None:
    """Device -> host: ``host_kv[..., host_slots, :] = device_kv[..., device_slots, :]``."""
    copy_rows(host_kv, host_slots, device_kv, device_slots, **kw)


def move_rows(kv: torch.Tensor, dst_slots: torch.Tensor, src_slots: torch.Tensor, **kw) -> None:
    """Device -> device within one pool (disjoint source and destination slots)."""
    copy_rows(kv, dst_slots, kv, src_slots, **kw)
