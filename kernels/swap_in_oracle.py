"""The swap-in oracle: a slow per-request Python loop that reads like the rules in ``swap_in``.

It exists to be obviously correct, not fast: plain lists, sets and dicts, one request and one step
at a time, each rule of the contract written out once. The torch reference and the Triton kernel are
tested for exact agreement with it (slots, buffer tokens, LRU order, copied rows, counters and
``steps_done``). Like the other implementations it mutates ``buffer_tokens``, ``lru`` and
``device_kv`` in place.
"""

from __future__ import annotations

import attrs
import torch

from kernels.swap_in_policy import choose_victims, step_policy
from kernels.swap_in_result import SwapInResult


@attrs.define(eq=False)
class _Request:
    """One request's state for one layer, as Python lists (mutated step by step)."""

    tokens: list[int]  # position held by each buffer column, -1 empty
    locs: list[int]  # physical slot of each column, -1 beyond capacity
    lru: list[int]  # hot columns, least recently used first
    host: list[int]  # host slot of each position, -1 = no host copy
    protected: set[int] = attrs.field(factory=set)  # hot columns returned earlier in this call


@attrs.frozen
class _Step:
    """What one resolved step produced; ``lru`` and ``loads`` are applied only if it is kept."""

    slots: list[int]
    hits: int
    unrecoverable: int
    lru: list[int]
    loads: list[tuple[int, int]]  # (column, position) newly loaded, in miss order
    returned: set[int]  # hot columns this step returned (protected for the rest of the call)


def _draft_slot(req: _Request, hot: int, t: int) -> int | None:
    """Slot of position t in the newest/draft columns [hot, hot + P), first match wins."""
    for col in range(hot, len(req.tokens)):
        if req.tokens[col] == t and req.locs[col] >= 0:
            return req.locs[col]
    return None


def _fast_step(top: list[int], n: int, req: _Request, hot: int) -> _Step:
    """seq_len <= hot: identity columns, else the newest/draft columns; no LRU change, no loads."""
    slot_of: dict[int, int] = {}
    returned: set[int] = set()
    for t in dict.fromkeys(top):
        if not 0 <= t < n:
            continue
        if req.locs[t] >= 0:
            slot_of[t] = req.locs[t]
            returned.add(t)
        else:
            slot_of[t] = -1 if (s := _draft_slot(req, hot, t)) is None else s
    resolved = sum(1 for s in slot_of.values() if s >= 0)
    slots = [slot_of.get(t, -1) for t in top]
    return _Step(slots, resolved, len(slot_of) - resolved, list(req.lru), [], returned)


def _long_step(top: list[int], n: int, req: _Request, hot: int, policy: str, near: list[int]) -> _Step | None:
    """seq_len > hot: the LRU rules, victims chosen by ``policy``; ``None`` when the misses need more
    evictable columns than exist."""
    slot_of: dict[int, int] = {}
    wanted: list[int] = []  # unique positions to find among the hot columns, first appearance order
    for t in dict.fromkeys(top):
        if not 0 <= t < n:
            continue
        s = _draft_slot(req, hot, t)
        if s is None:
            wanted.append(t)
        else:
            slot_of[t] = s
    num_draft_hits = len(slot_of)
    wanted_set = set(wanted)
    hit_cols = [c for c in req.lru if req.tokens[c] in wanted_set]
    held = {req.tokens[c] for c in hit_cols}
    evictable = [c for c in req.lru if c not in hit_cols and c not in req.protected]
    kept = [c for c in req.lru if c not in hit_cols and c in req.protected]
    missed = [t for t in wanted if t not in held]
    loadable = [t for t in missed if req.host[t] >= 0]
    if len(loadable) > len(evictable):
        return None
    selected = sorted(t for t in set(top) if 0 <= t < n)
    recent = [req.tokens[c] for c in req.lru[max(0, hot - len(top)) :]]  # the K most recent columns
    keys = step_policy(policy, wanted, recent)
    close = [t for t in near if 0 <= t < n]  # the step's valid near positions
    picked = choose_victims(keys, [req.tokens[c] for c in evictable], selected, len(loadable), hot, close)
    victims = [evictable[i] for i in picked]
    for c in hit_cols:
        slot_of[req.tokens[c]] = req.locs[c]
    for c, t in zip(victims, loadable):
        slot_of[t] = req.locs[c]
    new_lru = [c for c in evictable if c not in victims] + kept + victims + hit_cols
    slots = [slot_of.get(t, -1) if 0 <= t < n else -1 for t in top]
    hits = num_draft_hits + len(hit_cols)
    return _Step(slots, hits, len(missed) - len(loadable), new_lru, list(zip(victims, loadable)),
                 set(hit_cols) | set(victims))


def swap_in_oracle(
    top_k_pos: torch.Tensor,  # [B, S, K] int32, -1 = none
    seq_lens: torch.Tensor,  # [B, S] int64, 0 = padding step
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
    """Per-request Python loop implementing the contract of ``kernels.swap_in.swap_in``."""
    num_reqs, num_steps, top_k = top_k_pos.shape
    slots = [[[-1] * top_k for _ in range(num_steps)] for _ in range(num_reqs)]
    counts = [[num_steps, 0, 0, 0] for _ in range(num_reqs)]  # steps_done, hits, misses, unrecoverable
    for b, row in enumerate(req_rows.tolist()):
        req = _Request(buffer_tokens[row].tolist(), buffer_locs[row].tolist(), lru[row].tolist(),
                       req_to_host[row].tolist())
        for s in range(num_steps):
            n = int(seq_lens[b, s])
            if n == 0:
                continue  # padding step: -1, no state change
            top = top_k_pos[b, s].tolist()
            close = near[b, s].tolist() if near is not None else []
            step = _fast_step(top, n, req, hot) if n <= hot else _long_step(top, n, req, hot, policy, close)
            if step is None:
                counts[b][0] = s  # stop before this step: it and later steps stay -1
                break
            slots[b][s] = step.slots
            counts[b][1] += step.hits
            counts[b][2] += len(step.loads)
            counts[b][3] += step.unrecoverable
            req.lru = step.lru
            req.protected |= step.returned
            for col, t in step.loads:
                req.tokens[col] = t
                device_kv[req.locs[col]] = host_kv[req.host[t]].to(device_kv.device)
        buffer_tokens[row] = torch.tensor(req.tokens, dtype=buffer_tokens.dtype)
        lru[row] = torch.tensor(req.lru, dtype=lru.dtype)
    c = torch.tensor(counts, dtype=torch.int32).reshape(num_reqs, 4)
    return SwapInResult.from_counts(
        torch.tensor(slots, dtype=torch.int32).reshape(num_reqs, num_steps, top_k), c,
        row_bytes=device_kv.shape[-1] * device_kv.element_size(),
    )
