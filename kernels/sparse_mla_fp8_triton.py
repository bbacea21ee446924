"""Triton sparse MLA over an FP8 cache (contract: ``kernels.sparse_mla``; layout: ``kernels.kv_fp8``);
imported only when a Triton path is taken.

The program is ``kernels.sparse_mla_triton``'s (grid ``(T, cdiv(H, BLOCK_H))``, ``BLOCK_H`` heads
of one query walking its slots ``BLOCK_N`` at a time, online softmax in float32), except that a
gathered row is ``uint8 [C e4m3 | ceil(C/128) float32 scales | R bfloat16]`` and is dequantized in
registers before the dots:

* an e4m3 byte is decoded with integer operations: sign bit 7, exponent bits 3-6 (bias 7), mantissa
  bits 0-2; exponent 0 is subnormal (``mantissa * 2**-9``), ``0x7F`` / ``0xFF`` are NaN (the
  quantizer never writes them); the value times its tile's scale is the float32 that
  ``kv_fp8.dequantize_rows`` computes, bit for bit;
* a scale is a little-endian float32, loaded once per row and tile (``[BLOCK_N, tiles]``, then
  broadcast over the tile's values through a reshape): one int32 word when the scales sit on
  4-byte boundaries (``ALIGNED``: ``C``, the row stride and the pool's offset all multiples of 4,
  the V3.2 case), else put together from its 4 bytes;
* a rope value is a bfloat16, i.e. the top half of a float32: its 16 bits (half of a word when
  aligned, two bytes otherwise) shifted left by 16.

The dequantized rows are float32; the dots take them as ``triton_util.dot_dtype`` of the queries
says (float32 for float32 queries and under the interpreter, the queries' half dtype on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import kv_fp8
from kernels.checks import next_power_of_2
from kernels.triton_util import dot_dtype

# one [BLOCK_H, C] float32 accumulator and one dequantized [BLOCK_N, C] tile per program
MAX_LATENT = 1024  # C
MAX_ROPE = 256  # R


@triton.jit
def e4m3_to_float32(b):
    """e4m3 bytes (any integer dtype, values 0..255) -> their float32 values."""
    b = b.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # (1 + m/8) * 2**(e-7)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
    return (mag.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)  # the sign


@triton.jit
def float32_from_bytes(ptr, mask):
    """The little-endian float32 whose first byte each of ``ptr`` (uint8 pointers) points at."""
    b0 = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    b1 = tl.load(ptr + 1, mask=mask, other=0).to(tl.int32)
    b2 = tl.load(ptr + 2, mask=mask, other=0).to(tl.int32)
    b3 = tl.load(ptr + 3, mask=mask, other=0).to(tl.int32)
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _scales(kv_ptr, word_ptr, slot, kv_stride, C, tiles, ok, BLOCK_T: tl.constexpr, ALIGNED: tl.constexpr):
    """``[BN, BLOCK_T]``: the float32 scales of rows ``slot``'s ``tiles`` tiles (0 past the last)."""
    it = tl.arange(0, BLOCK_T)
    mask = ok[:, None] & (it[None, :] < tiles)
    if ALIGNED:
        word = slot[:, None] * (kv_stride // 4) + C // 4 + it[None, :]
        return tl.load(word_ptr + word, mask=mask, other=0).to(tl.float32, bitcast=True)
    else:
        return float32_from_bytes(kv_ptr + slot[:, None] * kv_stride + C + 4 * it[None, :], mask)


@triton.jit
def _rope(kv_ptr, word_ptr, slot, kv_stride, start, ir, mask, ALIGNED: tl.constexpr):
    """``[BN, BR]`` float32: the bfloat16 rope values at byte ``start`` of rows ``slot``."""
    if ALIGNED:
        word = tl.load(word_ptr + slot[:, None] * (kv_stride // 4) + start // 4 + ir[None, :] // 2,
                       mask=mask, other=0)
        half = (word >> (16 * (ir[None, :] & 1))) & 0xFFFF
    else:
        first = kv_ptr + slot[:, None] * kv_stride + start + 2 * ir[None, :]
        lo = tl.load(first, mask=mask, other=0).to(tl.int32)
        hi = tl.load(first + 1, mask=mask, other=0).to(tl.int32)
        half = lo | (hi << 8)
    return (half << 16).to(tl.float32, bitcast=True)


@triton.jit
def _sparse_mla_fp8_kernel(
    ql_ptr, qr_ptr, kv_ptr, word_ptr, slot_ptr, out_ptr,
    H, K, C, R, rope_start, scale,
    ql_stride_t, ql_stride_h, qr_stride_t, qr_stride_h, kv_stride, slot_stride_t, out_stride_t, out_stride_h,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    TILE_W: tl.constexpr, ALIGNED: tl.constexpr, DOT_DTYPE: tl.constexpr,
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
        lat_mask = ok[:, None] & c_in[None, :]
        raw = tl.load(kv_ptr + slot[:, None] * kv_stride + ic[None, :], mask=lat_mask, other=0)
        # [BN, BT]: one scale per tile of TILE_W values (a latent narrower than a tile is one tile)
        tile_scale = _scales(
            kv_ptr, word_ptr, slot, kv_stride, C, (rope_start - C) // 4, ok, BLOCK_C // TILE_W, ALIGNED
        )
        lat = tl.reshape(e4m3_to_float32(raw), [BLOCK_N, BLOCK_C // TILE_W, TILE_W]) * tile_scale[:, :, None]
        lat = tl.reshape(lat, [BLOCK_N, BLOCK_C]).to(DOT_DTYPE)  # [BN, BC]
        rope = _rope(kv_ptr, word_ptr, slot, kv_stride, rope_start, ir, ok[:, None] & r_in[None, :],
                     ALIGNED).to(DOT_DTYPE)  # [BN, BR]
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


def fits(q_latent: torch.Tensor, q_rope: torch.Tensor) -> bool:
    """Whether this kernel takes these queries (not float64, C and R within the limits)."""
    return (
        q_latent.dtype != torch.float64 and q_latent.shape[2] <= MAX_LATENT and q_rope.shape[2] <= MAX_ROPE
    )


def words(pool: torch.Tensor) -> torch.Tensor | None:
    """``pool`` (uint8, last dim contiguous) read as int32 words, or None when its rows or offset
    are not on 4-byte boundaries."""
    if pool.shape[-1] % 4 or pool.storage_offset() % 4 or any(s % 4 for s in pool.stride()[:-1]):
        return None
    return pool.view(torch.int32)


def sparse_mla_fp8_triton(q_latent, q_rope, kv, slots, scale: float) -> torch.Tensor:
    """Launch (arguments checked by ``kernels.sparse_mla.sparse_mla``; ``kv`` uint8
    ``[rows, kv_fp8.row_bytes(C, R)]``)."""
    num_tokens, heads, latent = q_latent.shape
    rope, top_k = q_rope.shape[2], slots.shape[1]
    out = torch.empty_like(q_latent)
    if num_tokens == 0 or heads == 0:
        return out
    word_view = words(kv) if latent % 4 == 0 else None
    block_h = 16
    block_c = max(16, next_power_of_2(latent))
    grid = (num_tokens, triton.cdiv(heads, block_h))
    _sparse_mla_fp8_kernel[grid](
        q_latent,
        q_rope,
        kv,
        kv if word_view is None else word_view,
        slots,
        out,
        heads,
        top_k,
        latent,
        rope,
        latent + 4 * triton.cdiv(latent, kv_fp8.TILE),
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
        # fewer rows per step than the unquantized kernel takes: the decoded float32 tile is live beside
        # the accumulator (at most 8192 values of it, 16 rows of 512)
        BLOCK_N=min(max(16, 8192 // block_c), 64, max(16, next_power_of_2(top_k))),
        BLOCK_C=block_c,
        BLOCK_R=max(16, next_power_of_2(rope)),
        TILE_W=min(kv_fp8.TILE, block_c),
        ALIGNED=word_view is not None,
        DOT_DTYPE=dot_dtype(q_latent),
        num_warps=8,
    )
    return out
