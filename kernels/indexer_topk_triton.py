"""Triton indexer top-k (contract: ``kernels.indexer_topk``), two passes.

1. ``_scores_kernel``, grid ``(T, cdiv(max_len, BLOCK_S))``: gathers ``BLOCK_S`` keys through
   ``req_to_token``, one ``[heads, dim] x [dim, BLOCK_S]`` dot (float32 accumulation; operands as in
   ``triton_util.dot_dtype``), ReLU, weighted sum over heads; ``-inf`` where not visible.
   Scores go to a ``[T, max_len]`` float32 scratch.
2. ``_select_kernel``, grid ``(T,)``: packs each visible score into one sortable int64

       key = (monotone_int32(score) << 32) | (2**31 - 1 - position)

   so that one plain descending order is "score descending, then lower position first"; it merges
   ``BLOCK_K`` candidates at a time into a running best-``BLOCK_K`` with ``tl.topk``.

``monotone_int32`` flips the magnitude bits of negative floats so that integer order equals float
order; ``-0.0`` is first turned into ``0.0`` so that the two tie, as they do in ``torch.sort``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import next_power_of_2
from kernels.triton_util import dot_dtype

_NONE_KEY = -(2**31)  # key of "no position": below the key of every float, -inf included


@triton.jit
def _scores_kernel(
    q_ptr, w_ptr, k_ptr, r2t_ptr, rows_ptr, lens_ptr, out_ptr,
    H, D, max_len, scale,
    q_stride_t, q_stride_h, w_stride_t, k_stride, r2t_stride,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, DOT_DTYPE: tl.constexpr,
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
    keys = tl.load(k_ptr + loc[:, None] * k_stride + idim[None, :],
                   mask=visible[:, None] & d_in[None, :], other=0.0).to(DOT_DTYPE)  # [BS, BD]
    dots = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [BH, BS]
    scores = tl.sum(tl.maximum(dots * scale, 0.0) * w[:, None], axis=0)  # [BS]
    scores = tl.where(visible, scores, float("-inf"))
    tl.store(out_ptr + t.to(tl.int64) * max_len + s, scores, mask=s < max_len)


@triton.jit
def _select_kernel(score_ptr, lens_ptr, out_ptr, max_len, top_k, NONE_KEY: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    n = tl.load(lens_ptr + t)
    ik = tl.arange(0, BLOCK_K)
    none = tl.full([BLOCK_K], NONE_KEY, tl.int64) << 32
    best = none
    start = t * 0
    while start < n:
        s = start + ik
        ok = (s < n) & (s < max_len)
        score = tl.load(score_ptr + t.to(tl.int64) * max_len + s, mask=ok, other=0.0)
        ok = ok & (score == score)  # a NaN score is never selected (the contract's rule)
        score = tl.where(score == 0.0, 0.0, score)  # -0.0 ties with 0.0
        bits = score.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone: int order == float order
        packed = (key.to(tl.int64) << 32) | (2147483647 - s).to(tl.int64)
        packed = tl.where(ok, packed, none)
        both = tl.reshape(tl.join(best, packed), [2 * BLOCK_K])
        best = tl.topk(both, BLOCK_K)  # descending
        start += BLOCK_K
    pos = 2147483647 - (best & 2147483647)
    pos = tl.where((best >> 32) > NONE_KEY, pos, -1)
    tl.store(out_ptr + t * top_k + ik, pos.to(tl.int32), mask=ik < top_k)


def indexer_scores_triton(index_q, index_w, index_k, req_to_token, req_rows, seq_lens, scale: float,
                          max_len: int) -> torch.Tensor:
    """``[T, max_len]`` float32 scores, ``-inf`` where not visible."""
    num_tokens, heads, dim = index_q.shape
    scores = torch.empty(num_tokens, max_len, dtype=torch.float32, device=index_q.device)
    if num_tokens == 0 or max_len == 0:
        return scores
    block_s = min(64, max(16, next_power_of_2(max_len)))
    grid = (num_tokens, triton.cdiv(max_len, block_s))
    _scores_kernel[grid](
        index_q, index_w, index_k, req_to_token, req_rows, seq_lens, scores,
        heads, dim, max_len, float(scale),
        index_q.stride(0), index_q.stride(1), index_w.stride(0), index_k.stride(0), req_to_token.stride(0),
        BLOCK_H=max(16, next_power_of_2(heads)), BLOCK_D=max(16, next_power_of_2(dim)), BLOCK_S=block_s,
        DOT_DTYPE=dot_dtype(index_q, index_k),
    )
    return scores


def select_topk_triton(scores: torch.Tensor, seq_lens: torch.Tensor, top_k: int) -> torch.Tensor:
    """Contract-ordered top-k positions of contiguous float32 ``scores [T, L]`` (first ``seq_lens``
    visible)."""
    num_tokens, max_len = scores.shape
    out = torch.empty(num_tokens, top_k, dtype=torch.int32, device=scores.device)
    if num_tokens:
        _select_kernel[(num_tokens,)](
            scores, seq_lens, out, max_len, top_k, NONE_KEY=_NONE_KEY, BLOCK_K=max(16, next_power_of_2(top_k))
        )
    return out


def indexer_topk_triton(
    index_q, index_w, index_k, req_to_token, req_rows, seq_lens, top_k: int, scale: float, max_len: int
) -> torch.Tensor:
    """Scores pass then selection pass (arguments checked by ``kernels.indexer_topk.indexer_topk``)."""
    scores = indexer_scores_triton(
        index_q, index_w, index_k, req_to_token, req_rows, seq_lens, scale, max_len
    )
    return select_topk_triton(scores, seq_lens, top_k)
