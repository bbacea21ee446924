"""Indexer scores and top-k (the DSA "lightning indexer").

For a query token t of a request and each visible position s of that request:

    score[t, s] = sum_h relu(q[t, h] . k[loc(s)] * scale) * w[t, h]

where ``loc(s) = req_to_token[req_rows[t], s]`` is the location of position s's indexer key.
The top-k contract (ARCHITECTURE section 3a): positions are ordered by score descending, ties broken
by the lower position first, i.e. a stable descending sort truncated to ``top_k``. Every
implementation (reference, Triton, tests) follows it, so a full forward, an incremental decode and a
multi-token verify select the same positions.
"""

from __future__ import annotations

import torch


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores are computed in float32, or float64 when the inputs are float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def stable_topk_positions(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Stable descending top-k over the last dim of ``scores`` (``-inf`` = not visible).

    Returns int32 positions ``[..., top_k]`` in contract order, -1 where fewer positions are visible.
    """
    n = scores.shape[-1]
    k = min(top_k, n)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    picked = torch.gather(scores, -1, order)
    out = torch.where(picked == float("-inf"), torch.full_like(order, -1), order).to(torch.int32)
    if k < top_k:
        pad = torch.full((*out.shape[:-1], top_k - k), -1, dtype=torch.int32, device=out.device)
        out = torch.cat([out, pad], dim=-1)
    return out


def indexer_topk_reference(
    index_q: torch.Tensor,  # [T, Hi, Di] query per indexer head (rotated)
    index_w: torch.Tensor,  # [T, Hi] per-head weights
    index_k: torch.Tensor,  # [rows, Di] indexer key cache of one layer, addressed by location
    req_to_token: torch.Tensor,  # [N, max_ctx] int64 location of (request row, position)
    req_rows: torch.Tensor,  # [T] int64 request row of each query
    seq_lens: torch.Tensor,  # [T] int64 positions visible to each query (its position + 1)
    top_k: int,
    scale: float,
) -> torch.Tensor:  # [T, top_k] int32 positions, -1 padded
    """Plain torch reference: one dense score row per query over its request's visible positions."""
    num_tokens = index_q.shape[0]
    if num_tokens == 0:
        return torch.empty(0, top_k, dtype=torch.int32, device=index_q.device)
    dt = score_dtype(index_q.dtype)
    max_len = int(seq_lens.max())
    pos = torch.arange(max_len, device=index_q.device)
    locs = req_to_token[req_rows][:, :max_len]  # [T, S]
    visible = pos[None, :] < seq_lens[:, None]  # [T, S]
    keys = index_k[locs.clamp(min=0)].to(dt)  # [T, S, Di]
    dots = torch.einsum("thd,tsd->ths", index_q.to(dt), keys)  # [T, Hi, S]
    scores = torch.einsum("ths,th->ts", torch.relu(dots * scale), index_w.to(dt))  # [T, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    return stable_topk_positions(scores, top_k)
