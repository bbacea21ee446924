"""Triton indexer top-k over an FP8 key cache (contract: ``kernels.indexer_topk``; layout:
``kernels.kv_fp8``); imported only when a Triton path is taken.

The scores pass is ``kernels.indexer_topk_triton``'s, except that a gathered key is
``uint8 [Di e4m3 | one float32 scale]`` and is dequantized in registers: each byte decoded as
``kernels.sparse_mla_fp8_triton.e4m3_to_float32`` does, times the key's scale (one int32 word when
the scales sit on 4-byte boundaries, else put together from 4 bytes), rounded to the queries' dtype
as ``kv_fp8.dequantize_keys`` rounds it for the torch path, so both paths score the same key
values. The selection pass is ``indexer_topk_triton.select_topk_triton``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import next_power_of_2
from kernels.indexer_topk_triton import select_topk_triton
from kernels.sparse_mla_fp8_triton import e4m3_to_float32, float32_from_bytes, words
from kernels.triton_util import dot_dtype

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _fp8_scores_kernel(
    q_ptr, w_ptr, k_ptr, word_ptr, r2t_ptr, rows_ptr, lens_ptr, out_ptr,
    H, D, max_len, scale,
    q_stride_t, q_stride_h, w_stride_t, k_stride, r2t_stride,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, ALIGNED: tl.constexpr,
    KEY_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    t = tl.program_id(0)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    row = tl.load(rows_ptr + t)
    n = tl.load(lens_ptr + t)
    visible = s < n
    ih = tl.arange(0, BLOCK_H)
    idim = tl.arange(0, BLOCK_D)
    h_in = ih < H
    d_in = idim < D
    q = tl.load(q_ptr + t * q_stride_t + ih[:, None] * q_stride_h + idim[None, :],
                mask=h_in[:, None] & d_in[None, :], other=0.0).to(DOT_DTYPE)  # [BH, BD]
    w = tl.load(w_ptr + t * w_stride_t + ih, mask=h_in, other=0.0).to(tl.float32)  # [BH]
    loc = tl.load(r2t_ptr + row * r2t_stride + s, mask=visible, other=0).to(tl.int64)  # [BS]
    raw = tl.load(k_ptr + loc[:, None] * k_stride + idim[None, :],
                  mask=visible[:, None] & d_in[None, :], other=0)  # [BS, BD] e4m3 bytes
    if ALIGNED:
        key_scale = tl.load(word_ptr + loc * (k_stride // 4) + D // 4, mask=visible, other=0).to(
            tl.float32, bitcast=True
        )
    else:
        key_scale = float32_from_bytes(k_ptr + loc * k_stride + D, visible)
    keys = (e4m3_to_float32(raw) * key_scale[:, None]).to(KEY_DTYPE).to(DOT_DTYPE)
    dots = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [BH, BS]
    scores = tl.sum(tl.maximum(dots * scale, 0.0) * w[:, None], axis=0)  # [BS]
    scores = tl.where(visible, scores, float("-inf"))
    tl.store(out_ptr + t.to(tl.int64) * max_len + s, scores, mask=s < max_len)


def indexer_scores_fp8_triton(index_q, index_w, index_k, req_to_token, req_rows, seq_lens, scale: float,
                              max_len: int) -> torch.Tensor:
    """``[T, max_len]`` float32 scores over FP8 keys ``index_k`` (uint8 ``[rows, Di + 4]``), ``-inf``
    where not visible."""
    num_tokens, heads, dim = index_q.shape
    scores = torch.empty(num_tokens, max_len, dtype=torch.float32, device=index_q.device)
    if num_tokens == 0 or max_len == 0:
        return scores
    word_view = words(index_k) if dim % 4 == 0 else None
    block_s = min(64, max(16, next_power_of_2(max_len)))
    grid = (num_tokens, triton.cdiv(max_len, block_s))
    _fp8_scores_kernel[grid](
        index_q, index_w, index_k, index_k if word_view is None else word_view, req_to_token, req_rows,
        seq_lens, scores,
        heads, dim, max_len, float(scale),
        index_q.stride(0), index_q.stride(1), index_w.stride(0), index_k.stride(0), req_to_token.stride(0),
        BLOCK_H=max(16, next_power_of_2(heads)), BLOCK_D=max(16, next_power_of_2(dim)), BLOCK_S=block_s,
        ALIGNED=word_view is not None, KEY_DTYPE=_TL_DTYPES[index_q.dtype], DOT_DTYPE=dot_dtype(index_q),
        num_warps=8,  # the decoded keys live beside the dot's operands: 4 warps spill at V3.2's sizes
    )
    return scores


def indexer_topk_fp8_triton(
    index_q, index_w, index_k, req_to_token, req_rows, seq_lens, top_k: int, scale: float, max_len: int
) -> torch.Tensor:
    """Scores pass then selection pass (arguments checked by ``kernels.indexer_topk.indexer_topk``)."""
    scores = indexer_scores_fp8_triton(
        index_q, index_w, index_k, req_to_token, req_rows, seq_lens, scale, max_len
    )
    return select_topk_triton(scores, seq_lens, top_k)
