"""Torch reference of swap-in (contract: ``kernels.swap_in``), vectorised over requests.

Steps run one after another (each sees the state the previous one left); within a step every request
of the batch is handled at once with masks, in the same stages as the Triton kernel:

    entries --dedup--> draft-column lookup --> hot-column lookup (sort + searchsorted) --> misses
    misses --rank--> victims (the policy's choice of evictables; ``near``: the step's near row)
           --> new LRU order (one scatter)

A request whose step overflows (more loadable misses than evictable columns) is frozen: the step and
the rest of the call leave its state untouched. Row copies are gathered into one host->device copy
at the end: within one call every destination slot is distinct (a loaded column is protected for the
rest of the call, and requests own disjoint slots), so their order does not matter.
"""

from __future__ import annotations

import attrs
import torch

from kernels.swap_in_policy import FAR, KEY_SHIFT
from kernels.swap_in_result import SwapInResult


@attrs.define(eq=False)
class _BatchState:
    """Working copies of the batch's rows of the per-layer tables."""

    tokens: torch.Tensor  # [B, HOT+P] int64 position held by each column
    locs: torch.Tensor  # [B, HOT+P] int64 physical slot of each column
    order: torch.Tensor  # [B, HOT] int64 LRU order of the hot columns, least recent first
    host: torch.Tensor  # [B, max_ctx] int64 host slot of each position
    protected: torch.Tensor  # [B, HOT] bool by column: returned by an earlier step of this call


@attrs.frozen(eq=False)
class _StepOut:
    slots: torch.Tensor  # [B, K] int64
    counts: torch.Tensor  # [B, 3] int64 hits, misses, unrecoverable
    overflow: torch.Tensor  # [B] bool: stop before this step
    copy_src: torch.Tensor  # [M] int64 host slots
    copy_dst: torch.Tensor  # [M] int64 device slots


def first_occurrence(pos: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` -> index of the first entry of each row holding the same value (``[B, K]`` int64)."""
    b, k = pos.shape
    sorted_pos, perm = torch.sort(pos, dim=1, stable=True)  # equal values keep their index order
    starts = torch.ones_like(sorted_pos, dtype=torch.bool)
    starts[:, 1:] = sorted_pos[:, 1:] != sorted_pos[:, :-1]
    j = torch.arange(k, device=pos.device).expand(b, k)
    group_start = torch.where(starts, j, 0).cummax(dim=1).values  # sorted index of the group's first
    return torch.empty_like(perm).scatter_(1, perm, perm.gather(1, group_start))


def _exclusive_cumsum(mask: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(mask, dim=1) - mask.long()


def _draft_lookup(pos, tokens, locs, hot):
    """First newest/draft column holding each position: (found [B, K] bool, slot [B, K] int64)."""
    xt, xl = tokens[:, hot:], locs[:, hot:]  # [B, P]
    match = (pos[:, :, None] == xt[:, None, :]) & (xl >= 0)[:, None, :]  # [B, K, P]
    col = match.int().argmax(dim=-1)  # first match
    return match.any(dim=-1), xl.gather(1, col)


def _hot_lookup(pos, wanted, col_tok):
    """Which LRU position holds each wanted entry (hot tokens are unique per request).

    Returns (hit [B, K] bool, at [B, K] int64 LRU index where hit, col_hit [B, HOT] bool).
    """
    b, hot = col_tok.shape
    base = torch.arange(b, device=pos.device)[:, None] << 32  # keeps requests apart in one sort
    col_key = torch.where(col_tok >= 0, base + col_tok, -1).flatten()
    sorted_key, sorted_at = torch.sort(col_key)
    query = torch.where(wanted, base + pos, -2).flatten()
    at = torch.searchsorted(sorted_key, query).clamp(max=b * hot - 1)
    hit = (sorted_key[at] == query).view_as(pos) & wanted
    flat_at = sorted_at[at].view_as(pos)  # b * HOT + LRU index
    col_hit = torch.zeros(b * hot, dtype=torch.bool, device=pos.device)
    col_hit[flat_at[hit]] = True
    return hit, flat_at % hot, col_hit.view(b, hot)


def _lru_dest(evict, victim, protu, hit, num_load, apply):
    """Destination LRU index of each current LRU position: [evict kept | protected | loaded | hits]."""
    e = evict.sum(1, keepdim=True)
    pu = protu.sum(1, keepdim=True)
    ld = num_load[:, None]
    dest = torch.where(
        victim,
        e - ld + pu + _exclusive_cumsum(victim),
        torch.where(
            evict,
            _exclusive_cumsum(evict & ~victim),
            torch.where(protu, e - ld + _exclusive_cumsum(protu), e + pu + _exclusive_cumsum(hit)),
        ),
    )
    identity = torch.arange(evict.shape[1], device=evict.device).expand_as(dest)
    return torch.where(apply[:, None], dest, identity)  # rows not applied keep their order


def _mark(mask2d, rows, cols, where):
    mask2d[rows[where], cols[where]] = True


@attrs.frozen(eq=False)
class _LongPlan:
    """The long path's decisions for one step, before anything is applied (all [B, K] unless noted)."""

    hit: torch.Tensor  # entry held by a hot column
    hit_col: torch.Tensor  # that column
    need: torch.Tensor  # wanted from the hot columns and not held
    host_slot: torch.Tensor  # host slot of the entry's position
    load: torch.Tensor  # need & has a host copy (every duplicate)
    load_first: torch.Tensor  # load, first occurrence only
    num_load: torch.Tensor  # [B]
    overflow: torch.Tensor  # [B] more loads than evictable columns: stop before this step
    apply: torch.Tensor  # [B] long-path rows that fit
    new_order: torch.Tensor  # [B, HOT] LRU order after the step (rows not applied unchanged)
    victim_col: torch.Tensor  # column a loaded entry goes to
    victim_loc: torch.Tensor  # its physical slot


def _near_keep(tok, pos, valid, near, n):
    """[B, HOT]: the LRU position holds a selected or a near position of the step."""
    keep = ((tok[:, :, None] == pos[:, None, :]) & valid[:, None, :]).any(dim=2)
    if near is not None:
        close = (near >= 0) & (near < n[:, None])
        keep |= ((tok[:, :, None] == near[:, None, :]) & close[:, None, :]).any(dim=2)
    return keep.long()


def _victims(policy, pos, valid, want_first, tok, evict, num_load, near, n):
    """[B, HOT] by LRU position: the evictable columns the policy gives this step's loads."""
    hot = evict.shape[1]
    if policy == "lru":
        return evict & (_exclusive_cumsum(evict) < num_load[:, None])
    if policy == "near":
        prio = _near_keep(tok, pos, valid, near, n)
    else:
        below = valid[:, None, :] & (pos[:, None, :] < tok[:, :, None])  # [B, HOT, K]
        nearest = torch.where(below, pos[:, None, :], -1).amax(dim=2)
        d = torch.where(nearest >= 0, tok - nearest, FAR)
        prio = torch.where(d > hot, 0, 1 + hot - d) if policy == "slide-lru" else FAR - d
    if policy in ("adaptive", "near-adaptive"):  # slide's keys where the selection slid, else LRU's / near's
        recent = tok[:, max(0, hot - pos.shape[1]) :]  # the K most recently used columns
        recent = torch.where(recent >= 0, recent, -2)  # -2 matches no position and no position - 1
        slid = ((pos[:, :, None] - 1) == recent[:, None, :]).any(dim=2) & want_first
        stayed = (pos[:, :, None] == recent[:, None, :]).any(dim=2) & want_first
        other = 0 if policy == "adaptive" else _near_keep(tok, pos, valid, near, n)
        prio = torch.where((slid.sum(1) > stayed.sum(1))[:, None], prio, other)
    index = torch.arange(hot, device=tok.device)
    key = torch.where(evict, (prio << KEY_SHIFT) | index, torch.iinfo(torch.int64).max)
    rank = torch.empty_like(key).scatter_(1, torch.argsort(key, dim=1, stable=True), index.expand_as(key))
    return evict & (rank < num_load[:, None])


def _long_plan(
    st: _BatchState, pos, valid, first, is_first, x_found, long, hot, policy, near, n
) -> _LongPlan:
    wanted = valid & long[:, None] & ~x_found
    hit, hit_at, col_hit = _hot_lookup(pos, wanted, st.tokens.gather(1, st.order))
    col_prot = st.protected.gather(1, st.order)  # [B, HOT] by LRU position
    need = wanted & ~hit
    host_slot = st.host.gather(1, pos.clamp(0, st.host.shape[1] - 1))
    load = need & (host_slot >= 0)
    load_first = load & is_first
    rank = _exclusive_cumsum(load_first).gather(1, first)  # miss order of each entry's position
    num_load = load_first.sum(1)
    evict = ~col_hit & ~col_prot
    protu = ~col_hit & col_prot
    overflow = long & (num_load > evict.sum(1))
    apply = long & ~overflow
    victim = _victims(
        policy, pos, valid, wanted & is_first, st.tokens.gather(1, st.order), evict, num_load, near, n
    )
    dest = _lru_dest(evict, victim, protu, col_hit, num_load, apply)
    new_order = torch.empty_like(st.order).scatter_(1, dest, st.order)
    victim_at = (evict.sum(1) - num_load + protu.sum(1))[:, None] + rank  # loaded block, miss order
    victim_col = new_order.gather(1, victim_at.clamp(0, hot - 1))
    return _LongPlan(
        hit,
        st.order.gather(1, hit_at),
        need,
        host_slot,
        load,
        load_first,
        num_load,
        overflow,
        apply,
        new_order,
        victim_col,
        st.locs.gather(1, victim_col),
    )


def _step(
    st: _BatchState,
    pos: torch.Tensor,
    n: torch.Tensor,
    active: torch.Tensor,
    hot: int,
    policy: str,
    near: torch.Tensor | None = None,
) -> _StepOut:
    """One step for every request of the batch; mutates ``st`` for the requests it resolves."""
    b, k = pos.shape
    rows = torch.arange(b, device=pos.device)[:, None].expand(b, k)
    run = active & (n > 0)
    valid = (pos >= 0) & (pos < n[:, None]) & run[:, None]  # [B, K]
    first = first_occurrence(pos)
    is_first = valid & (first == torch.arange(k, device=pos.device))
    x_found, x_slot = _draft_lookup(pos, st.tokens, st.locs, hot)
    x_found &= valid
    fast = run & (n <= hot)

    # fast path: identity column (t < n <= hot), else the newest/draft columns
    id_loc = st.locs.gather(1, pos.clamp(0, hot - 1))
    use_id = valid & fast[:, None] & (id_loc >= 0)
    fast_slot = torch.where(use_id, id_loc, torch.where(x_found, x_slot, -1))

    lp = _long_plan(st, pos, valid, first, is_first, x_found, run & (n > hot), hot, policy, near, n)
    long_slot = torch.where(
        x_found,
        x_slot,
        torch.where(lp.hit, st.locs.gather(1, lp.hit_col), torch.where(lp.load, lp.victim_loc, -1)),
    )
    slots = torch.where(fast[:, None], fast_slot, long_slot)
    slots = torch.where(valid & (fast | lp.apply)[:, None], slots, -1)

    upd = lp.load_first & lp.apply[:, None]
    st.tokens[rows[upd], lp.victim_col[upd]] = pos[upd]
    st.order = lp.new_order
    _mark(st.protected, rows, pos.clamp(0, hot - 1), use_id)
    _mark(st.protected, rows, lp.hit_col, lp.hit & lp.apply[:, None])
    _mark(st.protected, rows, lp.victim_col, lp.load & lp.apply[:, None])

    fast_first = is_first & fast[:, None]
    long_first = is_first & lp.apply[:, None]
    counts = torch.stack(
        [
            (fast_first & (fast_slot >= 0)).sum(1) + (long_first & (x_found | lp.hit)).sum(1),
            torch.where(lp.apply, lp.num_load, 0),
            (fast_first & (fast_slot < 0)).sum(1) + (long_first & lp.need & (lp.host_slot < 0)).sum(1),
        ],
        dim=1,
    )
    return _StepOut(slots, counts, lp.overflow, lp.host_slot[upd], lp.victim_loc[upd])


def swap_in_reference(
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
    """Torch reference of ``kernels.swap_in.swap_in`` (no argument checks: call ``swap_in``)."""
    num_reqs, num_steps, top_k = top_k_pos.shape
    dev = top_k_pos.device
    row_bytes = device_kv.shape[-1] * device_kv.element_size()
    slots = torch.full((num_reqs, num_steps, top_k), -1, dtype=torch.int32, device=dev)
    counts = torch.zeros(num_reqs, 4, dtype=torch.int64, device=dev)
    counts[:, 0] = num_steps
    if num_reqs == 0 or num_steps == 0:
        return SwapInResult.from_counts(slots, counts, row_bytes=row_bytes)
    st = _BatchState(
        tokens=buffer_tokens[req_rows].long(),
        locs=buffer_locs[req_rows],
        order=lru[req_rows].long(),
        host=req_to_host[req_rows],
        protected=torch.zeros(num_reqs, hot, dtype=torch.bool, device=dev),
    )
    active = torch.ones(num_reqs, dtype=torch.bool, device=dev)
    srcs, dsts = [], []
    for s in range(num_steps):
        near_s = None if near is None else near[:, s].long()
        out = _step(st, top_k_pos[:, s].long(), seq_lens[:, s], active, hot, policy, near_s)
        slots[:, s] = out.slots.to(torch.int32)
        counts[:, 1:] += out.counts
        counts[:, 0] = torch.where(out.overflow, s, counts[:, 0])
        active &= ~out.overflow
        srcs.append(out.copy_src)
        dsts.append(out.copy_dst)
    buffer_tokens[req_rows] = st.tokens.to(buffer_tokens.dtype)
    lru[req_rows] = st.order.to(lru.dtype)
    src, dst = torch.cat(srcs), torch.cat(dsts)
    if src.numel():
        rows = host_kv.index_select(0, src.to(host_kv.device)).to(device_kv.device, non_blocking=True)
        device_kv.index_copy_(0, dst, rows)
    return SwapInResult.from_counts(slots, counts, row_bytes=row_bytes)
