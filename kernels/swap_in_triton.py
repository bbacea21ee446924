"""Triton swap-in (contract: ``kernels.swap_in``); imported only when a Triton path is taken.

Two launches:

1. ``_swap_in_kernel``, one program per request, walks the steps in order and updates that request's
   ``buffer_tokens`` / ``lru`` rows in place; it writes the slots, the counters and a *copy plan*
   (host slot -> device slot per entry, -1 where the entry loads nothing).
2. the row-copy kernel of ``kernels.kv_copy_triton`` runs the plan, reading ``host_kv`` where it is:
   device memory, or pinned host memory through its device address (torch runs it instead for
   pageable host memory, or once a launch addressing host memory has failed).

No tile spans a whole row: a step walks the top-k row and the newest/draft columns ``TILE_K`` at a
time, the hot columns ``TILE_H`` at a time, so the registers do not grow with ``top_k`` or ``hot``
(the work does: membership tests are broadcast compares of one tile with another, ``[TILE_K,
TILE_K]`` to de-duplicate the row and against the newest/draft columns, ``[TILE_H, TILE_K]``
between the hot columns' tokens and the wanted positions). What one phase of a step hands to the
next goes through a per-request scratch row in global memory:

* per entry: its first occurrence, the hot column holding it, its draft-column slot, its host slot
  when it is loaded and, for the first occurrence of a loaded position, its miss rank;
* per hot column: protected (for the whole call), hit by this step (tagged with the step, so that it
  needs no clearing), the new LRU order and, under a policy other than LRU, the eviction key.

A long step runs five phases: (A) per top-k tile, de-duplicate, look up the draft and hot columns,
rank the misses; (B) per LRU tile, count the evictable and the protected columns, which says whether
the step fits; (C) for a policy other than LRU, every evictable column's key (``kernels.swap_in_policy``)
and a binary search for the ``m``-th smallest (keys are unique); (D) per LRU tile, the new order by a
stable compaction (exclusive cumsums of the kept / protected / victim / hit masks carried from tile
to tile) into the scratch row; (E) per top-k tile, the m-th miss takes the column at the m-th place
of the loaded block, slots and copy plan are written, and the new order is copied into ``lru``.

Every phase that reads what another thread wrote is separated by ``tl.debug_barrier()`` (one program
= one CTA), and those loads bypass L1 (``.cg``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import next_power_of_2
from kernels.kv_copy import copy_rows_mapped, mapped_copy
from kernels.swap_in_policy import FAR as _FAR
from kernels.swap_in_policy import KEY_SHIFT as _KEY_SHIFT
from kernels.swap_in_policy import policy_code
from kernels.swap_in_result import SwapInResult

FAR = tl.constexpr(_FAR)
KEY_SHIFT = tl.constexpr(_KEY_SHIFT)
KEY_END = tl.constexpr((_FAR + 2) << _KEY_SHIFT)  # every key is below this
KEY_NONE = tl.constexpr(2**63 - 1)  # the key of a column that is not evictable
KEY_BITS = tl.constexpr(63)  # binary-search iterations over [0, KEY_END)

# tile sides (powers of two): [TILE_H, TILE_K] compares, TILE_K entries of the top-k row at a time
TILE_K = 64
TILE_H = 128
NUM_WARPS = 8


@triton.jit
def _excl_cumsum(x):
    return tl.cumsum(x, axis=0) - x


@triton.jit
def _any_equal(a, b, mask, axis: tl.constexpr):
    """0/1 per row (``axis=1``) or column (``axis=0``) of ``a[:, None] == b[None, :]`` where ``mask``."""
    return tl.max(((a[:, None] == b[None, :]) & mask).to(tl.int32), axis=axis)


@triton.jit
def _entries(pos_row, k0, n, K, TK: tl.constexpr):
    """One tile of the step's top-k row: (indices, in range, positions, valid)."""
    ik = k0 + tl.arange(0, TK)
    k_in = ik < K
    pos = tl.load(pos_row + ik, mask=k_in, other=-1)  # [TK] i32
    return ik, k_in, pos, k_in & (pos >= 0) & (pos < n)


@triton.jit
def _first_occurrence(pos_row, pos, ik, k_in, k0, TK: tl.constexpr):
    """Index of the first entry holding each entry's position (``[TK, TK]`` compares with this tile
    and every earlier one)."""
    same = (pos[:, None] == pos[None, :]) & k_in[None, :]
    first = tl.min(tl.where(same, ik[None, :], 2**30), axis=1)
    j0 = k0 * 0
    while j0 < k0:
        jk = j0 + tl.arange(0, TK)
        other = tl.load(pos_row + jk)  # an earlier tile: every index is in range
        same = pos[:, None] == other[None, :]
        first = tl.minimum(first, tl.min(tl.where(same, jk[None, :], 2**30), axis=1))
        j0 += TK
    return first


@triton.jit
def _draft_lookup(pos, valid, tok_row, loc_row, HOT, W, TX: tl.constexpr):
    """First newest/draft column in [HOT, W) holding each position with a slot: slot, or -1
    (``[TK, TX]`` compares, the columns in order)."""
    slot = tl.full(pos.shape, -1, tl.int64)
    x0 = tl.max(pos, axis=0) * 0
    while x0 < W - HOT:
        ix = x0 + tl.arange(0, TX)
        x_in = ix < W - HOT
        xt = tl.load(tok_row + HOT + ix, mask=x_in, other=-1, cache_modifier=".cg")
        xl = tl.load(loc_row + HOT + ix, mask=x_in, other=-1)
        xm = (pos[:, None] == xt[None, :]) & (xl >= 0)[None, :] & x_in[None, :]  # [TK, TX]
        x_first = tl.min(tl.where(xm, ix[None, :], 2**30), axis=1)
        here = tl.sum(tl.where(xm & (ix[None, :] == x_first[:, None]), xl[None, :], 0), axis=1)
        slot = tl.where((slot < 0) & (x_first < 2**30), here, slot)
        x0 += TX
    return tl.where(valid, slot, -1)


@triton.jit
def _fast_step(pos_row, n, tok_row, loc_row, prot_row, slot_out, K, HOT, W,
               TK: tl.constexpr, TX: tl.constexpr):
    """n <= HOT: identity column, else the newest/draft columns. Returns (hits, unrecoverable)."""
    hits = (n * 0).to(tl.int32)
    unrec = hits
    k0 = hits
    while k0 < K:
        ik, k_in, pos, valid = _entries(pos_row, k0, n, K, TK)
        is_first = valid & (_first_occurrence(pos_row, pos, ik, k_in, k0, TK) == ik)
        x_slot = _draft_lookup(pos, valid, tok_row, loc_row, HOT, W, TX)
        id_loc = tl.load(loc_row + pos, mask=valid, other=-1)  # t < n <= HOT: in bounds
        use_id = valid & (id_loc >= 0)
        slot = tl.where(use_id, id_loc, x_slot)
        slot = tl.where(valid, slot, -1)
        tl.store(prot_row + pos, 1, mask=use_id)
        tl.store(slot_out + ik, slot.to(tl.int32), mask=k_in)
        hits += tl.sum((is_first & (slot >= 0)).to(tl.int32))
        unrec += tl.sum((is_first & (slot < 0)).to(tl.int32))
        k0 += TK
    return hits, unrec


@triton.jit
def _lru_tile(lru_row, tok_row, h0, HOT, TH: tl.constexpr):
    """One tile of LRU positions: (positions, in range, columns, their tokens)."""
    ih = h0 + tl.arange(0, TH)
    h_in = ih < HOT
    col = tl.load(lru_row + ih, mask=h_in, other=0, cache_modifier=".cg")
    tok = tl.load(tok_row + col, mask=h_in, other=-1, cache_modifier=".cg")
    return ih, h_in, col, tok


@triton.jit
def _near_keep(tok, h_in, pos_row, n, near_row, K, M, TK: tl.constexpr, TM: tl.constexpr):
    """[TH] 0/1: the column holds a selected (valid) or a near position of the step."""
    keep = tl.zeros(tok.shape, tl.int32)
    k0 = (n * 0).to(tl.int32)
    while k0 < K:
        _, _, pos, valid = _entries(pos_row, k0, n, K, TK)
        keep = tl.maximum(keep, _any_equal(tok, pos, valid[None, :], 1))
        k0 += TK
    m0 = k0 * 0
    while m0 < M:
        im = m0 + tl.arange(0, TM)
        close = tl.load(near_row + im, mask=im < M, other=-1)
        ok = (im < M) & (close >= 0) & (close < n)
        keep = tl.maximum(keep, _any_equal(tok, close, ok[None, :], 1))
        m0 += TM
    return tl.where(h_in, keep, 0)


@triton.jit
def _slide_prio(tok, h_in, pos_row, n, K, HOT, TK: tl.constexpr, POLICY: tl.constexpr):
    """[TH] the slide keys' priority: from the distance to the largest selected position below."""
    nearest = tl.full(tok.shape, -1, tl.int32)
    k0 = (n * 0).to(tl.int32)
    while k0 < K:
        _, _, pos, valid = _entries(pos_row, k0, n, K, TK)
        below = valid[None, :] & (pos[None, :] < tok[:, None]) & h_in[:, None]  # [TH, TK]
        nearest = tl.maximum(nearest, tl.max(tl.where(below, pos[None, :], -1), axis=1))
        k0 += TK
    d = tl.where(nearest >= 0, tok - nearest, FAR)
    if POLICY == 2:
        prio = tl.where(d > HOT, 0, 1 + HOT - d)
    else:
        prio = FAR - d
    return prio


@triton.jit
def _slides(pos_row, n, e_first, e_x, lru_row, tok_row, K, HOT, TK: tl.constexpr, TH: tl.constexpr):
    """Adaptive policies: more of the step's unique wanted positions are one past a position of the
    K most recently used columns than are among them."""
    slid_n = (n * 0).to(tl.int32)
    stayed_n = slid_n
    k0 = slid_n
    start = slid_n + HOT - K  # the first of the K most recently used LRU positions
    while k0 < K:
        ik, k_in, pos, valid = _entries(pos_row, k0, n, K, TK)
        first = tl.load(e_first + ik, mask=k_in, other=-1, cache_modifier=".cg")
        x_slot = tl.load(e_x + ik, mask=k_in, other=-1, cache_modifier=".cg")
        want_first = valid & (first == ik) & (x_slot < 0)
        slid = tl.zeros([TK], tl.int32)
        stayed = tl.zeros([TK], tl.int32)
        h0 = tl.maximum(start, 0) // TH * TH  # the tile holding LRU position HOT - K
        while h0 < HOT:
            ih, h_in, _, tok = _lru_tile(lru_row, tok_row, h0, HOT, TH)
            recent = h_in & (ih >= HOT - K) & (tok >= 0)
            slid = tl.maximum(slid, _any_equal(tok, pos - 1, recent[:, None], 0))
            stayed = tl.maximum(stayed, _any_equal(tok, pos, recent[:, None], 0))
            h0 += TH
        slid_n += tl.sum(tl.where(want_first, slid, 0))
        stayed_n += tl.sum(tl.where(want_first, stayed, 0))
        k0 += TK
    return slid_n > stayed_n


@triton.jit
def _victim_keys(pos_row, n, near_row, e_first, e_x, lru_row, tok_row, prot_row, hit_row, key_row, tag,
                 num_load, K, HOT, M, TK: tl.constexpr, TH: tl.constexpr, TM: tl.constexpr,
                 POLICY: tl.constexpr):
    """Policies other than LRU: store every evictable column's key by LRU position (``KEY_NONE`` for
    the others) and return the ``num_load``-th smallest (a binary search over the key range)."""
    slides = False
    if (POLICY == 3) | (POLICY == 5):
        slides = _slides(pos_row, n, e_first, e_x, lru_row, tok_row, K, HOT, TK, TH)
    h0 = (n * 0).to(tl.int32)
    while h0 < HOT:
        ih, h_in, col, tok = _lru_tile(lru_row, tok_row, h0, HOT, TH)
        prot = tl.load(prot_row + col, mask=h_in, other=0, cache_modifier=".cg") != 0
        hit = tl.load(hit_row + col, mask=h_in, other=0, cache_modifier=".cg") == tag
        evict = h_in & ~hit & ~prot
        if POLICY == 4:
            prio = _near_keep(tok, h_in, pos_row, n, near_row, K, M, TK, TM)
        else:
            prio = _slide_prio(tok, h_in, pos_row, n, K, HOT, TK, POLICY)
            if POLICY == 3:
                prio = tl.where(slides, prio, 0)
            if POLICY == 5:
                prio = tl.where(slides, prio, _near_keep(tok, h_in, pos_row, n, near_row, K, M, TK, TM))
        key = (prio.to(tl.int64) << KEY_SHIFT) | ih.to(tl.int64)
        tl.store(key_row + ih, tl.where(evict, key, KEY_NONE), mask=h_in)
        h0 += TH
    tl.debug_barrier()  # every key is written
    lo = tl.zeros((), dtype=tl.int64)
    hi = lo + KEY_END
    for _ in range(KEY_BITS):
        mid = (lo + hi) >> 1
        count = (n * 0).to(tl.int32)
        h0 = count
        while h0 < HOT:
            ih = h0 + tl.arange(0, TH)
            key = tl.load(key_row + ih, mask=ih < HOT, other=KEY_NONE, cache_modifier=".cg")
            count += tl.sum((key <= mid).to(tl.int32))
            h0 += TH
        enough = count >= num_load
        hi = tl.where(enough, mid, hi)
        lo = tl.where(enough, lo, mid + 1)
    return lo


@triton.jit
def _long_step(pos_row, n, tag, tok_row, loc_row, lru_row, host_row, prot_row, hit_row, order_row,
               e_first, e_hit, e_rank, e_x, e_host, key_row, slot_out, src_out, dst_out, near_row,
               K, HOT, W, M, TK: tl.constexpr, TH: tl.constexpr, TX: tl.constexpr,
               TM: tl.constexpr, POLICY: tl.constexpr):
    """n > HOT: the LRU rules, victims chosen by the policy. Returns (fits, hits, misses,
    unrecoverable); writes nothing but scratch unless it fits."""
    zero = (n * 0).to(tl.int32)
    hits = zero
    unrec = zero
    num_load = zero
    # (A) per top-k tile: first occurrence, draft and hot columns, misses and their ranks
    k0 = zero
    while k0 < K:
        ik, k_in, pos, valid = _entries(pos_row, k0, n, K, TK)
        first = _first_occurrence(pos_row, pos, ik, k_in, k0, TK)
        is_first = valid & (first == ik)
        x_slot = _draft_lookup(pos, valid, tok_row, loc_row, HOT, W, TX)
        wanted = valid & (x_slot < 0)
        hit_col = tl.full([TK], -1, tl.int32)
        h0 = zero
        while h0 < HOT:  # by column: hot tokens are unique, so at most one column holds a position
            col = h0 + tl.arange(0, TH)
            tok = tl.load(tok_row + col, mask=col < HOT, other=-1, cache_modifier=".cg")
            held = (tok[:, None] == pos[None, :]) & wanted[None, :] & (col < HOT)[:, None]  # [TH, TK]
            hit_col = tl.maximum(hit_col, tl.max(tl.where(held, col[:, None], -1), axis=0))
            h0 += TH
        hit = hit_col >= 0
        tl.store(hit_row + hit_col, tag, mask=hit)
        need = wanted & ~hit
        host = tl.load(host_row + pos, mask=need, other=-1)
        load = need & (host >= 0)  # every duplicate of a loadable miss
        load_first = (load & is_first).to(tl.int32)
        tl.store(e_first + ik, first, mask=k_in)
        tl.store(e_hit + ik, hit_col, mask=k_in)
        tl.store(e_rank + ik, num_load + _excl_cumsum(load_first), mask=k_in)
        tl.store(e_x + ik, x_slot, mask=k_in)
        tl.store(e_host + ik, tl.where(load, host, -1), mask=k_in)
        num_load += tl.sum(load_first)
        hits += tl.sum((is_first & ((x_slot >= 0) | hit)).to(tl.int32))
        unrec += tl.sum((is_first & need & (host < 0)).to(tl.int32))
        k0 += TK
    tl.debug_barrier()  # the hit tags and the entries' scratch are written
    # (B) per LRU tile: evictable and protected-unwanted columns
    num_evict = zero
    num_protu = zero
    h0 = zero
    while h0 < HOT:
        ih, h_in, col, tok = _lru_tile(lru_row, tok_row, h0, HOT, TH)
        prot = tl.load(prot_row + col, mask=h_in, other=0, cache_modifier=".cg") != 0
        hit = tl.load(hit_row + col, mask=h_in, other=0, cache_modifier=".cg") == tag
        num_evict += tl.sum((h_in & ~hit & ~prot).to(tl.int32))
        num_protu += tl.sum((h_in & ~hit & prot).to(tl.int32))
        h0 += TH
    fits = num_load <= num_evict
    if fits:
        # (C) the policy's last victim key
        last = tl.zeros((), dtype=tl.int64)
        if POLICY != 0:
            last = _victim_keys(pos_row, n, near_row, e_first, e_x, lru_row, tok_row, prot_row, hit_row,
                                key_row, tag, num_load, K, HOT, M, TK, TH, TM, POLICY)
        # (D) new order [evictables kept | protected, unwanted | loaded | hits], by stable compaction
        loaded_at = num_evict - num_load + num_protu  # start of the "newly loaded" block
        seen_evict = zero
        seen_victim = zero
        seen_kept = zero
        seen_protu = zero
        seen_hit = zero
        h0 = zero
        while h0 < HOT:
            ih, h_in, col, tok = _lru_tile(lru_row, tok_row, h0, HOT, TH)
            prot = tl.load(prot_row + col, mask=h_in, other=0, cache_modifier=".cg") != 0
            hit = h_in & (tl.load(hit_row + col, mask=h_in, other=0, cache_modifier=".cg") == tag)
            evict = h_in & ~hit & ~prot
            protu = h_in & ~hit & prot
            if POLICY == 0:
                victim = evict & (seen_evict + _excl_cumsum(evict.to(tl.int32)) < num_load)
            else:
                key = tl.load(key_row + ih, mask=h_in, other=KEY_NONE, cache_modifier=".cg")
                victim = evict & (key <= last) & (num_load > 0)
            kept = evict & ~victim
            dest = tl.where(
                victim,
                loaded_at + seen_victim + _excl_cumsum(victim.to(tl.int32)),
                tl.where(
                    kept,
                    seen_kept + _excl_cumsum(kept.to(tl.int32)),
                    tl.where(
                        protu,
                        num_evict - num_load + seen_protu + _excl_cumsum(protu.to(tl.int32)),
                        num_evict + num_protu + seen_hit + _excl_cumsum(hit.to(tl.int32)),
                    ),
                ),
            )
            tl.store(order_row + dest, col, mask=h_in)
            seen_evict += tl.sum(evict.to(tl.int32))
            seen_victim += tl.sum(victim.to(tl.int32))
            seen_kept += tl.sum(kept.to(tl.int32))
            seen_protu += tl.sum(protu.to(tl.int32))
            seen_hit += tl.sum(hit.to(tl.int32))
            h0 += TH
        tl.debug_barrier()  # the new order is in the scratch row; every read of the old one is done
        # (E) the m-th miss takes the m-th column of the loaded block; slots, plan, tokens, order
        k0 = zero
        while k0 < K:
            ik, k_in, pos, valid = _entries(pos_row, k0, n, K, TK)
            first = tl.load(e_first + ik, mask=k_in, other=0, cache_modifier=".cg")
            hit_col = tl.load(e_hit + ik, mask=k_in, other=-1, cache_modifier=".cg")
            x_slot = tl.load(e_x + ik, mask=k_in, other=-1, cache_modifier=".cg")
            host = tl.load(e_host + ik, mask=k_in, other=-1, cache_modifier=".cg")
            hit = hit_col >= 0
            load = host >= 0
            load_first = load & (first == ik)
            rank = tl.load(e_rank + first, mask=load, other=0, cache_modifier=".cg")
            victim = tl.load(order_row + loaded_at + rank, mask=load, other=0, cache_modifier=".cg")
            victim_loc = tl.load(loc_row + victim, mask=load, other=-1)
            hit_loc = tl.load(loc_row + hit_col, mask=hit, other=-1)
            tl.store(tok_row + victim, pos, mask=load_first)
            tl.store(prot_row + victim, 1, mask=load)
            tl.store(prot_row + hit_col, 1, mask=hit)
            slot = tl.where(x_slot >= 0, x_slot, tl.where(hit, hit_loc, tl.where(load, victim_loc, -1)))
            tl.store(slot_out + ik, tl.where(valid, slot, -1).to(tl.int32), mask=k_in)
            tl.store(src_out + ik, host, mask=load_first)
            tl.store(dst_out + ik, victim_loc, mask=load_first)
            k0 += TK
        h0 = zero
        while h0 < HOT:
            ih = h0 + tl.arange(0, TH)
            order = tl.load(order_row + ih, mask=ih < HOT, other=0, cache_modifier=".cg")
            tl.store(lru_row + ih, order, mask=ih < HOT)
            h0 += TH
    return fits, hits, num_load, unrec


@triton.jit
def _swap_in_kernel(
    pos_ptr,  # [B, S, K] i32
    seq_ptr,  # [B, S] i64
    rows_ptr,  # [B] i64
    tok_ptr,  # [N, W] i32
    loc_ptr,  # [N, W] i64
    lru_ptr,  # [N, HOT] i32
    host_ptr,  # [N, ctx] i64
    s32_ptr,  # [B, 3 * K + 3 * HOT] i32 scratch, zeros
    s64_ptr,  # [B, 2 * K + HOT] i64 scratch
    slot_ptr,  # [B, S, K] i32 output, prefilled with -1
    src_ptr,  # [B, S, K] i64 output, prefilled with -1
    dst_ptr,  # [B, S, K] i64 output, prefilled with -1
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
    TK: tl.constexpr,
    TH: tl.constexpr,
    TX: tl.constexpr,
    TM: tl.constexpr,
    POLICY: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b)
    tok_row = tok_ptr + row * tok_stride
    loc_row = loc_ptr + row * loc_stride
    lru_row = lru_ptr + row * lru_stride
    host_row = host_ptr + row * host_stride
    s32 = s32_ptr + b.to(tl.int64) * (3 * K + 3 * HOT)
    e_first = s32
    e_hit = s32 + K
    e_rank = s32 + 2 * K
    prot_row = s32 + 3 * K  # by column: returned by an earlier step of this call
    hit_row = prot_row + HOT  # by column: the step (+ 1) that last found it holding a wanted position
    order_row = hit_row + HOT  # the new LRU order
    s64 = s64_ptr + b.to(tl.int64) * (2 * K + HOT)
    e_x = s64
    e_host = s64 + K
    key_row = s64 + 2 * K  # by LRU position

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
            out = (b * S + s).to(tl.int64) * K  # top_k_pos and the outputs are contiguous [B, S, K]
            if n <= HOT:
                step_hits, step_unrec = _fast_step(
                    pos_ptr + out, n, tok_row, loc_row, prot_row, slot_ptr + out, K, HOT, W, TK, TX
                )
                hits += step_hits
                unrec += step_unrec
            else:
                fits, step_hits, step_misses, step_unrec = _long_step(
                    pos_ptr + out, n, s + 1, tok_row, loc_row, lru_row, host_row, prot_row, hit_row,
                    order_row, e_first, e_hit, e_rank, e_x, e_host, key_row,
                    slot_ptr + out, src_ptr + out, dst_ptr + out, near_ptr + (b * S + s).to(tl.int64) * M,
                    K, HOT, W, M, TK, TH, TX, TM, POLICY,
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
    """Execute the copy plan ``device_kv[dst] = host_kv[src]`` where ``dst >= 0``: the row-copy
    kernel, driven by the plan where the swap-in kernel wrote it, reading ``host_kv`` directly when
    it is on the device or in pinned host memory (device work on the current stream: a backup
    ordered before the swap-in has written its host rows by then); torch otherwise."""
    if host_kv.device == device_kv.device:
        from kernels.kv_copy_triton import copy_rows_triton

        copy_rows_triton(device_kv, dst, host_kv, src)
    elif not (mapped_copy(device_kv, host_kv) and copy_rows_mapped(device_kv, dst, host_kv, src)):
        _run_plan_through_host(host_kv, device_kv, src, dst)


def _run_plan_through_host(host_kv, device_kv, src, dst) -> None:
    """The plan by torch, for pageable host memory (or after a failed launch): reading the plan back
    waits for the current stream, and with it for every backup ordered before the swap-in
    (``order_after``), so the gather on the CPU reads no host row a backup is still writing."""
    keep = dst >= 0
    host_src = src[keep].to(host_kv.device)
    rows = host_kv[host_src].to(device_kv.device, non_blocking=True)
    device_kv[dst[keep]] = rows


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
    scratch32 = torch.zeros(num_reqs, 3 * top_k + 3 * hot, dtype=torch.int32, device=dev)
    scratch64 = torch.empty(num_reqs, 2 * top_k + hot, dtype=torch.int64, device=dev)
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
        scratch32,
        scratch64,
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
        TK=min(TILE_K, next_power_of_2(top_k)),
        TH=min(TILE_H, next_power_of_2(hot)),
        TX=min(TILE_K, next_power_of_2(width - hot)),
        TM=min(TILE_K, next_power_of_2(max(margin, 1))),
        POLICY=policy_code(policy),
        num_warps=NUM_WARPS,
    )
    _run_plan(host_kv, device_kv, src.view(-1), dst.view(-1))
    return SwapInResult.from_counts(slots, counts, row_bytes=row_bytes)
