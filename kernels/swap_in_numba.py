"""Swap-in on a CPU as compiled loops: the contract of ``kernels.swap_in``, every policy, with numba.

Each request's steps are one loop over its top-k entries and hot columns, compiled once (numba's on-disk cache
keeps the machine code between processes). The bookkeeping per request:

* ``col_of[t]``: the hot column holding position ``t`` (-1 none), built from the request's hot
  tokens when it starts and updated on every load, reset when it ends;
* ``draft_of[t]``: the slot of the first newest/draft column holding ``t`` (loads never touch
  those columns, so it is built once per request);
* ``seen[t] == stamp``: ``t`` already appeared in this step (duplicates resolve to ``res[t]`` and
  count once); a fresh stamp per step makes clearing unnecessary.

The LRU order of each step is rebuilt as the contract lists it (kept evictables, protected
unwanted, loaded in miss order, hits); every policy of ``kernels.swap_in_policy`` chooses its
victims among the evictable columns here, with the step's selected and near positions marked in a
position table like the others. Row copies are gathered as (host slot, device slot) pairs and
made after the loop by one ``kernels.kv_copy`` copy (a compiled loop when both pools are in CPU
memory), so the KV tensors keep any dtype and place. ``swap_in(impl="auto")`` takes this
path on CPU.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from kernels.kv_copy import copy_rows_unchecked
from kernels.swap_in_policy import FAR, KEY_SHIFT, POLICIES, policy_code
from kernels.swap_in_result import SwapInResult

# the policies' codes (their order in ``POLICIES``)
LRU, SLIDE, SLIDE_LRU, ADAPTIVE, NEAR, NEAR_ADAPTIVE = (policy_code(p) for p in POLICIES)
INDEX_MASK = (1 << KEY_SHIFT) - 1  # a key's low bits: the evictable column's index


def _kernel(
    top, lens, rows, tokens, locs, lru, host, hot, policy, near, slots, counts, copy_src, copy_dst
):  # pragma: no cover
    num_reqs, num_steps, top_k = top.shape
    width = host.shape[1]
    cols = tokens.shape[1]
    col_of = np.full(width, -1, np.int64)
    draft_of = np.full(width, -1, np.int64)
    seen = np.zeros(width, np.int64)
    res = np.full(width, -1, np.int64)
    protected = np.zeros(hot, np.bool_)
    is_hit = np.zeros(hot, np.bool_)
    order = np.empty(hot, np.int64)
    new_order = np.empty(hot, np.int64)
    evictable = np.empty(hot, np.int64)
    victims = np.empty(hot, np.int64)
    missed = np.empty(top_k, np.int64)
    loadable = np.empty(top_k, np.int64)
    loadable_host = np.empty(top_k, np.int64)
    wanted = np.empty(top_k, np.int64)  # the step's unique valid positions not in a draft column
    selected = np.empty(top_k, np.int64)  # the step's unique valid positions
    chosen = np.zeros(hot, np.bool_)  # by index into ``evictable``: a victim
    keys = np.empty(hot, np.int64)
    mark = np.zeros(width, np.int64)  # mark[t] == stamp: t is recent (adaptive) or kept (near)
    stamp = 0
    copies = 0
    all_hits = all_misses = all_lost = 0  # the counts summed over the call
    complete = True  # every request handled all its steps
    for b in range(num_reqs):
        row = rows[b]
        for c in range(hot):
            order[c] = lru[row, c]
            protected[c] = False
            t = tokens[row, c]
            if 0 <= t < width:
                col_of[t] = c
        for c in range(cols - 1, hot - 1, -1):  # the first matching column wins: fill from the last
            t = tokens[row, c]
            if 0 <= t < width and locs[row, c] >= 0:
                draft_of[t] = locs[row, c]
        done, hits, misses, lost = num_steps, 0, 0, 0
        for s in range(num_steps):
            n = lens[b, s]
            if n == 0:
                for k in range(top_k):
                    slots[b, s, k] = -1
                continue
            stamp += 1
            if n <= hot:  # fast path: identity columns, then the newest/draft columns
                for k in range(top_k):
                    t = top[b, s, k]
                    if t < 0 or t >= n or seen[t] == stamp:
                        continue
                    seen[t] = stamp
                    if locs[row, t] >= 0:
                        res[t] = locs[row, t]
                        protected[t] = True
                        hits += 1
                    elif draft_of[t] >= 0:
                        res[t] = draft_of[t]
                        hits += 1
                    else:
                        res[t] = -1
                        lost += 1
            else:
                num_missed = 0
                num_wanted = 0
                num_selected = 0
                step_hits = 0
                for c in range(hot):
                    is_hit[c] = False
                for k in range(top_k):
                    t = top[b, s, k]
                    if t < 0 or t >= n or seen[t] == stamp:
                        continue
                    seen[t] = stamp
                    selected[num_selected] = t
                    num_selected += 1
                    if draft_of[t] >= 0:
                        res[t] = draft_of[t]
                        step_hits += 1
                        continue
                    wanted[num_wanted] = t
                    num_wanted += 1
                    if col_of[t] >= 0:
                        is_hit[col_of[t]] = True
                        res[t] = locs[row, col_of[t]]
                        step_hits += 1
                    else:
                        missed[num_missed] = t
                        num_missed += 1
                num_load = 0
                for i in range(num_missed):
                    t = missed[i]
                    h = host[row, t]
                    if h >= 0:
                        loadable[num_load] = t
                        loadable_host[num_load] = h
                        num_load += 1
                    else:
                        res[t] = -1
                num_evict = 0
                for i in range(hot):
                    c = order[i]
                    if not is_hit[c] and not protected[c]:
                        evictable[num_evict] = c
                        num_evict += 1
                if num_load > num_evict:  # stop before this step: it leaves no trace
                    done = s
                    for s2 in range(s, num_steps):
                        for k in range(top_k):
                            slots[b, s2, k] = -1
                    break
                keys_of = policy
                if num_load and policy in (ADAPTIVE, NEAR_ADAPTIVE):
                    stamp += 1  # the K most recently used hot columns' positions
                    for i in range(max(0, hot - top_k), hot):
                        p = tokens[row, order[i]]
                        if 0 <= p < width:
                            mark[p] = stamp
                    slid = 0
                    stayed = 0
                    for i in range(num_wanted):
                        t = wanted[i]
                        if t >= 1 and mark[t - 1] == stamp:
                            slid += 1
                        if mark[t] == stamp:
                            stayed += 1
                    keys_of = SLIDE if slid > stayed else (LRU if policy == ADAPTIVE else NEAR)
                for i in range(num_evict):
                    chosen[i] = i < num_load
                if (
                    num_load and keys_of == NEAR
                ):  # the columns holding neither a selected nor a near position first
                    stamp += 1
                    for i in range(num_selected):
                        mark[selected[i]] = stamp
                    for k in range(near.shape[2]):
                        t = near[b, s, k]
                        if 0 <= t < n:
                            mark[t] = stamp
                    left = num_load
                    for i in range(num_evict):
                        t = tokens[row, evictable[i]]
                        chosen[i] = left > 0 and not (0 <= t < width and mark[t] == stamp)
                        if chosen[i]:
                            left -= 1
                    for i in range(num_evict):
                        t = tokens[row, evictable[i]]
                        if left > 0 and not chosen[i] and 0 <= t < width and mark[t] == stamp:
                            chosen[i] = True
                            left -= 1
                elif num_load and keys_of in (SLIDE, SLIDE_LRU):  # farthest predicted use first
                    ranked = selected[:num_selected]  # sorted in place (the step is done reading it)
                    ranked.sort()
                    for i in range(num_evict):
                        t = tokens[row, evictable[i]]
                        at = np.searchsorted(ranked, t)  # the first selected >= t
                        d = t - ranked[at - 1] if at > 0 else FAR
                        if keys_of == SLIDE:
                            prio = FAR - d
                        else:
                            prio = 0 if d > hot else 1 + hot - d
                        keys[i] = (prio << KEY_SHIFT) | i
                    # the keys are unique (the index in the low bits): sorting them in place orders
                    # the indices as an argsort would, without allocating
                    by_key = keys[:num_evict]
                    by_key.sort()
                    for i in range(num_evict):
                        chosen[i] = False
                    for i in range(num_load):
                        chosen[by_key[i] & INDEX_MASK] = True
                # the victims in LRU order: the m-th loadable miss takes the m-th
                num_victims = 0
                for i in range(num_evict):
                    if chosen[i]:
                        victims[num_victims] = evictable[i]
                        num_victims += 1
                # [evictables kept | protected, unwanted | loaded (miss order) | hits], old order within
                j = 0
                for i in range(num_evict):
                    if not chosen[i]:
                        new_order[j] = evictable[i]
                        j += 1
                for i in range(hot):
                    c = order[i]
                    if protected[c] and not is_hit[c]:
                        new_order[j] = c
                        j += 1
                for i in range(num_load):
                    c = victims[i]
                    t = loadable[i]
                    old = tokens[row, c]
                    if 0 <= old < width and col_of[old] == c:
                        col_of[old] = -1
                    tokens[row, c] = t
                    col_of[t] = c
                    res[t] = locs[row, c]
                    copy_src[copies] = loadable_host[i]
                    copy_dst[copies] = locs[row, c]
                    copies += 1
                    new_order[j] = c
                    j += 1
                    protected[c] = True
                for i in range(hot):
                    c = order[i]
                    if is_hit[c]:
                        new_order[j] = c
                        j += 1
                        protected[c] = True
                for i in range(hot):
                    order[i] = new_order[i]
                hits += step_hits
                misses += num_load
                lost += num_missed - num_load
            for k in range(top_k):
                t = top[b, s, k]
                slots[b, s, k] = res[t] if 0 <= t < n else -1
        for c in range(hot):
            lru[row, c] = order[c]
            t = tokens[row, c]
            if 0 <= t < width:
                col_of[t] = -1
        for c in range(hot, cols):
            t = tokens[row, c]
            if 0 <= t < width:
                draft_of[t] = -1
        counts[b, 0] = done
        counts[b, 1] = hits
        counts[b, 2] = misses
        counts[b, 3] = lost
        all_hits += hits
        all_misses += misses
        all_lost += lost
        complete = complete and done == num_steps
    return copies, all_hits, all_misses, all_lost, complete


_compiled = None


def _compiled_kernel():
    global _compiled
    if _compiled is None:
        _compiled = numba.njit(cache=True, nogil=True)(_kernel)
    return _compiled


def swap_in_numba(
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
    close = near.numpy() if near is not None else np.empty((num_reqs, num_steps, 0), dtype=np.int32)
    slots = np.empty((num_reqs, num_steps, top_k), dtype=np.int32)
    counts = np.zeros((num_reqs, 4), dtype=np.int32)
    most = num_reqs * num_steps * top_k
    copy_src = np.empty(most, dtype=np.int64)
    copy_dst = np.empty(most, dtype=np.int64)
    copies, hits, misses, lost, complete = _compiled_kernel()(
        top_k_pos.numpy(),
        seq_lens.numpy(),
        req_rows.numpy(),
        buffer_tokens.numpy(),
        buffer_locs.numpy(),
        lru.numpy(),
        req_to_host.numpy(),
        hot,
        policy_code(policy),
        close,
        slots,
        counts,
        copy_src,
        copy_dst,
    )
    if copies:
        copy_rows_unchecked(
            device_kv, torch.from_numpy(copy_dst[:copies]), host_kv, torch.from_numpy(copy_src[:copies])
        )
    return SwapInResult.from_arrays(
        slots,
        counts,
        row_bytes=device_kv.shape[-1] * device_kv.element_size(),
        totals=(hits, misses, lost),
        complete=complete,
    )


def warm_up() -> None:
    """Compile (or load from numba's disk cache) the loops, so that a process's first decode step
    does not pay for it: one request, one step on the fast path."""
    swap_in_numba(
        torch.zeros(1, 1, 1, dtype=torch.int32),
        torch.ones(1, 1, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int64),
        torch.tensor([[0, -1]], dtype=torch.int32),
        torch.tensor([[1, -1]], dtype=torch.int64),
        torch.zeros(1, 1, dtype=torch.int32),
        torch.zeros(1, 2, dtype=torch.int64),
        torch.zeros(2, 1),
        torch.zeros(2, 1),
        1,
    )
