"""One layer's HiSparse decode or verify attention on a CPU as one compiled call, with numba.

``pipeline.hisparse.backend`` runs a decode (or verify) layer as five steps: write the new tokens' cache rows
and indexer keys, select each query's top-k positions (``kernels.indexer_topk``), resolve them to device
slots, loading misses from host (``kernels.swap_in``), and attend over the slots (``kernels.sparse_mla``). On
a CPU each step is already a compiled loop, but each is also a Python call with its own argument handling,
numpy views, result objects and counters: at batch 1 of a small model the glue costs several times the loops
(docs/performance-notes.md). ``attend`` here runs the same five steps as one call: the writes, then the very
same compiled loops (``indexer_topk_numba``, ``swap_in_numba``, ``sparse_mla_numba``, called from compiled
code), then the misses' row copies, then the attention. So the selections, the swap-in's state and counts and
the attention output are the ones the step-by-step path produces, bit for bit (the tests compare them).

A batch mixing dynamic residency's layouts (``attend_mixed``) runs the same steps in one call: the
HOT rows' tokens through the swap-in, the FULL rows' through their page table (``attend_paged``).

A verify whose steps do not all fit the hot region in one swap-in call (``complete`` False) stops
after the swap-in: the caller attends over the steps resolved so far and continues with the
step-by-step path (``HiSparseBackend``).

``fits`` says when the call can be made: CPU tensors, the queries, cache rows,
indexer keys and host rows of one float32/float64 dtype, and shapes for which ``impl="auto"`` sends
both the indexer and the attention to their compiled loops (``pays_for`` of each).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from kernels import indexer_topk_numba, sparse_mla_numba, swap_in_numba
from kernels.swap_in_policy import policy_code
from kernels.swap_in_result import SwapInResult

DTYPES = (torch.float32, torch.float64)

# the compiled loops this one calls (module globals, so that numba resolves them when it compiles)
_index_kernel = indexer_topk_numba._kernel
_mla_kernel = sparse_mla_numba._kernel
_swap_kernel = swap_in_numba._compiled_kernel()


def _jit():
    return numba.njit(cache=True, nogil=True)


@_jit()
def _write_and_select(  # pragma: no cover - compiled
    kv,
    keys,
    row_slots,
    key_locs,
    kv_rows,
    index_k,
    index_q,
    index_w,
    req_to_token,
    token_rows,
    lens,
    index_scale,
    top_k,
    top,
):
    """The new tokens' cache rows (at ``row_slots``) and indexer keys (at ``key_locs``), then every
    query's top-k positions into ``top`` by the indexer's compiled loop (which reads the new keys)."""
    for t in range(row_slots.shape[0]):
        kv[row_slots[t], :] = kv_rows[t, :]
        keys[key_locs[t], :] = index_k[t, :]
    _index_kernel(index_q, index_w, keys, req_to_token, token_rows, lens, index_scale, top_k, top)


@_jit()
def _attend(  # pragma: no cover - compiled
    kv_all,
    keys_all,
    tokens_all,
    lru_all,
    host_all,
    layer,
    write_slots,
    kv_rows,
    write_locs,
    index_k,
    index_q,
    index_w,
    req_to_token,
    token_rows,
    lens,
    index_scale,
    top_k,
    steps,
    locs,
    req_to_host,
    hot,
    policy,
    q_latent,
    q_rope,
    attn_scale,
    top,
    slots,
    counts,
    copy_src,
    copy_dst,
    out,
):
    kv = kv_all[layer]
    _write_and_select(
        kv,
        keys_all[layer],
        write_slots,
        write_locs,
        kv_rows,
        index_k,
        index_q,
        index_w,
        req_to_token,
        token_rows,
        lens,
        index_scale,
        top_k,
        top,
    )
    num_tokens = top.shape[0]
    batch = num_tokens // steps
    top3 = top.reshape((batch, steps, top_k))
    lens2 = lens.reshape((batch, steps))
    rows = np.empty(batch, np.int64)
    for b in range(batch):
        rows[b] = token_rows[b * steps]
    near = np.empty((batch, steps, 0), np.int32)
    copies, hits, misses, lost, complete = _swap_kernel(
        top3,
        lens2,
        rows,
        tokens_all[layer],
        locs,
        lru_all[layer],
        req_to_host,
        hot,
        policy,
        near,
        slots,
        counts,
        copy_src,
        copy_dst,
    )
    host = host_all[layer]
    for i in range(copies):
        kv[copy_dst[i], :] = host[copy_src[i], :]
    if complete:
        _mla_kernel(q_latent, q_rope, kv, slots.reshape((num_tokens, top_k)), attn_scale, out)
    return hits, misses, lost, complete


@_jit()
def _attend_resident(  # pragma: no cover - compiled
    kv_all,
    keys_all,
    layer,
    write_locs,
    kv_rows,
    index_k,
    index_q,
    index_w,
    req_to_token,
    token_rows,
    lens,
    index_scale,
    top_k,
    q_latent,
    q_rope,
    attn_scale,
    top,
    slots,
    out,
):
    kv = kv_all[layer]
    _write_and_select(
        kv,
        keys_all[layer],
        write_locs,
        write_locs,
        kv_rows,
        index_k,
        index_q,
        index_w,
        req_to_token,
        token_rows,
        lens,
        index_scale,
        top_k,
        top,
    )
    for t in range(top.shape[0]):  # positions -> locations (``positions_to_slots``)
        row = token_rows[t]
        for k in range(top_k):
            p = top[t, k]
            slots[t, k] = req_to_token[row, p] if p >= 0 else -1
    _mla_kernel(q_latent, q_rope, kv, slots, attn_scale, out)


@_jit()
def _attend_paged(  # pragma: no cover - compiled
    kv_all,
    keys_all,
    layer,
    write_slots,
    write_locs,
    kv_rows,
    index_k,
    index_q,
    index_w,
    req_to_token,
    token_rows,
    lens,
    index_scale,
    top_k,
    page_table,
    page_size,
    q_latent,
    q_rope,
    attn_scale,
    top,
    slots,
    out,
):
    kv = kv_all[layer]
    _write_and_select(
        kv,
        keys_all[layer],
        write_slots,
        write_locs,
        kv_rows,
        index_k,
        index_q,
        index_w,
        req_to_token,
        token_rows,
        lens,
        index_scale,
        top_k,
        top,
    )
    for t in range(top.shape[0]):  # positions -> slots through the row's pages
        row = token_rows[t]
        for k in range(top_k):
            p = top[t, k]
            slots[t, k] = page_table[row, p // page_size] * page_size + p % page_size if p >= 0 else -1
    _mla_kernel(q_latent, q_rope, kv, slots, attn_scale, out)


@_jit()
def _attend_mixed(  # pragma: no cover - compiled
    kv_all,
    keys_all,
    tokens_all,
    lru_all,
    host_all,
    layer,
    write_slots,
    kv_rows,
    write_locs,
    index_k,
    index_q,
    index_w,
    req_to_token,
    token_rows,
    lens,
    index_scale,
    top_k,
    steps,
    locs,
    req_to_host,
    hot,
    policy,
    page_table,
    page_size,
    hot_tokens,
    full_tokens,
    q_latent,
    q_rope,
    attn_scale,
    top,
    hot_top,
    hot_slots,
    slots,
    counts,
    copy_src,
    copy_dst,
    out,
):
    """``_attend`` of the HOT rows' tokens (``hot_tokens``) and ``_attend_paged`` of the FULL rows'
    (``full_tokens``) in one call: the writes and the selection of every token, the swap-in of the
    HOT tokens' selections (gathered request-major, as their own batch), the FULL tokens' slots
    through the page table, then one attention over every token."""
    kv = kv_all[layer]
    _write_and_select(
        kv,
        keys_all[layer],
        write_slots,
        write_locs,
        kv_rows,
        index_k,
        index_q,
        index_w,
        req_to_token,
        token_rows,
        lens,
        index_scale,
        top_k,
        top,
    )
    num_hot = hot_tokens.shape[0]
    batch = num_hot // steps
    hot_lens = np.empty((batch, steps), np.int64)
    rows = np.empty(batch, np.int64)
    for i in range(num_hot):
        t = hot_tokens[i]
        hot_top[i // steps, i % steps, :] = top[t, :]
        hot_lens[i // steps, i % steps] = lens[t]
    for b in range(batch):
        rows[b] = token_rows[hot_tokens[b * steps]]
    near = np.empty((batch, steps, 0), np.int32)
    copies, hits, misses, lost, complete = _swap_kernel(
        hot_top,
        hot_lens,
        rows,
        tokens_all[layer],
        locs,
        lru_all[layer],
        req_to_host,
        hot,
        policy,
        near,
        hot_slots,
        counts,
        copy_src,
        copy_dst,
    )
    host = host_all[layer]
    for i in range(copies):
        kv[copy_dst[i], :] = host[copy_src[i], :]
    for i in range(full_tokens.shape[0]):  # positions -> slots through the row's pages
        t = full_tokens[i]
        row = token_rows[t]
        for k in range(top_k):
            p = top[t, k]
            slots[t, k] = page_table[row, p // page_size] * page_size + p % page_size if p >= 0 else -1
    if complete:
        for i in range(num_hot):
            slots[hot_tokens[i], :] = hot_slots[i // steps, i % steps, :]
        _mla_kernel(q_latent, q_rope, kv, slots, attn_scale, out)
    return hits, misses, lost, complete


def fits(
    q_latent: torch.Tensor,
    kv: torch.Tensor,
    keys: torch.Tensor,
    index_q: torch.Tensor,
    host_kv: torch.Tensor,
    top_k: int,
) -> bool:
    """The one call can take this layer: CPU tensors of one float32/64 dtype (the
    host rows too), and shapes that ``impl="auto"`` sends to the compiled indexer and attention."""
    tensors = (q_latent, kv, keys, index_q, host_kv)
    dtype = q_latent.dtype
    return (
        dtype in DTYPES
        and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
        and indexer_topk_numba.pays_for(index_q.shape[1], index_q.shape[2])
        and sparse_mla_numba.pays_for(q_latent.shape[1], kv.shape[-1], top_k)
    )


class Pools:
    """The numpy views of a coordinator's per-layer pools and tables that every call reads, taken
    once (per forward: the tensors do not move within one)."""

    def __init__(
        self, device_kv, index_k, buffer_tokens, buffer_locs, lru, host_kv, req_to_token, req_to_host
    ):
        self.kv = device_kv.numpy()  # [L, rows, C + R]
        self.keys = index_k.numpy()  # [L, logical rows, Di]
        self.tokens = buffer_tokens.numpy()  # [L, N, HOT + P]
        self.locs = buffer_locs.numpy()  # [N, HOT + P]
        self.lru = lru.numpy()  # [L, N, HOT]
        self.host = host_kv.numpy()  # [L, host rows, C + R]
        self.req_to_token = req_to_token.numpy()
        self.req_to_host = req_to_host.numpy()
        self.row_bytes = device_kv.shape[-1] * device_kv.element_size()


class ForwardViews:
    """A forward's per-token tables as the call reads them, taken once for all its layers (the
    tensors of one forward do not change between its layers): the new tokens' device slots and
    indexer locations, each token's request row and visible positions, and the rows of its requests."""

    def __init__(
        self,
        write_slots: torch.Tensor,
        write_locs: torch.Tensor,
        token_rows: torch.Tensor,
        seq_lens: torch.Tensor,
        steps: int,
    ) -> None:
        self.write_slots = write_slots.numpy()
        self.write_locs = write_locs.numpy()
        self.token_rows = token_rows.numpy()
        self.seq_lens = seq_lens  # the tensor too: the caller reports a miss it could not place with it
        self.seq_lens_np = seq_lens.numpy()
        self.steps = steps


def attend(
    pools: Pools,
    layer: int,
    write_slots: torch.Tensor,  # [T] int64 device slot of each new token's cache row
    kv_rows: torch.Tensor,  # [T, C + R]
    write_locs: torch.Tensor,  # [T] int64 logical location of each new token's indexer key
    index_k: torch.Tensor,  # [T, Di]
    index_q: torch.Tensor,  # [T, Hi, Di]
    index_w: torch.Tensor,  # [T, Hi]
    token_rows: torch.Tensor,  # [T] int64 request row of each token, request-major
    seq_lens: torch.Tensor,  # [T] int64 positions each token sees
    index_scale: float,
    top_k: int,
    steps: int,  # tokens per request (1 decode, D verify)
    hot: int,
    policy: str,
    q_latent: torch.Tensor,  # [T, H, C]
    q_rope: torch.Tensor,  # [T, H, R]
    attn_scale: float,
) -> tuple[torch.Tensor | None, torch.Tensor, SwapInResult]:
    """The layer's writes, selection, swap-in and attention (module docstring; ``fits`` first).

    Returns ``(out [T, H, C] or None, top [T, K] int32, the swap-in's result)``, the result as the
    compiled swap-in gives it (``swap_in_numba``); ``out`` is None when the swap-in stopped before
    some step (its ``complete`` False): the caller attends over the resolved steps."""
    views = ForwardViews(write_slots, write_locs, token_rows, seq_lens, steps)
    return attend_views(
        pools,
        views,
        layer,
        kv_rows,
        index_k,
        index_q,
        index_w,
        index_scale,
        top_k,
        hot,
        policy_code(policy),
        q_latent,
        q_rope,
        attn_scale,
    )


def attend_views(
    pools: Pools,
    views: ForwardViews,
    layer: int,
    kv_rows: torch.Tensor,
    index_k: torch.Tensor,
    index_q: torch.Tensor,
    index_w: torch.Tensor,
    index_scale: float,
    top_k: int,
    hot: int,
    policy: int,
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    attn_scale: float,
) -> tuple[torch.Tensor | None, torch.Tensor, SwapInResult]:
    """``attend`` over a forward's tables taken once (``ForwardViews``) and a policy's code
    (``swap_in_policy.policy_code``): what a backend calls for each layer of one forward."""
    num_tokens = q_latent.shape[0]
    steps = views.steps
    batch = num_tokens // steps
    wide = np.float64 if q_latent.dtype == torch.float64 else np.float32
    top = np.empty((num_tokens, top_k), dtype=np.int32)
    slots = np.empty((batch, steps, top_k), dtype=np.int32)
    counts = np.zeros((batch, 4), dtype=np.int32)
    copy_src = np.empty(num_tokens * top_k, dtype=np.int64)
    copy_dst = np.empty(num_tokens * top_k, dtype=np.int64)
    q_latent_rows = q_latent.contiguous().numpy()
    out = np.empty(q_latent_rows.shape, dtype=q_latent_rows.dtype)
    hits, misses, lost, complete = _attend(
        pools.kv,
        pools.keys,
        pools.tokens,
        pools.lru,
        pools.host,
        layer,
        views.write_slots,
        kv_rows.contiguous().numpy(),
        views.write_locs,
        index_k.contiguous().numpy(),
        index_q.contiguous().numpy(),
        index_w.contiguous().numpy(),
        pools.req_to_token,
        views.token_rows,
        views.seq_lens_np,
        wide(index_scale),
        top_k,
        steps,
        pools.locs,
        pools.req_to_host,
        hot,
        policy,
        q_latent_rows,
        q_rope.contiguous().numpy(),
        wide(attn_scale),
        top,
        slots,
        counts,
        copy_src,
        copy_dst,
        out,
    )
    result = SwapInResult.from_arrays(
        slots, counts, row_bytes=pools.row_bytes, totals=(hits, misses, lost), complete=complete
    )
    return (torch.from_numpy(out) if complete else None), torch.from_numpy(top), result


def attend_resident(
    kv_all: np.ndarray,  # [L, rows, C + R] numpy view of the pool
    keys_all: np.ndarray,  # [L, rows, Di]
    layer: int,
    write_locs: torch.Tensor,  # [T] int64 location of each new token's rows
    kv_rows: torch.Tensor,  # [T, C + R]
    index_k: torch.Tensor,  # [T, Di]
    index_q: torch.Tensor,  # [T, Hi, Di]
    index_w: torch.Tensor,  # [T, Hi]
    req_to_token: torch.Tensor,  # [N, max_ctx] int64 locations
    token_rows: torch.Tensor,  # [T] int64
    seq_lens: torch.Tensor,  # [T] int64
    index_scale: float,
    top_k: int,
    q_latent: torch.Tensor,  # [T, H, C]
    q_rope: torch.Tensor,  # [T, H, R]
    attn_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An all-resident layer (``pipeline.model.resident.ResidentBackend``) in one call: the rows
    written at their locations, the indexer's top-k positions, their locations, sparse MLA. Returns
    ``(out [T, H, C], top [T, K] int32 positions)``."""
    num_tokens = q_latent.shape[0]
    wide = np.float64 if q_latent.dtype == torch.float64 else np.float32
    top = np.empty((num_tokens, top_k), dtype=np.int32)
    slots = np.empty((num_tokens, top_k), dtype=np.int64)
    out = torch.empty(q_latent.shape, dtype=q_latent.dtype)
    _attend_resident(
        kv_all,
        keys_all,
        layer,
        write_locs.numpy(),
        kv_rows.contiguous().numpy(),
        index_k.contiguous().numpy(),
        index_q.contiguous().numpy(),
        index_w.contiguous().numpy(),
        req_to_token.numpy(),
        token_rows.numpy(),
        seq_lens.numpy(),
        wide(index_scale),
        top_k,
        q_latent.contiguous().numpy(),
        q_rope.contiguous().numpy(),
        wide(attn_scale),
        top,
        slots,
        out.numpy(),
    )
    return out, torch.from_numpy(top)


def attend_paged(
    pools: Pools,
    views: ForwardViews,
    layer: int,
    kv_rows: torch.Tensor,  # [T, C + R]
    index_k: torch.Tensor,  # [T, Di]
    index_q: torch.Tensor,  # [T, Hi, Di]
    index_w: torch.Tensor,  # [T, Hi]
    index_scale: float,
    top_k: int,
    page_table: np.ndarray,  # [N, pages] int64 each row's device pages in position order
    page_size: int,
    q_latent: torch.Tensor,  # [T, H, C]
    q_rope: torch.Tensor,  # [T, H, R]
    attn_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer of rows whose every position has a device slot (dynamic residency's FULL rows) in one
    call: the new rows and keys written, the indexer's top-k positions, their slots through
    ``page_table``, sparse MLA. Returns ``(out [T, H, C], top [T, K] int32 positions)``."""
    num_tokens = q_latent.shape[0]
    wide = np.float64 if q_latent.dtype == torch.float64 else np.float32
    top = np.empty((num_tokens, top_k), dtype=np.int32)
    slots = np.empty((num_tokens, top_k), dtype=np.int64)
    out = torch.empty(q_latent.shape, dtype=q_latent.dtype)
    _attend_paged(
        pools.kv,
        pools.keys,
        layer,
        views.write_slots,
        views.write_locs,
        kv_rows.contiguous().numpy(),
        index_k.contiguous().numpy(),
        index_q.contiguous().numpy(),
        index_w.contiguous().numpy(),
        pools.req_to_token,
        views.token_rows,
        views.seq_lens_np,
        wide(index_scale),
        top_k,
        page_table,
        page_size,
        q_latent.contiguous().numpy(),
        q_rope.contiguous().numpy(),
        wide(attn_scale),
        top,
        slots,
        out.numpy(),
    )
    return out, torch.from_numpy(top)


def attend_mixed(
    pools: Pools,
    views: ForwardViews,
    layer: int,
    kv_rows: torch.Tensor,  # [T, C + R]
    index_k: torch.Tensor,  # [T, Di]
    index_q: torch.Tensor,  # [T, Hi, Di]
    index_w: torch.Tensor,  # [T, Hi]
    index_scale: float,
    top_k: int,
    hot: int,
    policy: int,
    page_table: np.ndarray,  # [N, pages] int64 the FULL rows' device pages in position order
    page_size: int,
    hot_tokens: np.ndarray,  # [T_hot] int64 the HOT rows' tokens, request-major (``steps`` a request)
    full_tokens: np.ndarray,  # [T_full] int64 the FULL rows' tokens
    q_latent: torch.Tensor,  # [T, H, C]
    q_rope: torch.Tensor,  # [T, H, R]
    attn_scale: float,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, SwapInResult]:
    """A layer of a batch mixing HOT rows (``attend_views``) and FULL rows (``attend_paged``) in one
    call. Returns ``(out [T, H, C] or None, top [T, K] int32, the HOT tokens' top-k [B_hot, steps,
    K], the swap-in's result over the HOT tokens)``; ``out`` is None when the swap-in stopped before
    some step (the caller goes on from the result)."""
    num_tokens = q_latent.shape[0]
    steps = views.steps
    num_hot = hot_tokens.shape[0]
    batch = num_hot // steps
    wide = np.float64 if q_latent.dtype == torch.float64 else np.float32
    top = np.empty((num_tokens, top_k), dtype=np.int32)
    hot_top = np.empty((batch, steps, top_k), dtype=np.int32)
    hot_slots = np.empty((batch, steps, top_k), dtype=np.int32)
    slots = np.empty((num_tokens, top_k), dtype=np.int32)
    counts = np.zeros((batch, 4), dtype=np.int32)
    copy_src = np.empty(num_hot * top_k, dtype=np.int64)
    copy_dst = np.empty(num_hot * top_k, dtype=np.int64)
    q_latent_rows = q_latent.contiguous().numpy()
    out = np.empty(q_latent_rows.shape, dtype=q_latent_rows.dtype)
    hits, misses, lost, complete = _attend_mixed(
        pools.kv,
        pools.keys,
        pools.tokens,
        pools.lru,
        pools.host,
        layer,
        views.write_slots,
        kv_rows.contiguous().numpy(),
        views.write_locs,
        index_k.contiguous().numpy(),
        index_q.contiguous().numpy(),
        index_w.contiguous().numpy(),
        pools.req_to_token,
        views.token_rows,
        views.seq_lens_np,
        wide(index_scale),
        top_k,
        steps,
        pools.locs,
        pools.req_to_host,
        hot,
        policy,
        page_table,
        page_size,
        hot_tokens,
        full_tokens,
        q_latent_rows,
        q_rope.contiguous().numpy(),
        wide(attn_scale),
        top,
        hot_top,
        hot_slots,
        slots,
        counts,
        copy_src,
        copy_dst,
        out,
    )
    result = SwapInResult.from_arrays(
        hot_slots, counts, row_bytes=pools.row_bytes, totals=(hits, misses, lost), complete=complete
    )
    done = torch.from_numpy(out) if complete else None
    return done, torch.from_numpy(top), torch.from_numpy(hot_top), result


def warm_up(dtype: torch.dtype = torch.float32) -> None:
    """Compile (or load from numba's disk cache) the call for ``dtype``, with the argument types a
    run gives it (int64 token tables, contiguous inputs)."""
    if dtype not in DTYPES:
        return
    rows, dim, idim = 4, 3, 2
    pools = Pools(
        torch.zeros(1, rows, dim, dtype=dtype),
        torch.zeros(1, rows, idim, dtype=dtype),
        torch.tensor([[[0, -1]]], dtype=torch.int32),
        torch.tensor([[1, -1]], dtype=torch.int64),
        torch.zeros(1, 1, 1, dtype=torch.int32),
        torch.zeros(1, 2, dim, dtype=dtype),
        torch.tensor([[0, 2]], dtype=torch.int64),
        torch.zeros(1, 2, dtype=torch.int64),
    )
    one = torch.zeros(1, dtype=torch.int64)
    attend(
        pools,
        0,
        one + 3,
        torch.zeros(1, dim, dtype=dtype),
        one + 2,
        torch.zeros(1, idim, dtype=dtype),
        torch.zeros(1, 1, idim, dtype=dtype),
        torch.zeros(1, 1, dtype=dtype),
        one,
        one + 1,
        1.0,
        1,
        1,
        1,
        "lru",
        torch.zeros(1, 1, dim - 1, dtype=dtype),
        torch.zeros(1, 1, 1, dtype=dtype),
        1.0,
    )
    views = ForwardViews(one + 3, one + 2, one, one + 1, 1)
    attend_paged(
        pools,
        views,
        0,
        torch.zeros(1, dim, dtype=dtype),
        torch.zeros(1, idim, dtype=dtype),
        torch.zeros(1, 1, idim, dtype=dtype),
        torch.zeros(1, 1, dtype=dtype),
        1.0,
        1,
        np.zeros((1, 2), dtype=np.int64),
        2,
        torch.zeros(1, 1, dim - 1, dtype=dtype),
        torch.zeros(1, 1, 1, dtype=dtype),
        1.0,
    )
    attend_mixed(
        pools,
        ForwardViews(one.repeat(2) + 3, one.repeat(2) + 2, one.repeat(2), one.repeat(2) + 1, 1),
        0,
        torch.zeros(2, dim, dtype=dtype),
        torch.zeros(2, idim, dtype=dtype),
        torch.zeros(2, 1, idim, dtype=dtype),
        torch.zeros(2, 1, dtype=dtype),
        1.0,
        1,
        1,
        policy_code("lru"),
        np.zeros((1, 2), dtype=np.int64),
        2,
        np.array([0], dtype=np.int64),
        np.array([1], dtype=np.int64),
        torch.zeros(2, 1, dim - 1, dtype=dtype),
        torch.zeros(2, 1, 1, dtype=dtype),
        1.0,
    )
    attend_resident(
        pools.kv,
        pools.keys,
        0,
        one + 1,
        torch.zeros(1, dim, dtype=dtype),
        torch.zeros(1, idim, dtype=dtype),
        torch.zeros(1, 1, idim, dtype=dtype),
        torch.zeros(1, 1, dtype=dtype),
        torch.tensor([[1, 2]]),
        one,
        one + 1,
        1.0,
        1,
        torch.zeros(1, 1, dim - 1, dtype=dtype),
        torch.zeros(1, 1, 1, dtype=dtype),
        1.0,
    )
