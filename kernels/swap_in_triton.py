"""Triton swap-in (contract: ``kernels.swap_in``); imported only when a Triton path is taken.

Two launches:

1. ``_swap_in_kernel``, one program per request, walks the steps in order and updates that request's
   ``buffer_tokens`` / ``lru`` rows in place; it writes the slots, the counters and a *copy plan*
   (host slot -> device slot per entry, -1 where the entry loads nothing).
2. the row-copy kernel of ``kernels.kv_copy_triton`` runs the plan (or torch, when ``host_kv`` is host
   memory that a kernel cannot address).

Inside a step, membership tests are broadcast compares: ``[BLOCK_K, BLOCK_K]`` to de-duplicate the
top-k row, ``[BLOCK_K, BLOCK_X]`` against the newest/draft columns and ``[BLOCK_HOT, BLOCK_K]``
between the hot columns' tokens and the wanted positions. The new LRU order is a stable compaction
(exclusive cumsums of the kept / victim / protected / hit masks) scattered back into the ``lru``
row; the m-th miss's victim is read back from that row. A policy other than LRU picks its victims
by a binary search for the ``m``-th smallest eviction key (``kernels.swap_in_policy``), which needs
the ``[BLOCK_HOT, BLOCK_K]`` compare once more (and, for the near-policies, a ``[BLOCK_HOT, BLOCK_M]``
compare against the step's near row) and no sort. Size limits (``TRITON_MAX_*`` in ``swap_in``)
keep those tiles at <= 1024 x 128.

State lives in global memory between phases, so every phase that reads what another thread wrote
is separated by ``tl.debug_barrier()`` (one program = one CTA), and those loads bypass L1 (``.cg``).
Protected columns are flags in a per-call scratch row ``[B, HOT]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import next_power_of_2
from kernels.swap_in_policy import FAR as _FAR
from kernels.swap_in_policy import KEY_SHIFT as _KEY_SHIFT
from kernels.swap_in_policy import policy_code
from kernels.swap_in_result import SwapInResult

FAR = tl.constexpr(_FAR)
KEY_SHIFT = tl.constexpr(_KEY_SHIFT)
KEY_END = tl.constexpr((_FAR + 2) << _KEY_SHIFT)  # every key is below this
KEY_BITS = tl.constexpr(63)  # binary-search iterations over [0, KEY_END)


@triton.jit
def _excl_cumsum(x):
    return tl.cumsum(x, axis=0) - x


@triton.jit
def _first_occurrence(pos, ik, k_in, BLOCK_K: tl.constexpr):
    """Index of the first entry holding each entry's position ([BK, BK] compare)."""
    same = (pos[:, None] == pos[None, :]) & k_in[None, :]
    return tl.min(tl.where(same, ik[None, :], BLOCK_K), axis=1)


@triton.jit
def _draft_lookup(pos, valid, tok_row, loc_row, HOT, W, BLOCK_X: tl.constexpr):
    """First newest/draft column in [HOT, W) holding each position with a slot: (found, slot)."""
    ix = tl.arange(0, BLOCK_X)
    x_in = ix < W - HOT
    xt = tl.load(tok_row + HOT + ix, mask=x_in, other=-1, cache_modifier=".cg")
    xl = tl.load(loc_row + HOT + ix, mask=x_in, other=-1)
    xm = (pos[:, None] == xt[None, :]) & (xl >= 0)[None, :] & x_in[None, :]  # [BK, BX]
    x_first = tl.min(tl.where(xm, ix[None, :], BLOCK_X), axis=1)
    x_slot = tl.sum(tl.where(xm & (ix[None, :] == x_first[:, None]), xl[None, :], 0), axis=1)
    return valid & (x_first < BLOCK_X), x_slot


@triton.jit
def _fast_step(pos, valid, is_first, x_found, x_slot, loc_row, prot_row, slot_out, k_in):
    """n <= HOT: identity column, else the newest/draft columns. Returns (hits, unrecoverable)."""
    id_loc = tl.load(loc_row + pos, mask=valid, other=-1)  # t < n <= HOT: in bounds
    use_id = valid & (id_loc >= 0)
    slot = tl.where(use_id, id_loc, tl.where(x_found, x_slot, -1))
    slot = tl.where(valid, slot, -1)
    tl.store(prot_row + pos, 1, mask=use_id)
    tl.store(slot_out, slot.to(tl.int32), mask=k_in)
    return tl.sum((is_first & (slot >= 0)).to(tl.int32)), tl.sum((is_first & (slot < 0)).to(tl.int32))


@triton.jit
def _near_keep(pos, valid, tok_k, h_in, near_row, n, M, BLOCK_M: tl.constexpr):
    """[BH] 0/1: the LRU position holds a selected or a near position of the step."""
    im = tl.arange(0, BLOCK_M)
    close = tl.load(near_row + im, mask=im < M, other=-1)
    close_ok = (im < M) & (close >= 0) & (close < n)
    by_sel = tl.max(((tok_k[:, None] == pos[None, :]) & valid[None, :]).to(tl.int32), axis=1)
    by_near = tl.max(((tok_k[:, None] == close[None, :]) & close_ok[None, :]).to(tl.int32), axis=1)
    return tl.where(h_in, tl.maximum(by_sel, by_near), 0)


@triton.jit
def _policy_victims(pos, valid, want_first, tok_k, ih, h_in, evict, num_load, HOT, K, near_row, n, M,
                    BLOCK_M: tl.constexpr, POLICY: tl.constexpr):
    """The evictable columns (by LRU position) the policy gives this step's ``num_load`` loads.

    LRU: the first ``num_load``. Otherwise each evictable gets its key (``kernels.swap_in_policy``)
    and the victims are the keys at most the ``num_load``-th smallest, found by a binary search over
    the key range (keys are unique: they end in the LRU index)."""
    if POLICY == 0:
        victim = evict & (_excl_cumsum(evict.to(tl.int32)) < num_load)
    else:
        if POLICY == 4:  # near: columns holding neither a selected nor a near position go first
            prio = _near_keep(pos, valid, tok_k, h_in, near_row, n, M, BLOCK_M)
        else:
            below = valid[None, :] & (pos[None, :] < tok_k[:, None]) & h_in[:, None]  # [BH, BK]
            nearest = tl.max(tl.where(below, pos[None, :], -1), axis=1)
            d = tl.where(nearest >= 0, tok_k - nearest, FAR)
            if POLICY == 2:
                prio = tl.where(d > HOT, 0, 1 + HOT - d)
            else:
                prio = FAR - d
        # adaptive: slide's keys where the selection slid, else LRU's / near's
        if (POLICY == 3) | (POLICY == 5):
            recent = h_in & (ih >= HOT - K) & (tok_k >= 0)  # the K most recently used columns
            slid = tl.max(((tok_k[:, None] == pos[None, :] - 1) & recent[:, None]).to(tl.int32), axis=0) > 0
            stayed = tl.max(((tok_k[:, None] == pos[None, :]) & recent[:, None]).to(tl.int32), axis=0) > 0
            slides = tl.sum((slid & want_first).to(tl.int32)) > tl.sum((stayed & want_first).to(tl.int32))
            if POLICY == 3:
                prio = tl.where(slides, prio, 0)
            else:
                prio = tl.where(slides, prio, _near_keep(pos, valid, tok_k, h_in, near_row, n, M, BLOCK_M))
        key = (prio.to(tl.int64) << KEY_SHIFT) | ih.to(tl.int64)
        lo = tl.zeros((), dtype=tl.int64)
        hi = lo + KEY_END
        for _ in range(KEY_BITS):
            mid = (lo + hi) >> 1
            enough = tl.sum((evict & (key <= mid)).to(tl.int32)) >= num_load
            hi = tl.where(enough, mid, hi)
            lo = tl.where(enough, lo, mid + 1)
        victim = evict & (key <= lo) & (num_load > 0)
    return victim


@triton.jit
def _long_step(
    pos,
    valid,
    first,
    is_first,
    x_found,
    x_slot,
    tok_row,
    loc_row,
    lru_row,
    host_row,
    prot_row,
    slot_out,
    src_out,
    dst_out,
    ik,
    k_in,
    HOT,
    K,
    near_row,
    n,
    M,
    BLOCK_HOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    POLICY: tl.constexpr,
):
    """n > HOT: the LRU rules, victims chosen by the policy. Returns (fits, hits, misses,
    unrecoverable); writes nothing unless it fits."""
    ih = tl.arange(0, BLOCK_HOT)
    h_in = ih < HOT
    wanted = valid & ~x_found
    lru_k = tl.load(lru_row + ih, mask=h_in, other=0, cache_modifier=".cg")  # [BH] columns, LRU first
    tok_k = tl.load(tok_row + lru_k, mask=h_in, other=-1, cache_modifier=".cg")
    loc_k = tl.load(loc_row + lru_k, mask=h_in, other=-1)
    prot_k = tl.load(prot_row + lru_k, mask=h_in, other=0, cache_modifier=".cg") != 0
    held = (tok_k[:, None] == pos[None, :]) & wanted[None, :] & h_in[:, None]  # [BH, BK]
    col_hit = tl.max(held.to(tl.int32), axis=1) > 0
    hit = tl.max(held.to(tl.int32), axis=0) > 0
    hit_loc = tl.sum(tl.where(held, loc_k[:, None], 0), axis=0)  # hot tokens are unique
    hit_col = tl.sum(tl.where(held, lru_k[:, None], 0), axis=0)
    need = wanted & ~hit
    host = tl.load(host_row + pos, mask=need, other=-1)
    load = need & (host >= 0)  # every duplicate of a loadable miss
    load_first = (load & is_first).to(tl.int32)
    rank = tl.sum(tl.where(ik[None, :] == first[:, None], _excl_cumsum(load_first)[None, :], 0), axis=1)
    num_load = tl.sum(load_first)
    evict = (h_in & ~col_hit & ~prot_k).to(tl.int32)
    protu = (h_in & ~col_hit & prot_k).to(tl.int32)
    num_evict = tl.sum(evict)
    fits = num_load <= num_evict
    hits = tl.sum((is_first & (x_found | hit)).to(tl.int32))
    unrec = tl.sum((is_first & need & (host < 0)).to(tl.int32))
    if fits:
        # new order [evictables kept | protected, unwanted | loaded | hits], by stable compaction
        victim = _policy_victims(
            pos,
            valid,
            wanted & is_first,
            tok_k,
            ih,
            h_in,
            evict != 0,
            num_load,
            HOT,
            K,
            near_row,
            n,
            M,
            BLOCK_M,
            POLICY,
        )
        num_protu = tl.sum(protu)
        loaded_at = num_evict - num_load + num_protu  # start of the "newly loaded" block
        dest = tl.where(
            victim,
            loaded_at + _excl_cumsum(victim.to(tl.int32)),
            tl.where(
                evict != 0,
                _excl_cumsum(((evict != 0) & ~victim).to(tl.int32)),
                tl.where(
                    protu != 0,
                    num_evict - num_load + _excl_cumsum(protu),
                    num_evict + num_protu + _excl_cumsum((h_in & col_hit).to(tl.int32)),
                ),
            ),
        )
        tl.debug_barrier()  # every thread has read this step's lru / tokens / flags
        tl.store(lru_row + dest, lru_k, mask=h_in)
        tl.debug_barrier()
        victim = tl.load(lru_row + loaded_at + rank, mask=load, other=0, cache_modifier=".cg")
        victim_loc = tl.load(loc_row + victim, mask=load, other=-1)
        tl.store(tok_row + victim, pos, mask=load_first != 0)
        tl.store(prot_row + victim, 1, mask=load)
        tl.store(prot_row + hit_col, 1, mask=hit)
        slot = tl.where(x_found, x_slot, tl.where(hit, hit_loc, tl.where(load, victim_loc, -1)))
        tl.store(slot_out, tl.where(valid, slot, -1).to(tl.int32), mask=k_in)
        tl.store(src_out, host, mask=load_first != 0)
        tl.store(dst_out, victim_loc, mask=load_first != 0)
    return fits, hits, num_load, unrec


@triton.jit
def _swap_in_kernel(
    pos_ptr,
    seq_ptr,
    rows_ptr,  # [B, S, K] i32, [B, S] i64, [B] i64
    tok_ptr,
    loc_ptr,
    lru_ptr,
    host_ptr,  # [N, W] i32, [N, W] i64, [N, HOT] i32, [N, ctx] i64
    prot_ptr,  # [B, HOT] i32 scratch, zeros
    slot_ptr,
    src_ptr,
    dst_ptr,  # [B, S, K] i32 / i64 / i64 outputs, prefilled with -1
    count_ptr,  # [B, 4] i32: steps_done, hits, misses, unrecoverable
    near_ptr,  # [B, S, M] i32 the near positions (M = 0: none)
    S,
    K,
    HOT,
    W,
    M,
    seq_stride_b,
    tok_stride,
    loc_stride,
    lru_stride,
    host_stride,
    BLOCK_K: tl.constexpr,
    BLOCK_HOT: tl.constexpr,
    BLOCK_X: tl.constexpr,
    BLOCK_M: tl.constexpr,
    POLICY: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b)
    tok_row = tok_ptr + row * tok_stride
    loc_row = loc_ptr + row * loc_stride
    lru_row = lru_ptr + row * lru_stride
    host_row = host_ptr + row * host_stride
    prot_row = prot_ptr + b * HOT
    ik = tl.arange(0, BLOCK_K)
    k_in = ik < K

    zero = b * 0  # int32 scalar: loop-carried counters keep one type
    stopped = zero
    steps_done = zero + S
    hits = zero
    misses = zero
    unrec = zero
    s = zero
    while s < S:
        n = tl.load(seq_ptr + b * seq_stride_b + s)
        if (stopped == 0) & (n > 0):
            out = (b * S + s) * K + ik  # top_k_pos and the outputs are contiguous [B, S, K]
            pos = tl.load(pos_ptr + out, mask=k_in, other=-1)  # [BK] i32
            valid = k_in & (pos >= 0) & (pos < n)
            first = _first_occurrence(pos, ik, k_in, BLOCK_K)
            is_first = valid & (first == ik)
            x_found, x_slot = _draft_lookup(pos, valid, tok_row, loc_row, HOT, W, BLOCK_X)
            if n <= HOT:
                step_hits, step_unrec = _fast_step(
                    pos, valid, is_first, x_found, x_slot, loc_row, prot_row, slot_ptr + out, k_in
                )
                hits += step_hits
                unrec += step_unrec
            else:
                fits, step_hits, step_misses, step_unrec = _long_step(
                    pos,
                    valid,
                    first,
                    is_first,
                    x_found,
                    x_slot,
                    tok_row,
                    loc_row,
                    lru_row,
                    host_row,
                    prot_row,
                    slot_ptr + out,
                    src_ptr + out,
                    dst_ptr + out,
                    ik,
                    k_in,
                    HOT,
                    K,
                    near_ptr + (b * S + s) * M,
                    n,
                    M,
                    BLOCK_HOT,
                    BLOCK_M,
                    POLICY,
                )
                if fits:
                    hits += step_hits
                    misses += step_misses
                    unrec += step_unrec
                else:
                    stopped = zero + 1  # stop before this step: nothing of it was written
                    steps_done = s
            tl.debug_barrier()  # this step's writes are visible to the next step's reads
        s += 1
    tl.store(count_ptr + b * 4 + 0, steps_done)
    tl.store(count_ptr + b * 4 + 1, hits)
    tl.store(count_ptr + b * 4 + 2, misses)
    tl.store(count_ptr + b * 4 + 3, unrec)


def _run_plan(host_kv, device_kv, src, dst) -> None:
    """Execute the copy plan ``device_kv[dst] = host_kv[src]`` where ``dst >= 0``."""
    if host_kv.device == device_kv.device:
        from kernels.kv_copy_triton import copy_rows_triton

        copy_rows_triton(device_kv, dst, host_kv, src)
        return
    keep = dst >= 0  # host memory: a kernel cannot read it, so torch gathers and copies
    device_kv[dst[keep]] = host_kv[src[keep].to(host_kv.device)].to(device_kv.device, non_blocking=True)


def swap_in_triton(
    top_k_pos,
    seq_lens,
    req_rows,
    buffer_tokens,
    buffer_locs,
    lru,
    req_to_host,
    host_kv,
    device_kv,
    hot: int,
    policy: str = "lru",
    near: torch.Tensor | None = None,
) -> SwapInResult:
    """Launch the Triton swap-in (arguments checked by ``kernels.swap_in.swap_in``)."""
    num_reqs, num_steps, top_k = top_k_pos.shape
    dev = top_k_pos.device
    width = buffer_tokens.shape[1]
    slots = torch.full((num_reqs, num_steps, top_k), -1, dtype=torch.int32, device=dev)
    src = torch.full((num_reqs, num_steps, top_k), -1, dtype=torch.int64, device=dev)
    dst = torch.full_like(src, -1)
    counts = torch.zeros(num_reqs, 4, dtype=torch.int32, device=dev)
    counts[:, 0] = num_steps
    row_bytes = device_kv.shape[1] * device_kv.element_size()
    if num_reqs == 0 or num_steps == 0 or top_k == 0:
        return SwapInResult.from_counts(slots, counts, row_bytes=row_bytes)
    prot = torch.zeros(num_reqs, hot, dtype=torch.int32, device=dev)
    block_k, block_hot = next_power_of_2(top_k), next_power_of_2(hot)
    pos = top_k_pos.contiguous()
    near = torch.full((1,), -1, dtype=torch.int32, device=dev) if near is None else near.contiguous()
    margin = near.shape[2] if near.dim() == 3 else 0
    _swap_in_kernel[(num_reqs,)](
        pos,
        seq_lens,
        req_rows,
        buffer_tokens,
        buffer_locs,
        lru,
        req_to_host,
        prot,
        slots,
        src,
        dst,
        counts,
        near,
        num_steps,
        top_k,
        hot,
        width,
        margin,
        seq_lens.stride(0),
        buffer_tokens.stride(0),
        buffer_locs.stride(0),
        lru.stride(0),
        req_to_host.stride(0),
        BLOCK_K=block_k,
        BLOCK_HOT=block_hot,
        BLOCK_X=next_power_of_2(width - hot),
        BLOCK_M=next_power_of_2(max(margin, 1)),
        POLICY=policy_code(policy),
        num_warps=16 if block_hot * block_k > 32768 else 8,  # ptxas: fewer spills on the big tiles
    )
    _run_plan(host_kv, device_kv, src.view(-1), dst.view(-1))
    return SwapInResult.from_counts(slots, counts, row_bytes=row_bytes)
