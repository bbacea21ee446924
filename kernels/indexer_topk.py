"""Indexer scores and top-k (the DSA "lightning indexer").

For a query token t of a request and each visible position s of that request:

    score[t, s] = sum_h relu(q[t, h] . k[loc(s)] * scale) * w[t, h]

where ``loc(s) = req_to_token[req_rows[t], s]`` is the location of position s's indexer key.
The top-k contract (docs/invariants.md): positions are ordered by score descending, ties broken
by the lower position first, i.e. a stable descending sort truncated to ``top_k``. Every
implementation (reference, Triton, tests) follows it, so a full forward, an incremental decode and a
multi-token verify select the same positions. ``-0.0`` ties with ``0.0`` (as in ``torch.sort``).

Positions ``s >= seq_lens[t]`` are not visible (causality); their ``req_to_token`` entries are never
read, so they may hold anything. Rows with fewer than ``top_k`` visible positions are padded with -1.
"""

from __future__ import annotations

import torch

from kernels.checks import FLOAT_DTYPES, check_index_range, check_same_device, check_tensor, resolve_impl

# Triton limits: a selection program keeps 2 * next_pow2(top_k) packed keys; the score program one
# [heads, dim] query tile (tl.dot needs every tile side >= 16, so smaller sizes are padded).
TRITON_MAX_TOP_K = 2048
TRITON_MAX_HEADS = 128
TRITON_MAX_DIM = 256
_GATHER_BUDGET = 1 << 24  # elements of gathered keys per reference chunk (memory, not speed)


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


def indexer_scores_reference(
    index_q: torch.Tensor,  # [T, Hi, Di]
    index_w: torch.Tensor,  # [T, Hi]
    index_k: torch.Tensor,  # [rows, Di]
    req_to_token: torch.Tensor,  # [N, max_ctx] location of (request row, position)
    req_rows: torch.Tensor,  # [T] int64
    seq_lens: torch.Tensor,  # [T] int64
    scale: float,
    max_len: int,
) -> torch.Tensor:  # [T, max_len] in score_dtype, -inf where not visible
    """Dense score rows, gathered in query chunks so that prefill stays within memory."""
    dt = score_dtype(index_q.dtype)
    num_tokens = index_q.shape[0]
    out = torch.full((num_tokens, max_len), float("-inf"), dtype=dt, device=index_q.device)
    pos = torch.arange(max_len, device=index_q.device)
    chunk = max(1, _GATHER_BUDGET // max(1, max_len * index_k.shape[-1]))
    for t0 in range(0, num_tokens, chunk):
        sl = slice(t0, t0 + chunk)
        visible = pos[None, :] < seq_lens[sl, None]  # [t, S]
        locs = torch.where(visible, req_to_token[req_rows[sl]][:, :max_len], 0)  # [t, S]
        keys = index_k[locs.long()].to(dt)  # [t, S, Di]
        dots = torch.einsum("thd,tsd->ths", index_q[sl].to(dt), keys)  # [t, Hi, S]
        scores = torch.einsum("ths,th->ts", torch.relu(dots * scale), index_w[sl].to(dt))
        out[sl] = scores.masked_fill(~visible, float("-inf"))
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
    max_len = int(seq_lens.max())
    scores = indexer_scores_reference(index_q, index_w, index_k, req_to_token, req_rows, seq_lens, scale, max_len)
    return stable_topk_positions(scores, top_k)


def check_indexer_args(index_q, index_w, index_k, req_to_token, req_rows, seq_lens, top_k) -> None:
    """Shapes, dtypes, strides, devices (no synchronisation)."""
    check_tensor("index_q", index_q, ndim=3, dtype=FLOAT_DTYPES, contiguous_last=True)
    t, h, d = index_q.shape
    check_tensor("index_w", index_w, dtype=FLOAT_DTYPES, shape=(t, h), contiguous_last=True)
    check_tensor("index_k", index_k, dtype=FLOAT_DTYPES, shape=(None, d), contiguous_last=True)
    check_tensor("req_to_token", req_to_token, ndim=2, dtype=(torch.int32, torch.int64), contiguous_last=True)
    check_tensor("req_rows", req_rows, dtype=torch.int64, shape=(t,), contiguous_last=True)
    check_tensor("seq_lens", seq_lens, dtype=torch.int64, shape=(t,), contiguous_last=True)
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    names = ("index_q", "index_w", "index_k", "req_to_token", "req_rows", "seq_lens")
    check_same_device(names, (index_q, index_w, index_k, req_to_token, req_rows, seq_lens))


def indexer_topk(
    index_q: torch.Tensor,  # [T, Hi, Di]
    index_w: torch.Tensor,  # [T, Hi]
    index_k: torch.Tensor,  # [rows, Di]
    req_to_token: torch.Tensor,  # [N, max_ctx] int64 (or int32)
    req_rows: torch.Tensor,  # [T] int64
    seq_lens: torch.Tensor,  # [T] int64, <= max_ctx
    top_k: int,
    scale: float,
    *,
    impl: str = "auto",
    max_seq_len: int | None = None,
    validate: bool = False,
) -> torch.Tensor:  # [T, top_k] int32 positions in contract order, -1 padded
    """Indexer top-k with the tie-break contract; ``impl`` in ``"auto"|"torch"|"triton"``.

    ``auto`` runs Triton when the tensors are on CUDA, not float64, and within ``TRITON_MAX_*``.
    ``max_seq_len`` (>= every ``seq_lens`` value) spares the device->host read of ``seq_lens.max()``.
    ``validate=True`` checks the values the kernel trusts (synchronises on CUDA): ``req_rows`` are rows
    of ``req_to_token`` and ``seq_lens`` lie in ``[0, max_ctx]``; beyond them the kernel would read the
    next row's entries silently.
    """
    check_indexer_args(index_q, index_w, index_k, req_to_token, req_rows, seq_lens, top_k)
    if max_seq_len is not None and max_seq_len > req_to_token.shape[1]:
        raise ValueError(f"max_seq_len={max_seq_len} exceeds req_to_token's {req_to_token.shape[1]} positions")
    if validate:
        check_index_range("req_rows", req_rows, req_to_token.shape[0])
        check_index_range("seq_lens", seq_lens, req_to_token.shape[1] + 1)
    _, heads, dim = index_q.shape
    fits = (index_q.dtype != torch.float64 and index_k.dtype != torch.float64 and top_k <= TRITON_MAX_TOP_K
            and heads <= TRITON_MAX_HEADS and dim <= TRITON_MAX_DIM)
    if resolve_impl(impl, (index_q, index_k, req_to_token), triton_fits=fits) == "torch":
        return indexer_topk_reference(index_q, index_w, index_k, req_to_token, req_rows, seq_lens, top_k, scale)
    from kernels.indexer_topk_triton import indexer_topk_triton

    if index_q.shape[0] == 0:
        return torch.empty(0, top_k, dtype=torch.int32, device=index_q.device)
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    return indexer_topk_triton(index_q, index_w, index_k, req_to_token, req_rows, seq_lens, top_k, scale, max_len)
