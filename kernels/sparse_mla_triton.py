"""Triton sparse MLA (contract: ``kernels.sparse_mla``); imported only when a Triton path is taken.

Grid ``(T, cdiv(H, BLOCK_H))``. A program holds ``BLOCK_H`` heads of one query (they share the
gathered rows, the point of the absorbed form) and walks the query's slots ``BLOCK_N`` at a time:

    gather rows [BLOCK_N, C + R]  ->  logits = q_lat . lat^T + q_rope . rope^T   (two dots)
    online softmax (running max m, running sum l, float32)  ->  acc += p . lat    (third dot)

Masked slots (-1) get logit -inf; a running max that is still -inf is replaced by 0 before the
exponentials, so an all-masked query ends with l = 0 and writes zeros. Dots accumulate in float32;
their operands are float32 (IEEE) for float32 inputs and under the interpreter (which multiplies
bfloat16 bit patterns), the input dtype otherwise (tensor cores; the probabilities are rounded to it
for the third dot, as flash attention does). tl.dot needs every tile side >= 16, hence the minimum
block sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import next_power_of_2
from kernels.triton_util import dot_dtype


@triton.jit
def _sparse_mla_kernel(
    ql_ptr, qr_ptr, kv_ptr, slot_ptr, out_ptr,
    H, K, C, R, scale,
    ql_stride_t, ql_stride_h, qr_stride_t, qr_stride_h, kv_stride, slot_stride_t, out_stride_t, out_stride_h,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    t = tl.program_id(0)
    ih = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ic = tl.arange(0, BLOCK_C)
    ir = tl.arange(0, BLOCK_R)
    h_in = ih < H
    c_in = ic < C
    r_in = ir < R
    q_lat = tl.load(ql_ptr + t * ql_stride_t + ih[:, None] * ql_stride_h + ic[None, :],
                    mask=h_in[:, None] & c_in[None, :], other=0.0).to(DOT_DTYPE)  # [BH, BC]
    q_rope = tl.load(qr_ptr + t * qr_stride_t + ih[:, None] * qr_stride_h + ir[None, :],
                     mask=h_in[:, None] & r_in[None, :], other=0.0).to(DOT_DTYPE)  # [BH, BR]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    n0 = t * 0
    while n0 < K:
        idx = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(slot_ptr + t * slot_stride_t + idx, mask=idx < K, other=-1).to(tl.int64)
        ok = slot >= 0
        row = kv_ptr + slot * kv_stride  # [BN] row pointers
        lat = tl.load(row[:, None] + ic[None, :], mask=ok[:, None] & c_in[None, :], other=0.0).to(DOT_DTYPE)
        rope = tl.load(row[:, None] + C + ir[None, :], mask=ok[:, None] & r_in[None, :], other=0.0).to(
            DOT_DTYPE
        )
        logits = tl.dot(q_lat, tl.trans(lat), input_precision="ieee")
        logits += tl.dot(q_rope, tl.trans(rope), input_precision="ieee")
        logits = tl.where(ok[None, :], logits * scale, float("-inf"))  # [BH, BN]
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(logits - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), lat, input_precision="ieee")
        m_i = m_new
        n0 += BLOCK_N
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + t * out_stride_t + ih[:, None] * out_stride_h + ic[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_in[:, None] & c_in[None, :],
    )


def sparse_mla_triton(q_latent, q_rope, kv, slots, scale: float) -> torch.Tensor:
    """Launch (arguments checked by ``kernels.sparse_mla.sparse_mla``)."""
    num_tokens, heads, latent = q_latent.shape
    rope, top_k = q_rope.shape[2], slots.shape[1]
    out = torch.empty_like(q_latent)
    if num_tokens == 0 or heads == 0:
        return out
    block_h = 16
    grid = (num_tokens, triton.cdiv(heads, block_h))
    _sparse_mla_kernel[grid](
        q_latent,
        q_rope,
        kv,
        slots,
        out,
        heads,
        top_k,
        latent,
        rope,
        float(scale),
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        kv.stride(0),
        slots.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_H=block_h,
        BLOCK_N=min(32 if latent > 256 else 64, max(16, next_power_of_2(top_k))),
        BLOCK_C=max(16, next_power_of_2(latent)),
        BLOCK_R=max(16, next_power_of_2(rope)),
        DOT_DTYPE=dot_dtype(q_latent, kv),
        num_warps=8,
    )
    return out
