"""Sparse MLA attention in the absorbed form (decode, verify and prefill).

Every cached row of a layer is ``[latent (C) | rope key (R)]``: the normalised KV latent and the
rotated shared rope key of one token. A query head attends over the rows named by ``slots``:

    logit[t, h, i] = (q_latent[t, h] . row[i, :C] + q_rope[t, h] . row[i, C:]) * scale
    out[t, h]      = sum_i softmax_i(logit[t, h, :]) * row[i, :C]

Entries of ``slots`` equal to -1 are masked out. The output stays in latent space; the model applies
the value up-projection (W_UV) and the output projection. Decode, verify and prefill differ only in
how many query rows there are and which slots each row names (swap-in's output for decode/verify,
the causal window for prefill), so one op serves all three.

Numerics: logits, softmax and the weighted sum are computed in float32 (float64 for float64 inputs)
and the result is cast back to ``q_latent.dtype``. A query whose slots are all -1 yields zeros.

An FP8 cache (``kv`` of ``uint8``, rows in ``kernels.kv_fp8``'s layout) is read by
``kernels.sparse_mla_fp8_triton`` on CUDA (and for ``impl="triton"``), which dequantizes the rows in
registers, and by the torch path otherwise (``auto`` on a CPU): each chunk's gathered rows are
dequantized there, in the compute dtype, before the two matmuls.
"""

from __future__ import annotations

import torch

from kernels import kv_fp8
from kernels.checks import (
    FLOAT_DTYPES,
    check_index_range,
    check_same_device,
    check_tensor,
    resolve_impl,
    triton_available,
)
from kernels.indexer_topk import score_dtype

TRITON_MAX_LATENT = 1024  # C: one [16, C] float32 accumulator per program
TRITON_MAX_ROPE = 256  # R
_GATHER_BUDGET = 1 << 21  # elements of gathered rows per reference chunk (8 MiB of float32: reused, cached)


def sparse_mla_reference(
    q_latent: torch.Tensor,  # [T, H, C] absorbed query
    q_rope: torch.Tensor,  # [T, H, R] rotated rope query
    kv: torch.Tensor,  # [rows, C + R] cache rows of one layer (FP8: uint8 [rows, row bytes])
    slots: torch.Tensor,  # [T, K] rows to attend, -1 = masked
    scale: float,
) -> torch.Tensor:  # [T, H, C]
    """Plain torch reference; a query with no valid slot yields zeros.

    The rows are gathered once per chunk (and dequantized, from an FP8 cache); the logits are one
    batched matmul of ``[q_latent | q_rope]`` against the whole rows, the output one against their
    latent part.
    """
    c = q_latent.shape[-1]
    dt = score_dtype(q_latent.dtype)
    out = torch.empty(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)
    k = slots.shape[-1]
    chunk = max(1, _GATHER_BUDGET // max(1, k * kv.shape[-1]))
    for t0 in range(0, q_latent.shape[0], chunk):
        sl = slice(t0, t0 + chunk)
        chunk_slots = slots[sl]
        valid = chunk_slots >= 0  # [t, K]
        flat = chunk_slots.clamp(min=0).reshape(-1).long()
        gathered = kv.index_select(0, flat).view(chunk_slots.shape[0], k, kv.shape[-1])
        if kv.dtype == kv_fp8.STORAGE:
            rows = kv_fp8.dequantize_rows(gathered, c, dt)  # [t, K, C + R]
        else:
            rows = gathered.to(dt)
        q = torch.cat([q_latent[sl], q_rope[sl]], dim=-1).to(dt)  # [t, H, C + R]
        logits = torch.bmm(q, rows.transpose(1, 2))  # [t, H, K]
        logits = (logits * scale).masked_fill_(~valid[:, None, :], float("-inf"))
        probs = torch.nan_to_num_(torch.softmax(logits, dim=-1), nan=0.0)  # all-masked rows
        out[sl] = torch.bmm(probs, rows[..., :c]).to(out.dtype)
    return out


def check_sparse_mla_args(q_latent, q_rope, kv, slots) -> None:
    """Shapes, dtypes, strides and devices (no synchronisation)."""
    check_tensor("q_latent", q_latent, ndim=3, dtype=FLOAT_DTYPES, contiguous_last=True)
    t, h, c = q_latent.shape
    check_tensor("q_rope", q_rope, ndim=3, dtype=q_latent.dtype, shape=(t, h, None), contiguous_last=True)
    if kv.dtype == kv_fp8.STORAGE:  # an FP8 cache
        width = kv_fp8.row_bytes(c, q_rope.shape[2])
        check_tensor("kv", kv, ndim=2, shape=(None, width), contiguous_last=True)
    else:
        check_tensor(
            "kv", kv, ndim=2, dtype=FLOAT_DTYPES, shape=(None, c + q_rope.shape[2]), contiguous_last=True
        )
    check_tensor(
        "slots", slots, ndim=2, dtype=(torch.int32, torch.int64), shape=(t, None), contiguous_last=True
    )
    check_same_device(("q_latent", "q_rope", "kv", "slots"), (q_latent, q_rope, kv, slots))


def _fp8_triton_fits(q_latent: torch.Tensor, q_rope: torch.Tensor, impl: str) -> bool:
    """Whether ``kernels.sparse_mla_fp8_triton`` takes these queries; imported only where it may
    run (``impl="triton"``, or CUDA queries under ``auto``)."""
    if not (impl == "triton" or (impl == "auto" and q_latent.is_cuda)) or not triton_available():
        return False
    from kernels.sparse_mla_fp8_triton import fits

    return fits(q_latent, q_rope)


def sparse_mla(
    q_latent: torch.Tensor,  # [T, H, C]
    q_rope: torch.Tensor,  # [T, H, R]
    kv: torch.Tensor,  # [rows, C + R]
    slots: torch.Tensor,  # [T, K] int32/int64, -1 = masked
    scale: float,
    *,
    impl: str = "auto",
    validate: bool = False,
    check: bool = True,
) -> torch.Tensor:  # [T, H, C] in q_latent.dtype
    """Sparse MLA over the rows named by ``slots``; ``impl`` in ``"auto"|"torch"|"triton"|"numba"``.

    ``auto`` runs Triton when the tensors are on CUDA, not float64, and within ``TRITON_MAX_*``. On a
    CPU with numba, float32/64 tensors of one dtype and a small query (``kernels.sparse_mla_numba``'s
    ``MAX_QUERY_ELEMENTS``), none of them requiring a gradient, it runs the compiled loop; the torch
    path otherwise. ``numba`` runs the compiled loop whatever the shapes (no gradient flows). An FP8
    ``kv`` (uint8) goes to ``kernels.sparse_mla_fp8_triton`` where ``auto`` would run Triton, to the
    torch path otherwise (``numba`` refuses it).
    ``validate=True`` checks that every slot is -1 or a row of ``kv`` (synchronises on CUDA); the
    kernel itself cannot notice an out-of-range slot.
    ``check=False`` skips the shape/dtype/device checks of the arguments: for callers that built them
    themselves (the engine's attention backends), where the checks are per-call overhead only.
    """
    if check:
        check_sparse_mla_args(q_latent, q_rope, kv, slots)
    if validate:
        check_index_range("slots", slots, kv.shape[0], allow_negative=True)
    if kv.dtype == kv_fp8.STORAGE and impl != "numba":  # FP8 rows: dequantized in the Triton kernel
        fp8_fits = _fp8_triton_fits(q_latent, q_rope, impl)  # (or by the torch path as gathered)
        if resolve_impl(impl, (q_latent, kv, slots), triton_fits=fp8_fits) == "torch":
            return sparse_mla_reference(q_latent, q_rope, kv, slots, scale)
        from kernels.sparse_mla_fp8_triton import sparse_mla_fp8_triton

        return sparse_mla_fp8_triton(q_latent, q_rope, kv, slots, scale)
    if impl == "numba" or (impl == "auto" and q_latent.device.type == "cpu"):
        from kernels import sparse_mla_numba as compiled

        if compiled.fits(q_latent, q_rope, kv, slots):
            if impl == "numba" or (
                compiled.pays_for(q_latent.shape[1], kv.shape[1], slots.shape[1])
                and not (q_latent.requires_grad or q_rope.requires_grad or kv.requires_grad)
            ):
                return compiled.sparse_mla_numba(q_latent, q_rope, kv, slots, scale)
        elif impl == "numba":
            raise ValueError("impl='numba' needs CPU tensors of one dtype, float32 or float64")
    fits = (
        q_latent.dtype != torch.float64
        and kv.dtype != torch.float64
        and q_latent.shape[2] <= TRITON_MAX_LATENT
        and q_rope.shape[2] <= TRITON_MAX_ROPE
    )
    if resolve_impl(impl, (q_latent, kv, slots), triton_fits=fits) == "torch":
        return sparse_mla_reference(q_latent, q_rope, kv, slots, scale)
    from kernels.sparse_mla_triton import sparse_mla_triton

    return sparse_mla_triton(q_latent, q_rope, kv, slots, scale)
