"""Indexer scores and top-k (the DSA "lightning indexer").

For a query token t of a request and each visible position s of that request:

    score[t, s] = sum_h relu(q[t, h] . k[loc(s)] * scale) * w[t, h]

where ``loc(s) = req_to_token[req_rows[t], s]`` is the location of position s's indexer key.
The top-k contract (docs/invariants.md): positions are ordered by score descending, ties broken
by the lower position first, i.e. a stable descending sort truncated to ``top_k``. Every
implementation (reference, Triton, tests) follows it, so a full forward, an incremental decode and a
multi-token verify select the same positions. ``-0.0`` ties with ``0.0`` (as in ``torch.sort``).

Positions ``s >= seq_lens[t]`` are not visible (causality). ``req_to_token`` entries a request's
queries cannot see are never read, so they may hold anything (an implementation may read the keys of
positions below the longest of the request's queries for all of them, and mask). Rows with fewer
than ``top_k`` visible positions are padded with -1.

Two torch implementations: ``indexer_topk_reference`` (the CPU engine's path) scores each request's queries by
one matmul against that request's keys, gathered once, in query chunks of bounded memory, and selects with
``topk_positions`` (``torch.topk`` plus a repair of the ties at the k-th value, no whole-row sort);
``indexer_topk_oracle`` gathers every visible key once per query and sorts whole rows
(``stable_topk_positions``). The selection is exact (equal for any scores); the scores of the two agree
exactly on inputs whose products and sums are exact in the score dtype (small integers), and otherwise to
rounding, since a matmul's summation order depends on its shape (as the Triton kernel's does).
"""

from __future__ import annotations

import torch

from kernels import kv_fp8
from kernels.checks import FLOAT_DTYPES, check_index_range, check_same_device, check_tensor, resolve_impl

# Triton limits: a selection program keeps 2 * next_pow2(top_k) packed keys; the score program one
# [heads, dim] query tile (tl.dot needs every tile side >= 16, so smaller sizes are padded).
TRITON_MAX_TOP_K = 2048
TRITON_MAX_HEADS = 128
TRITON_MAX_DIM = 256
_GATHER_BUDGET = 1 << 24  # elements of gathered keys per reference chunk (memory, not speed)
_SCORE_BUDGET = 1 << 20  # elements of [queries, heads, positions] dots per matmul chunk
# a request with more queries than this is scored by one matmul over its keys; fewer (decode,
# verify) go into one gather over the batch, which costs less than a matmul call per request
MATMUL_MIN_QUERIES = 8


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores are computed in float32, or float64 when the inputs are float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _no_nan(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` with NaN as ``-inf``: a NaN score (from non-finite weights or activations) is never
    selected, in every implementation alike (the request then fails on its non-finite logits)."""
    nan = torch.isnan(scores)
    return scores.masked_fill(nan, float("-inf")) if bool(nan.any()) else scores


def stable_topk_positions(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Stable descending top-k over the last dim of ``scores`` (``-inf`` = not visible; NaN is never
    selected either).

    Returns int32 positions ``[..., top_k]`` in contract order, -1 where fewer positions are visible.
    """
    n = scores.shape[-1]
    k = min(top_k, n)
    scores = _no_nan(scores)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    picked = torch.gather(scores, -1, order)
    out = torch.where(picked == float("-inf"), torch.full_like(order, -1), order).to(torch.int32)
    if k < top_k:
        pad = torch.full((*out.shape[:-1], top_k - k), -1, dtype=torch.int32, device=out.device)
        out = torch.cat([out, pad], dim=-1)
    return out


def topk_positions(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """``stable_topk_positions`` without sorting whole rows (equal output for any scores, NaN excluded),
    over the last dim of ``scores [..., n]``: int32 ``[..., top_k]``, -1 where fewer are visible.

    ``torch.topk`` (sorted) picks the right set and order except among equal values: of the entries
    equal to its k-th value ``v`` it takes an arbitrary subset, and equal values it took come in an
    arbitrary order. A row without either case (no two finite picked values equal, and no entry
    ``== v`` left out; ``-0.0 == 0.0``, so the two tie) is final as it comes, which is the usual
    case. The others are repaired: every entry ``> v`` and the lowest positions among those
    ``== v``, then a stable descending sort of the k positions taken in position order, which gives
    the contract's order. Rows whose ``v`` is ``-inf`` need no repair of the cut: whichever
    invisible positions are picked, they come last and come out as -1. Rows no longer than
    ``top_k`` (a short prompt's prefill) keep every entry: one stable sort of each gives the order.
    """
    lead, n = scores.shape[:-1], scores.shape[-1]
    rows, k = lead.numel(), min(top_k, n)
    scores = _no_nan(scores.reshape(rows, n))
    out = torch.full((rows, top_k), -1, dtype=torch.int32, device=scores.device)
    if k == 0 or rows == 0:
        return out.view(*lead, top_k)
    if n <= top_k:  # every entry is taken: one stable sort of the row is the contract's order
        values, pos = torch.sort(scores, dim=-1, descending=True, stable=True)
        out[:, :k] = torch.where(values == float("-inf"), -1, pos).to(torch.int32)
        return out.view(*lead, top_k)
    values, pos = torch.topk(scores, k, dim=-1, sorted=True)  # [rows, k], values descending
    kth = values[:, -1:]
    finite = kth[:, 0] > float("-inf")
    straddle = ((scores == kth).sum(-1) > (values == kth).sum(-1)) & finite
    tied = ((values[:, 1:] == values[:, :-1]) & (values[:, 1:] > float("-inf"))).any(-1)
    repair = straddle | tied
    if bool(repair.any()):
        idx = repair.nonzero()[:, 0]
        sub, sub_kth = scores[idx], kth[idx]
        picked_pos = torch.where(straddle[idx, None], _lowest_tied(sub, sub_kth, k), pos[idx])
        picked_pos = torch.sort(
            picked_pos, dim=-1
        ).values  # position order: the stable sort breaks ties by it
        picked = torch.gather(sub, -1, picked_pos)
        order = torch.sort(picked, dim=-1, descending=True, stable=True).indices
        pos[idx] = torch.gather(picked_pos, -1, order)
        values[idx] = torch.gather(picked, -1, order)
    out[:, :k] = torch.where(values == float("-inf"), -1, pos).to(torch.int32)
    return out.view(*lead, top_k)


def _lowest_tied(scores: torch.Tensor, kth: torch.Tensor, k: int) -> torch.Tensor:
    """``[rows, k]`` positions: every entry ``> kth``, then the lowest positions ``== kth``."""
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(dim=-1, keepdim=True)  # >= 1: at least k entries are >= kth
    take = above | (tied & (torch.cumsum(tied, dim=-1) <= room))  # exactly k per row
    return take.nonzero()[:, 1].view(-1, k)


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


def indexer_topk_oracle(
    index_q: torch.Tensor,  # [T, Hi, Di] query per indexer head (rotated)
    index_w: torch.Tensor,  # [T, Hi] per-head weights
    index_k: torch.Tensor,  # [rows, Di] indexer key cache of one layer, addressed by location
    req_to_token: torch.Tensor,  # [N, max_ctx] int64 location of (request row, position)
    req_rows: torch.Tensor,  # [T] int64 request row of each query
    seq_lens: torch.Tensor,  # [T] int64 positions visible to each query (its position + 1)
    top_k: int,
    scale: float,
) -> torch.Tensor:  # [T, top_k] int32 positions, -1 padded
    """The slow, obvious form: one gathered score row per query, a stable sort of every row."""
    num_tokens = index_q.shape[0]
    if num_tokens == 0:
        return torch.empty(0, top_k, dtype=torch.int32, device=index_q.device)
    max_len = int(seq_lens.max())
    scores = indexer_scores_reference(
        index_q, index_w, index_k, req_to_token, req_rows, seq_lens, scale, max_len
    )
    return stable_topk_positions(scores, top_k)


def _request_scores(q, w, keys, seq_lens, scale) -> torch.Tensor:
    """Scores ``[t, L]`` of one request's queries ``q [t, Hi, Di]`` over its keys ``[L, Di]``."""
    dt = score_dtype(q.dtype)
    t, heads, dim = q.shape
    dots = torch.matmul(q.reshape(t * heads, dim).to(dt), keys.t()).view(t, heads, -1)  # [t, Hi, L]
    scores = torch.bmm(w.to(dt)[:, None, :], dots.mul_(scale).relu_())[:, 0]  # [t, L]
    visible = torch.arange(keys.shape[0], device=q.device)[None, :] < seq_lens[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def _grouped_topk(index_q, index_w, index_k, req_to_token, req_rows, seq_lens, top_k, scale) -> torch.Tensor:
    """Requests with a few queries each (decode, verify), all at once: each request's keys gathered
    once, its queries padded to the most any request has, one batched matmul per chunk of requests.

        queries [G, Tq, Hi, Di] x keys [G, L, Di] -> dots [G, Tq * Hi, L] -> scores [G * Tq, L]

    One query per request (a decode step) needs no regrouping: the queries are the groups.
    """
    dev, dt = index_q.device, score_dtype(index_q.dtype)
    num_tokens, heads, dim = index_q.shape
    rows, group, counts = torch.unique(req_rows, return_inverse=True, return_counts=True)
    if rows.numel() == num_tokens:
        q, w, lens = index_q.to(dt)[:, None], index_w.to(dt)[:, None], seq_lens[:, None]
        return _groups_topk(q, w, lens, index_k, req_to_token, req_rows, top_k, scale)[:, 0]
    by_group = torch.sort(group, stable=True).indices
    slot = torch.empty_like(group)
    slot[by_group] = (
        torch.arange(num_tokens, device=dev) - (torch.cumsum(counts, 0) - counts)[group[by_group]]
    )
    num_groups, width = rows.numel(), int(counts.max())
    q = index_q.new_zeros(num_groups, width, heads, dim, dtype=dt)
    q[group, slot] = index_q.to(dt)
    w = index_w.new_zeros(num_groups, width, heads, dtype=dt)
    w[group, slot] = index_w.to(dt)
    lens = seq_lens.new_zeros(num_groups, width)  # padding queries see nothing
    lens[group, slot] = seq_lens
    return _groups_topk(q, w, lens, index_k, req_to_token, rows, top_k, scale)[group, slot]


def _groups_topk(q, w, lens, index_k, req_to_token, rows, top_k, scale) -> torch.Tensor:
    """``[G, Tq, top_k]``: queries ``q [G, Tq, Hi, Di]`` (weights ``w [G, Tq, Hi]``, visible lengths
    ``lens [G, Tq]``, 0 = padding) of request rows ``rows [G]``, in chunks of requests."""
    dev = q.device
    num_groups, width, heads, dim = q.shape
    max_len = int(lens.max())
    seen = lens.amax(dim=1)  # [G] positions any query of the request sees: the keys it may read
    pos = torch.arange(max_len, device=dev)
    out = torch.empty(num_groups, width, top_k, dtype=torch.int32, device=dev)
    step = max(1, _SCORE_BUDGET // max(1, max_len * (width * heads + dim)))
    for g0 in range(0, num_groups, step):
        sl = slice(g0, g0 + step)
        locs = torch.where(pos < seen[sl, None], req_to_token[rows[sl], :max_len], 0)  # [g, L]
        g = locs.shape[0]
        # [g, L, Di]
        keys = index_k.index_select(0, locs.reshape(-1).long()).view(g, max_len, dim).to(q.dtype)
        dots = torch.bmm(q[sl].reshape(g, width * heads, dim), keys.transpose(1, 2))  # [g, Tq * Hi, L]
        dots = dots.view(g * width, heads, max_len).mul_(scale).relu_()
        scores = torch.bmm(w[sl].reshape(g * width, 1, heads), dots)[:, 0]  # [g * Tq, L]
        scores = scores.masked_fill(pos >= lens[sl].reshape(-1, 1), float("-inf"))
        out[sl] = topk_positions(scores, top_k).view(g, width, top_k)
    return out


def indexer_topk_reference(
    index_q: torch.Tensor,  # [T, Hi, Di] query per indexer head (rotated)
    index_w: torch.Tensor,  # [T, Hi] per-head weights
    index_k: torch.Tensor,  # [rows, Di] indexer key cache of one layer, addressed by location
    req_to_token: torch.Tensor,  # [N, max_ctx] location of (request row, position)
    req_rows: torch.Tensor,  # [T] int64 request row of each query
    seq_lens: torch.Tensor,  # [T] int64 positions visible to each query (its position + 1)
    top_k: int,
    scale: float,
    *,
    few=None,
    few_context: int = 0,
) -> torch.Tensor:  # [T, top_k] int32 positions, -1 padded
    """Torch reference: each request's keys are gathered once. A request with many queries
    (prefill), or the only request of the call, is scored by matmuls over its keys
    (``_request_topk``), several of them together where padding them to one shape costs little
    (``_group_pays``); the others all together by a batched matmul (``_grouped_topk``).

    ``few`` (same arguments and result as this function) takes the queries of the requests with at
    most ``MATMUL_MIN_QUERIES`` queries instead, the only request's included, and those of the
    requests whose queries see at most ``few_context`` positions however many they are (a short
    prompt's prefill): the compiled CPU loop (``impl="auto"`` on a CPU with numba), while long
    prompts' prefill stays on the matmuls."""
    num_tokens = index_q.shape[0]
    if num_tokens == 0:
        return torch.empty(0, top_k, dtype=torch.int32, device=index_q.device)
    if few is not None and (
        num_tokens <= MATMUL_MIN_QUERIES  # (the longest is read only where it can matter)
        or (few_context > 0 and int(seq_lens.max()) <= few_context)
    ):
        return few(index_q, index_w, index_k, req_to_token, req_rows, seq_lens, top_k, scale)
    if bool((req_rows == req_rows[0]).all()):  # one request (prefill or decode of a batch of one)
        return _request_topk(index_q, index_w, index_k, req_to_token[req_rows[0]], seq_lens, top_k, scale)
    few = few or _grouped_topk
    if num_tokens <= MATMUL_MIN_QUERIES:
        return few(index_q, index_w, index_k, req_to_token, req_rows, seq_lens, top_k, scale)
    out = torch.empty(num_tokens, top_k, dtype=torch.int32, device=index_q.device)
    row_ids, inverse, counts = torch.unique(req_rows, return_inverse=True, return_counts=True)
    is_many = counts > MATMUL_MIN_QUERIES
    if few_context > 0:  # and long enough contexts
        longest = torch.zeros_like(row_ids).scatter_reduce_(0, inverse, seq_lens, "amax")
        is_many &= longest > few_context
    many = row_ids[is_many]
    if many.numel() == 0:
        return few(index_q, index_w, index_k, req_to_token, req_rows, seq_lens, top_k, scale)
    few_queries = ~torch.isin(req_rows, many)
    if bool(few_queries.any()):
        idx = few_queries.nonzero()[:, 0]
        out[idx] = few(
            index_q[idx], index_w[idx], index_k, req_to_token, req_rows[idx], seq_lens[idx], top_k, scale
        )
    idx = (~few_queries).nonzero()[:, 0]  # the queries of the requests with many
    if _group_pays(seq_lens[idx], counts[is_many], index_q.shape[1]):
        out[idx] = _grouped_topk(
            index_q[idx], index_w[idx], index_k, req_to_token, req_rows[idx], seq_lens[idx], top_k, scale
        )
        return out
    for row in many.tolist():
        idx = (req_rows == row).nonzero()[:, 0]
        out[idx] = _request_topk(
            index_q[idx], index_w[idx], index_k, req_to_token[row], seq_lens[idx], top_k, scale
        )
    return out


def _group_pays(seq_lens: torch.Tensor, counts: torch.Tensor, heads: int) -> bool:
    """Several requests with many queries each (a batch of short prompts) are scored together,
    padded to the most queries and positions any of them has (``_grouped_topk``), when the padding
    at most doubles the dots and one request's padded dots fit a matmul chunk (``_SCORE_BUDGET``):
    one batched matmul per chunk of requests instead of calls per request. Long prompts keep
    ``_request_topk``, which chunks a request's queries."""
    if counts.numel() < 2:
        return False
    width, longest = int(counts.max()), int(seq_lens.max())
    if width * heads * longest > _SCORE_BUDGET:
        return False
    return counts.numel() * width * longest <= 2 * int(seq_lens.sum())


def _request_topk(index_q, index_w, index_k, locs, seq_lens, top_k, scale) -> torch.Tensor:
    """Queries of one request (``locs [max_ctx]``: its row of ``req_to_token``): its keys gathered
    once, then one matmul per chunk of at most ``_SCORE_BUDGET`` dots."""
    # [L, Di]
    keys = index_k.index_select(0, locs[: int(seq_lens.max())].long()).to(score_dtype(index_q.dtype))
    num_tokens, heads, _ = index_q.shape
    if num_tokens * heads * keys.shape[0] <= _SCORE_BUDGET:
        return topk_positions(_request_scores(index_q, index_w, keys, seq_lens, scale), top_k)
    out = torch.empty(num_tokens, top_k, dtype=torch.int32, device=index_q.device)
    chunk = max(1, _SCORE_BUDGET // max(1, heads * keys.shape[0]))
    for c in range(0, num_tokens, chunk):
        sl = slice(c, c + chunk)
        out[sl] = topk_positions(_request_scores(index_q[sl], index_w[sl], keys, seq_lens[sl], scale), top_k)
    return out


def _dequantized_keys(
    index_k: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    dtype: torch.dtype,
    max_seq_len: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys an FP8 key cache holds for the call's requests, dequantized to ``dtype``, as a key
    cache of its own: (keys ``[U * W, Di]``, its token table ``[U, W]``, each query's row of that
    table), ``U`` the distinct requests and ``W`` the most positions a query sees. Positions past
    a query's length are never read, so what their entries hold does not matter."""
    rows, local = torch.unique(req_rows, return_inverse=True)
    width = max(1, int(seq_lens.max()) if max_seq_len is None else max_seq_len)
    locs = req_to_token[rows, :width].reshape(-1).clamp(min=0).long()
    keys = kv_fp8.dequantize_keys(index_k.index_select(0, locs), dtype)
    table = torch.arange(locs.numel(), device=index_k.device).view(rows.numel(), width)
    return keys, table, local


def check_indexer_args(index_q, index_w, index_k, req_to_token, req_rows, seq_lens, top_k) -> None:
    """Shapes, dtypes, strides, devices (no synchronisation)."""
    check_tensor("index_q", index_q, ndim=3, dtype=FLOAT_DTYPES, contiguous_last=True)
    t, h, d = index_q.shape
    check_tensor("index_w", index_w, dtype=FLOAT_DTYPES, shape=(t, h), contiguous_last=True)
    if index_k.dtype == kv_fp8.STORAGE:  # an FP8 key cache
        check_tensor("index_k", index_k, shape=(None, kv_fp8.key_bytes(d)), contiguous_last=True)
    else:
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
    check: bool = True,
) -> torch.Tensor:  # [T, top_k] int32 positions in contract order, -1 padded
    """Indexer top-k with the tie-break contract; ``impl`` in ``"auto"|"torch"|"triton"|"numba"``.

    ``auto`` runs Triton when the tensors are on CUDA, not float64, and within ``TRITON_MAX_*``. On a CPU with
    numba, float32/64 tensors of one dtype and at most ``MAX_HEAD_DIMS`` head x dim products
    (``kernels.indexer_topk_numba``), it sends the queries of requests with few queries each (decode, verify),
    or with short contexts (``prefill_context``: a short prompt's prefill), to the compiled loop and the
    others (a long prompt's prefill) to the torch matmuls; the torch path otherwise. ``numba`` runs every
    query compiled. ``max_seq_len`` (>= every ``seq_lens`` value) spares the device->host read of
    ``seq_lens.max()``. ``validate=True`` checks the values the kernel trusts (synchronises on CUDA):
    ``req_rows`` are rows of ``req_to_token`` and ``seq_lens`` lie in ``[0, max_ctx]``; beyond them the kernel
    would read the next row's entries silently. ``check=False`` skips the shape/dtype/device checks of the
    arguments: for callers that built them themselves (the engine's attention backends), where the checks are
    per-call overhead only. An FP8 ``index_k`` (uint8) goes to ``kernels.indexer_fp8_triton`` where Triton
    runs (``auto`` on CUDA, ``triton``); elsewhere the keys the queries see are dequantized first.
    """
    if check:
        check_indexer_args(index_q, index_w, index_k, req_to_token, req_rows, seq_lens, top_k)
    if max_seq_len is not None and max_seq_len > req_to_token.shape[1]:
        raise ValueError(
            f"max_seq_len={max_seq_len} exceeds req_to_token's {req_to_token.shape[1]} positions"
        )
    if validate:
        check_index_range("req_rows", req_rows, req_to_token.shape[0])
        check_index_range("seq_lens", seq_lens, req_to_token.shape[1] + 1)
    _, heads, dim = index_q.shape
    fits = (
        index_q.dtype != torch.float64
        and index_k.dtype != torch.float64
        and top_k <= TRITON_MAX_TOP_K
        and heads <= TRITON_MAX_HEADS
        and dim <= TRITON_MAX_DIM
    )
    fp8 = index_k.dtype == kv_fp8.STORAGE  # an FP8 key cache
    if fp8 and index_q.shape[0] == 0:
        return torch.empty(0, top_k, dtype=torch.int32, device=index_q.device)
    if fp8 and not (
        impl in ("auto", "triton")
        and resolve_impl(impl, (index_q, index_k, req_to_token), triton_fits=fits) == "triton"
    ):  # not for the FP8 Triton kernel: the keys the queries see, dequantized, for the paths below
        keys, table, rows = _dequantized_keys(index_k, req_to_token, req_rows, seq_lens, index_q.dtype,
                                              max_seq_len)
        return indexer_topk(index_q, index_w, keys, table, rows, seq_lens, top_k, scale, impl=impl,
                            max_seq_len=max_seq_len, check=False)
    args = (index_q, index_w, index_k, req_to_token, req_rows, seq_lens, top_k, scale)
    if impl == "numba":
        from kernels import indexer_topk_numba as compiled

        if not compiled.fits(index_q, index_w, index_k):
            raise ValueError("impl='numba' needs CPU tensors of one dtype, float32 or float64")
        return compiled.indexer_topk_numba(*args)
    if impl == "auto" and index_q.device.type == "cpu":
        from kernels import indexer_topk_numba as compiled

        if compiled.fits(index_q, index_w, index_k) and compiled.pays(index_q):
            context = compiled.prefill_context(heads, dim)
            return indexer_topk_reference(*args, few=compiled.indexer_topk_numba, few_context=context)
    if resolve_impl(impl, (index_q, index_k, req_to_token), triton_fits=fits) == "torch":
        return indexer_topk_reference(*args)
    if fp8:  # the keys dequantized in the scores kernel's registers
        from kernels.indexer_fp8_triton import indexer_topk_fp8_triton as indexer_topk_triton
    else:
        from kernels.indexer_topk_triton import indexer_topk_triton

    if index_q.shape[0] == 0:
        return torch.empty(0, top_k, dtype=torch.int32, device=index_q.device)
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    return indexer_topk_triton(
        index_q, index_w, index_k, req_to_token, req_rows, seq_lens, top_k, scale, max_len
    )
