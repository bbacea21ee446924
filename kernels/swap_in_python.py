"""Swap-in for small batches on a CPU: the contract in plain Python, organised for speed.

For a decode step of a few requests, the vectorised torch reference spends its time in dozens of
tiny tensor ops per call. This version walks each request's columns once with dicts and sets, reads
only the host slots of its misses, and issues one row copy for the whole call. It implements the
contract of ``kernels.swap_in`` exactly and is tested against the oracle like the others;
``swap_in(impl="auto")`` picks it on CPU when the batch is small.
"""

from __future__ import annotations

from array import array

import torch

from kernels.swap_in_policy import choose_victims, step_policy
from kernels.swap_in_result import SwapInResult


def _ints(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of Python ints; through ``array`` it is several times faster than
    ``torch.tensor(list)`` at a few hundred entries, where tensor creation dominates a call."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array("q" if dtype == torch.int64 else "i", values), dtype=dtype)


def _draft_slots(tokens: list[int], locs: list[int], hot: int) -> dict[int, int]:
    """Position -> slot over the newest/draft columns, the first matching column winning."""
    found: dict[int, int] = {}
    for col in range(hot, len(tokens)):
        if tokens[col] >= 0 and locs[col] >= 0:
            found.setdefault(tokens[col], locs[col])
    return found


def _fast(top, n, tokens, locs, hot, out, protected) -> tuple[int, int]:
    draft = _draft_slots(tokens, locs, hot)
    resolved = unresolved = 0
    for t in dict.fromkeys(top):
        if not 0 <= t < n:
            continue
        if locs[t] >= 0:
            out[t] = locs[t]
            protected.add(t)
        elif t in draft:
            out[t] = draft[t]
        else:
            unresolved += 1
            continue
        resolved += 1
    return resolved, unresolved


def _near_victims(evictable, tokens, top, near, n, count):
    """``near``'s choice (``kernels.swap_in_policy``), in one pass: the ``count`` least recent
    evictable columns holding neither a selected nor a near position, then the least recent of the
    others. Returns (victims, untouched), each in LRU order."""
    keep = {t for t in top if 0 <= t < n}
    keep.update(t for t in near if 0 <= t < n)
    free = [tokens[c] not in keep for c in evictable]
    from_free = min(count, sum(free))
    from_kept = count - from_free
    victims, untouched = [], []
    for col, is_free in zip(evictable, free):
        if is_free and from_free:
            from_free -= 1
            victims.append(col)
        elif not is_free and from_kept:
            from_kept -= 1
            victims.append(col)
        else:
            untouched.append(col)
    return victims, untouched


def _long(top, n, tokens, locs, order, protected, host_row, hot, out, policy, near):
    """The LRU rules for one step, victims chosen by ``policy``; ``None`` on overflow (nothing
    changed), else
    (hits, loads [(col, pos)], their host slots, unrecoverable, new order, returned hot columns)."""
    draft = _draft_slots(tokens, locs, hot)
    wanted: dict[int, None] = {}
    draft_hits = 0
    for t in dict.fromkeys(top):
        if not 0 <= t < n:
            continue
        if t in draft:
            out[t] = draft[t]
            draft_hits += 1
        else:
            wanted[t] = None
    hit_cols, kept, evictable = [], [], []
    for col in order:
        if tokens[col] in wanted:
            hit_cols.append(col)
        elif col in protected:
            kept.append(col)
        else:
            evictable.append(col)
    held = {tokens[c] for c in hit_cols}
    missed = [t for t in wanted if t not in held]
    host_slots = host_row[_ints(missed, torch.int64)].tolist() if missed else []
    loadable = [(t, h) for t, h in zip(missed, host_slots) if h >= 0]
    if len(loadable) > len(evictable):
        return None
    if policy == "lru" or not loadable:
        victims = evictable[: len(loadable)]
        untouched = evictable[len(loadable) :]
    else:
        keys = policy
        if policy in ("adaptive", "near-adaptive"):
            recent = [tokens[c] for c in order[max(0, hot - len(top)) :]]  # the K most recent columns
            keys = step_policy(policy, list(wanted), recent)
        if keys == "near":
            victims, untouched = _near_victims(evictable, tokens, top, near, n, len(loadable))
        else:
            selected = sorted(t for t in set(top) if 0 <= t < n)
            picked = choose_victims(keys, [tokens[c] for c in evictable], selected, len(loadable), hot)
            chosen = set(picked)
            victims = [evictable[i] for i in picked]
            untouched = [c for i, c in enumerate(evictable) if i not in chosen]
    for col in hit_cols:
        out[tokens[col]] = locs[col]
    for col, (t, _) in zip(victims, loadable):
        out[t] = locs[col]
    new_order = untouched + kept + victims + hit_cols
    loads = [(col, t) for col, (t, _) in zip(victims, loadable)]
    unrecoverable = len(missed) - len(loadable)
    return (
        draft_hits + len(hit_cols),
        loads,
        [h for _, h in loadable],
        unrecoverable,
        new_order,
        hit_cols + victims,
    )


def swap_in_python(
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
    tops = top_k_pos.tolist()
    nears = near.tolist() if near is not None else None
    lens = seq_lens.tolist()
    slots: list[int] = []  # flat [B, S, K]
    counts: list[int] = []  # flat [B, 4]: steps_done, hits, misses, unrecoverable
    copy_src: list[int] = []
    copy_dst: list[int] = []
    for b, row in enumerate(req_rows.tolist()):
        tokens, locs, order = buffer_tokens[row].tolist(), buffer_locs[row].tolist(), lru[row].tolist()
        old_order = order
        protected: set[int] = set()
        done, hits, misses, lost = num_steps, 0, 0, 0
        loaded = False  # only the long path changes the tables: it loads and reorders the LRU
        for s in range(num_steps):
            n = lens[b][s]
            if n == 0:
                slots += [-1] * top_k
                continue
            top, out = tops[b][s], {}
            if n <= hot:
                resolved, unresolved = _fast(top, n, tokens, locs, hot, out, protected)
                hits += resolved
                lost += unresolved
            else:
                close = nears[b][s] if nears is not None else []
                step = _long(top, n, tokens, locs, order, protected, req_to_host[row], hot, out, policy, close)
                if step is None:
                    done = s
                    slots += [-1] * (top_k * (num_steps - s))
                    break
                step_hits, loads, host_slots, unrecoverable, order, returned = step
                loaded = loaded or bool(loads)
                hits += step_hits
                misses += len(loads)
                lost += unrecoverable
                for (col, t), h in zip(loads, host_slots):
                    tokens[col] = t
                    copy_src.append(h)
                    copy_dst.append(locs[col])
                protected.update(returned)
            slots += [out.get(t, -1) if 0 <= t < n else -1 for t in top]
        counts += (done, hits, misses, lost)
        # write back only what changed: in a steady decode the same hot set often repeats
        if loaded:
            buffer_tokens[row] = _ints(tokens, torch.int32)
        if order != old_order:
            lru[row] = _ints(order, torch.int32)
    if copy_src:
        src = _ints(copy_src, torch.int64).to(host_kv.device)
        dst = _ints(copy_dst, torch.int64).to(device_kv.device)
        device_kv.index_copy_(0, dst, host_kv.index_select(0, src).to(device_kv.device))
    row_bytes = device_kv.shape[-1] * device_kv.element_size()
    loaded = sum(counts[2::4])
    return SwapInResult(
        slots=_ints(slots, torch.int32).reshape(num_reqs, num_steps, top_k),
        counts=_ints(counts, torch.int32).reshape(num_reqs, 4),
        row_bytes=row_bytes,
        totals=(sum(counts[1::4]), loaded, sum(counts[3::4]), loaded * row_bytes),
    )
