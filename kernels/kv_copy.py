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
The Triton kernel runs when every tensor is on CUDA, and for a copy between a CUDA pool and host
memory the device addresses (``host_addressable``: page-locked memory is mapped into the device's
address space, at the same address, under unified addressing): the kernel then reads or writes the
host rows itself, on the current stream, and the call returns before the copy has run. A copy with
pageable host memory goes through torch, which waits for the stream (a blocking copy and a gather
or scatter on the CPU), as does every such copy once a launch addressing host memory has failed
(logged once). A copy in CPU memory between pools of one element type runs a compiled loop over
the rows' bits (``kernels.kv_copy_numba``).
"""

from __future__ import annotations

import structlog
import torch

from kernels.checks import check_index_range, check_tensor, check_unique, resolve_impl, triton_available

INDEX_DTYPES = (torch.int32, torch.int64)

log = structlog.get_logger("hispec.kernels")

# The first failure of a launch that addresses host memory, if any: from then on every copy with
# host memory goes through torch (one warning, not one per copy).
_host_launch_failure: str | None = None


def copy_rows_reference(
    dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
) -> None:
    """Plain torch: a gather and a scatter per layer (crosses devices when ``src`` and ``dst`` differ).

    ``index_select`` / ``index_copy_`` on one layer's ``[rows, dim]``: on a CPU they beat advanced
    indexing and the same calls along dim 1 of ``[L, rows, dim]`` (docs/performance-notes.md).
    """
    if src.device.type == "cpu" and dst.is_cuda:
        # host rows gathered on the CPU: first the device work queued before this copy, which may
        # include a copy writing them that the caller ordered on the stream (``order_after``)
        torch.cuda.current_stream(dst.device).synchronize()
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
    tensors of one element type runs the compiled loop (``kernels.kv_copy_numba``), and between a
    CUDA pool and pinned host memory the kernel addressing the host rows (``mapped_copy``)."""
    if dst_idx.numel() == 0:
        return
    if impl == "auto":
        from kernels import kv_copy_numba

        if kv_copy_numba.fits(dst, dst_idx, src, src_idx):
            kv_copy_numba.copy_rows_numba(dst, dst_idx, src, src_idx)
            return
        if mapped_copy(dst, src) and copy_rows_mapped(dst, dst_idx, src, src_idx):
            return
    if resolve_impl(impl, (dst, dst_idx, src, src_idx)) == "triton":
        from kernels.kv_copy_triton import copy_rows_triton

        copy_rows_triton(dst, dst_idx, src, src_idx)
    else:
        copy_rows_reference(dst, dst_idx, src, src_idx)


def host_addressable(t: torch.Tensor) -> bool:
    """Whether ``t`` is host memory that a kernel on the CUDA device can address: page-locked
    memory of a CUDA build (torch's pinned allocations are mapped into the device's address space
    at the same address under unified addressing, so Triton's launcher accepts their pointers)."""
    return t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned()


def mapped_copy(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``impl="auto"`` runs a copy between ``dst`` and ``src`` as the Triton kernel
    addressing the host side directly: one side on CUDA, the other ``host_addressable``, Triton
    installed, and no launch addressing host memory has failed in this process."""
    crosses = (dst.is_cuda and host_addressable(src)) or (src.is_cuda and host_addressable(dst))
    return crosses and _host_launch_failure is None and triton_available()


def host_launch_failure() -> str | None:
    """Why copies with host memory go through torch, when a launch addressing it has failed."""
    return _host_launch_failure


def _index_on(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``idx`` on ``device``. From host memory through a pinned block of its own: the copy is then
    asynchronous (from pageable memory the CPU would wait for the stream), the caller may reuse
    ``idx`` at once, and torch keeps the block until the copy has run."""
    if idx.device == device:
        return idx.contiguous()
    block = torch.empty(idx.shape, dtype=idx.dtype, pin_memory=True)
    block.copy_(idx)
    return block.to(device, non_blocking=True)


def copy_rows_mapped(
    dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
) -> bool:
    """The Triton copy between device memory and ``host_addressable`` host memory, queued on the
    current stream (the CPU does not wait); index pairs with a negative index are skipped. False,
    with no row copied, when it cannot be launched (no Triton, or the launch failed: the first
    failure is logged and turns this path off for the process); the caller then copies by torch.

    Until the stream has run the copy, the host rows it writes are not there yet and the ones it
    reads must not change: a CPU reader or writer of those rows waits for the stream first."""
    global _host_launch_failure
    if _host_launch_failure is not None or not triton_available():
        return False
    device = dst.device if dst.is_cuda else src.device
    try:
        from kernels.kv_copy_triton import copy_rows_triton

        copy_rows_triton(dst, _index_on(dst_idx, device), src, _index_on(src_idx, device))
    except Exception as exc:  # a launch error must not fail the copy: torch can still make it
        _host_launch_failure = f"{type(exc).__name__}: {exc}"
        log.warning(
            "kernels.kv_copy_host_fallback",
            error=_host_launch_failure,
            dst=f"{dst.device} {dst.dtype}",
            src=f"{src.device} {src.dtype}",
        )
        return False
    return True


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
