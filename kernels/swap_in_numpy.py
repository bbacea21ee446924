"""Swap-in on a CPU for a whole batch at once: the contract of ``kernels.swap_in`` in numpy.

The torch reference spends a decode step of a CPU engine in per-op overhead (a few microseconds per
tiny tensor op, a few hundred ops per call); the plain-Python version pays per request. This one
runs the same stages as the reference, vectorised over requests with a loop over steps only, on
numpy views of the CPU tensors (no copy in, writes go straight to the tables), where a small op
costs about a microsecond:

    entries --stable row sort--> first occurrences --> draft-column compare [B, K, P]
    position -> hot column table [B, L] (built once per call, updated on loads) --> hits
    --> misses, ranked in order of first appearance
    LRU positions --class per position, stable sort--> new order; the m-th miss takes the m-th
                                                        victim (old LRU order; the policy's choice)

Requests whose step overflows are frozen for the rest of the call. Every row copy of the call goes
through one torch ``index_copy_`` at the end (destinations are distinct within a call), so
``device_kv`` may have any dtype and ``host_kv`` may live elsewhere. ``swap_in(impl="auto")`` picks
this on CPU for all but calls of a few requests when the compiled implementation cannot run
(numba missing, or a policy other than LRU; ``kernels.swap_in.cpu_impl``).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from kernels.swap_in_policy import FAR, KEY_SHIFT
from kernels.swap_in_result import SwapInResult

# LRU position classes, in the order of the new LRU (least recent first)
_KEPT, _PROTECTED, _LOADED, _HIT = 0, 1, 2, 3


@attrs.define(eq=False)
class _State:
    """Working copies of the batch's rows of the per-layer tables (numpy, int64), and the call's
    bookkeeping."""

    tokens: np.ndarray  # [B, HOT+P] position held by each column, -1 empty
    column_of: np.ndarray | None  # [B, L+1] hot column of each position < L (see _column_table)
    locs: np.ndarray  # [B, HOT+P] physical slot of each column
    order: np.ndarray  # [B, HOT] hot columns, least recent first
    host: np.ndarray  # [N, max_ctx] req_to_host (the full table, read through rows)
    rows: np.ndarray  # [B] request rows
    b_idx: np.ndarray  # [B, 1] arange, to index rows of [B, ...] arrays
    protected: np.ndarray  # [B, HOT] bool by column: returned by an earlier step of this call
    frozen: np.ndarray  # [B] bool: stopped at an earlier step
    counts: np.ndarray  # [B, 4] steps_done, hits, misses, unrecoverable
    copy_src: list[np.ndarray]  # host slots to copy, per step
    copy_dst: list[np.ndarray]  # their device slots
    policy: str = "lru"  # kernels.swap_in_policy


def _first_occurrence(pos: np.ndarray, b_idx: np.ndarray) -> np.ndarray:
    """``[B, K]`` -> index of the first entry of each row holding the same value."""
    b, k = pos.shape
    perm = np.argsort(pos, axis=1, kind="stable")  # equal values keep their index order
    ranked = pos[b_idx, perm]
    starts = np.ones((b, k), dtype=bool)
    starts[:, 1:] = ranked[:, 1:] != ranked[:, :-1]
    group_start = np.maximum.accumulate(np.where(starts, np.arange(k), 0), axis=1)  # sorted index
    first = np.empty_like(perm)
    first[b_idx, perm] = perm[b_idx, group_start]
    return first


def _draft_lookup(pos, tokens, locs, hot, b_idx):
    """First newest/draft column holding each position: (found [B, K] bool, slot [B, K])."""
    xt, xl = tokens[:, hot:], locs[:, hot:]  # [B, P]
    match = (pos[:, :, None] == xt[:, None, :]) & (xl >= 0)[:, None, :]  # [B, K, P]
    return match.any(axis=2), xl[b_idx, match.argmax(axis=2)]


def _as_index(pos: np.ndarray, width: int) -> np.ndarray:
    """Positions as indices of a ``width + 1`` table: every non-position goes to the last entry."""
    return np.where((pos >= 0) & (pos < width), pos, width)


def _column_table(tokens: np.ndarray, hot: int, width: int, b_idx: np.ndarray) -> np.ndarray:
    """``[B, width + 1]`` hot column holding each position (-1 none); the last entry, standing for
    every non-position, stays -1. Hot tokens are unique per request, so no two columns collide."""
    table = np.full((tokens.shape[0], width + 1), -1, dtype=np.int64)
    table[b_idx, _as_index(tokens[:, :hot], width)] = np.arange(hot)
    table[:, width] = -1
    return table


def _fast_step(st: _State, pos, valid, is_first, found, draft_slot, fast, hot):
    """Fast path (n <= hot) for the rows in ``fast``: slots [B, K]; updates counters and protection."""
    ident = np.clip(pos, 0, hot - 1)
    ident_loc = st.locs[st.b_idx, ident]
    use_ident = valid & fast[:, None] & (ident_loc >= 0)
    slots = np.where(use_ident, ident_loc, np.where(found, draft_slot, -1))
    b, k = np.nonzero(use_ident)
    st.protected[b, ident[b, k]] = True
    counted = is_first & fast[:, None]
    st.counts[:, 1] += (counted & (slots >= 0)).sum(1)
    st.counts[:, 3] += (counted & (slots < 0)).sum(1)
    return slots


def _near_keep(tok, pos, valid, near, n):
    """[B, HOT]: the LRU position holds a selected or a near position of the step."""
    keep = ((tok[:, :, None] == pos[:, None, :]) & valid[:, None, :]).any(axis=2)
    if near is not None:
        close = (near >= 0) & (near < n[:, None])
        keep |= ((tok[:, :, None] == near[:, None, :]) & close[:, None, :]).any(axis=2)
    return keep.astype(np.int64)


def _victims(st: _State, pos, valid, want_first, evict, evict_rank, num_load, near, n):
    """[B, HOT] by LRU position: the evictable columns the policy gives this step's loads."""
    if st.policy == "lru":
        return evict & (evict_rank < num_load[:, None])
    hot = st.order.shape[1]
    tok = st.tokens[st.b_idx, st.order]  # [B, HOT] position of each LRU position
    if st.policy == "near":
        prio = _near_keep(tok, pos, valid, near, n)
    else:
        below = valid[:, None, :] & (pos[:, None, :] < tok[:, :, None])  # [B, HOT, K]
        nearest = np.where(below, pos[:, None, :], -1).max(axis=2)
        d = np.where(nearest >= 0, tok - nearest, FAR)
        prio = np.where(d > hot, 0, 1 + hot - d) if st.policy == "slide-lru" else FAR - d
    if st.policy in ("adaptive", "near-adaptive"):  # slide's keys where the selection slid, else LRU's / near's
        recent = tok[:, max(0, hot - pos.shape[1]) :]  # the K most recently used columns
        recent = np.where(recent >= 0, recent, -2)  # -2 matches no position and no position - 1
        slid = ((pos[:, :, None] - 1) == recent[:, None, :]).any(axis=2) & want_first
        stayed = (pos[:, :, None] == recent[:, None, :]).any(axis=2) & want_first
        other = 0 if st.policy == "adaptive" else _near_keep(tok, pos, valid, near, n)
        prio = np.where((slid.sum(1) > stayed.sum(1))[:, None], prio, other)
    key = np.where(evict, (prio << KEY_SHIFT) | np.arange(hot), np.iinfo(np.int64).max)
    rank = np.empty_like(key)
    rank[st.b_idx, np.argsort(key, axis=1, kind="stable")] = np.arange(hot)
    return evict & (rank < num_load[:, None])


def _long_step(st: _State, pos, valid, first, is_first, found, draft_slot, long, step, near, n):
    """Long path (n > hot) for the rows in ``long``: slots [B, K] (-1 for rows that overflow)."""
    hot, width, bi = st.order.shape[1], st.column_of.shape[1] - 1, st.b_idx
    wanted = valid & long[:, None] & ~found
    hit_col = st.column_of[bi, _as_index(np.where(wanted, pos, -1), width)]  # [B, K]
    hit = hit_col >= 0
    need = wanted & ~hit
    host_slot = st.host[st.rows[:, None], np.clip(pos, 0, st.host.shape[1] - 1)]
    load = need & (host_slot >= 0)
    load_first = load & is_first
    rank = (np.cumsum(load_first, axis=1) - load_first)[bi, first]  # miss order of each entry
    num_load = load_first.sum(1)

    col_hit = np.zeros_like(st.protected)
    b, k = np.nonzero(hit)
    col_hit[b, hit_col[b, k]] = True
    lru_hit = col_hit[bi, st.order]  # [B, HOT] by LRU position
    lru_prot = st.protected[bi, st.order] & ~lru_hit
    evict = ~lru_hit & ~lru_prot
    num_evict = evict.sum(1)
    overflow = long & (num_load > num_evict)
    apply = long & ~overflow
    evict_rank = np.cumsum(evict, axis=1) - evict
    victim = _victims(st, pos, valid, wanted & is_first, evict, evict_rank, num_load, near, n)
    cls = np.where(lru_hit, _HIT, np.where(lru_prot, _PROTECTED, np.where(victim, _LOADED, _KEPT)))
    moved = st.order[bi, np.argsort(cls.astype(np.int8), axis=1, kind="stable")]
    order = np.where(apply[:, None], moved, st.order)  # rows not applied keep their order
    # the loaded block of the new order holds the victims, in old LRU order
    start = num_evict - num_load + lru_prot.sum(1)
    victim_col = order[bi, np.clip(start[:, None] + rank, 0, hot - 1)]
    victim_loc = st.locs[bi, victim_col]
    slots = np.where(found, draft_slot, np.where(hit, st.locs[bi, hit_col], np.where(load, victim_loc, -1)))

    applied = apply[:, None]
    b, k = np.nonzero(load_first & applied)
    cols, new = victim_col[b, k], pos[b, k]
    st.column_of[b, _as_index(st.tokens[b, cols], width)] = -1  # evicted positions (never wanted)
    st.column_of[b, new] = cols
    st.column_of[:, width] = -1
    st.tokens[b, cols] = new
    st.order = order
    st.copy_src.append(host_slot[b, k])
    st.copy_dst.append(victim_loc[b, k])
    b, k = np.nonzero((hit | load) & applied)
    st.protected[b, np.where(hit, hit_col, victim_col)[b, k]] = True
    counted = is_first & applied
    st.counts[:, 1] += (counted & (found | hit)).sum(1)
    st.counts[:, 2] += np.where(apply, num_load, 0)
    st.counts[:, 3] += (counted & need & (host_slot < 0)).sum(1)
    st.counts[overflow, 0] = step
    st.frozen |= overflow
    return np.where(applied, slots, -1)


def _step(st: _State, pos: np.ndarray, n: np.ndarray, hot: int, step: int, near: np.ndarray | None) -> np.ndarray:
    """One step for every request of the batch: slots [B, K]; mutates ``st``."""
    run = (n > 0) & ~st.frozen
    if not run.any():
        return np.full(pos.shape, -1, dtype=np.int64)
    valid = (pos >= 0) & (pos < n[:, None]) & run[:, None]
    first = _first_occurrence(pos, st.b_idx)
    is_first = valid & (first == np.arange(pos.shape[1]))
    found, draft_slot = _draft_lookup(pos, st.tokens, st.locs, hot, st.b_idx)
    found &= valid
    fast, long = run & (n <= hot), run & (n > hot)
    slots = np.full(pos.shape, -1, dtype=np.int64)
    if fast.any():
        slots = np.where(fast[:, None], _fast_step(st, pos, valid, is_first, found, draft_slot, fast, hot), slots)
    if long.any():
        slots = np.where(long[:, None],
                         _long_step(st, pos, valid, first, is_first, found, draft_slot, long, step, near, n), slots)
    return np.where(valid, slots, -1)


def swap_in_numpy(
    top_k_pos: torch.Tensor,  # [B, S, K] int32
    seq_lens: torch.Tensor,  # [B, S] int64
    req_rows: torch.Tensor,  # [B] int64
    buffer_tokens: torch.Tensor,  # [N, HOT+P] int32, mutated
    buffer_locs: torch.Tensor,  # [N, HOT+P] int64
    lru: torch.Tensor,  # [N, HOT] int32, mutated
    req_to_host: torch.Tensor,  # [N, max_ctx] int64
    host_kv: torch.Tensor,  # [host_rows, dim]
    device_kv: torch.Tensor,  # [dev_rows, dim], mutated
    hot: int,
    policy: str = "lru",
    near: torch.Tensor | None = None,  # [B, S, M] int32, -1 = none
) -> SwapInResult:
    """CPU implementation of ``kernels.swap_in.swap_in`` (no argument checks: call ``swap_in``)."""
    num_reqs, num_steps, top_k = top_k_pos.shape
    row_bytes = device_kv.shape[-1] * device_kv.element_size()
    tokens_np, lru_np = buffer_tokens.numpy(), lru.numpy()  # views: writes land in the tensors
    rows = req_rows.numpy()
    top, lens = top_k_pos.numpy().astype(np.int64), seq_lens.numpy()
    close = near.numpy().astype(np.int64) if near is not None else None
    tokens = tokens_np[rows].astype(np.int64)
    b_idx = np.arange(num_reqs)[:, None]
    # only the long path looks positions up in the hot columns
    is_long = bool((lens > hot).any())
    st = _State(
        tokens=tokens,
        column_of=_column_table(tokens, hot, int(lens.max()), b_idx) if is_long else None,
        locs=buffer_locs.numpy()[rows],
        order=lru_np[rows].astype(np.int64),
        host=req_to_host.numpy(),
        rows=rows,
        b_idx=b_idx,
        protected=np.zeros((num_reqs, hot), dtype=bool),
        frozen=np.zeros(num_reqs, dtype=bool),
        counts=np.zeros((num_reqs, 4), dtype=np.int64),
        copy_src=[],
        copy_dst=[],
        policy=policy,
    )
    st.counts[:, 0] = num_steps
    slots = np.empty((num_reqs, num_steps, top_k), dtype=np.int32)
    for s in range(num_steps):
        slots[:, s] = _step(st, top[:, s], lens[:, s], hot, s, None if close is None else close[:, s])
    if num_reqs:
        tokens_np[rows] = st.tokens
        lru_np[rows] = st.order
    src = np.concatenate(st.copy_src) if st.copy_src else np.empty(0, dtype=np.int64)
    if src.size:
        dst = torch.from_numpy(np.concatenate(st.copy_dst))
        device_kv.index_copy_(0, dst, host_kv.index_select(0, torch.from_numpy(src).to(host_kv.device)))
    return SwapInResult.from_arrays(slots, st.counts, row_bytes=row_bytes)
