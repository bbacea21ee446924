"""Swap-in for the queries of a prefill chunk: the earlier positions they select, in groups.

Decode resolves one query per request per layer (``kernels.swap_in``, step by step, each step
seeing the state the previous one left). A prefill chunk has hundreds of queries per request, and
resolving them step by step costs one kernel step per query. Here the chunk's queries are resolved
in *groups* instead: consecutive queries whose earlier positions (their union) fit in the hot region
together. For each group, in one vectorised pass over one layer of one request:

1. the union's positions already held by a hot column are hits;
2. the others are loaded from host into the least recently used hot columns that hold none of the
   union (a group's union is at most HOT positions, so there are always enough);
3. the new LRU order is ``[untouched columns | hit columns | loaded columns]`` (old order, old
   order, load order), the group's positions the most recent;
4. the caller attends over the group before the next group may evict its columns.

The device rows a short chunk leaves unused (its chunk rows past its own positions) serve the call as
extra columns, so groups can be larger than HOT; they are forgotten when the call ends.

A chunk whose earlier positions are all below HOT reads them from their identity columns (the
request is still short: nothing was ever evicted), with no copy. Rows are the same values as their
host copies, so the attention output does not depend on the grouping; only hit and miss counts do.
Per-layer state stays the buffer's own (``tokens``, ``lru``): nothing grows with the context.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numba
import numpy as np
import torch

from pipeline.memory.host_pool import to_device


def group_bounds(past: torch.Tensor, hot: int, context: int) -> list[tuple[int, int]]:
    """``[a, b)`` query ranges of ``past [S, K]`` (positions below ``context``, -1 = none; a query's
    positions are distinct, as a top-k's are) whose unions fit ``hot``: greedily, a group grows by
    the next query while the union stays within ``hot`` (a query alone always makes a group).

    A compiled loop (one pass over the queries, a group's members marked by its number, so a new
    group clears nothing); ``group_bounds_reference`` is the oracle of the tests."""
    rows = past.cpu().numpy()
    if rows.shape[0] == 0:
        return group_bounds_reference(past, hot, context)
    starts = np.empty(rows.shape[0] + 1, dtype=np.int64)
    count = _group_kernel(rows, hot, context, starts)
    starts[count] = rows.shape[0]
    return list(zip(starts[:count].tolist(), starts[1 : count + 1].tolist(), strict=True))


def group_bounds_reference(past: torch.Tensor, hot: int, context: int) -> list[tuple[int, int]]:
    """``group_bounds`` as a Python loop over the queries."""
    rows = past.cpu().numpy()
    seen = np.zeros(context, dtype=bool)
    bounds, start, size = [], 0, 0
    for i in range(rows.shape[0]):
        q = rows[i]
        q = q[q >= 0]
        new = q[~seen[q]]
        if size + new.size > hot and i > start:
            bounds.append((start, i))
            seen[:] = False
            start, size, new = i, 0, q
        seen[new] = True
        size += new.size
    bounds.append((start, rows.shape[0]))
    return bounds


def _group_kernel(rows, hot, context, starts):  # pragma: no cover, no mutate block - compiled
    """Writes the first query of every group to ``starts``; returns the number of groups."""
    member = np.zeros(context, dtype=np.int64)  # the number of the last group holding each position
    group, size, count = 1, 0, 1
    starts[0] = 0
    for i in range(rows.shape[0]):
        new = 0
        for j in range(rows.shape[1]):
            p = rows[i, j]
            if p >= context:
                raise IndexError("prefill swap-in: a past position is not below the chunk's start")
            if p >= 0 and member[p] != group:
                new += 1
        if size + new > hot and i > starts[count - 1]:
            group += 1
            starts[count] = i
            count += 1
            size = 0
            new = 0
            for j in range(rows.shape[1]):
                if rows[i, j] >= 0:
                    new += 1
        for j in range(rows.shape[1]):
            p = rows[i, j]
            if p >= 0:
                member[p] = group
        size += new
    return count


# compiled on its first call (or loaded from numba's disk cache)
_group_kernel = numba.njit(cache=True, nogil=True)(_group_kernel)


def warm_up() -> None:
    """Compile (or load from numba's disk cache) the grouping loop for int32 top-k rows."""
    _group_kernel(np.array([[0, -1], [1, 0]], dtype=np.int32), 2, 2, np.empty(3, dtype=np.int64))


def prefill_swap_rounds(
    coord: Any, layer: int, row: int, past: torch.Tensor, start: int, scratch: torch.Tensor | None = None
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Resolve ``past [S, K]`` (earlier positions of a chunk starting at ``start``; -1 = none) of one
    request row in one layer. Yields ``(a, b, slots [b - a, K])`` per group of queries; the caller
    attends over it before resuming.

    ``scratch``: device slots of the request that this chunk leaves unused (its chunk rows past the
    chunk's own positions). For the length of the call they are extra columns after the hot region,
    the least recently used at first: groups may then be larger than HOT, so a short chunk at a long
    context takes fewer groups. Nothing of them is remembered after the call; the hot region keeps
    its positions and LRU order (its columns' relative order in the call's order)."""
    buffers, hot = coord.buffers, coord.hot
    dev = past.device
    if start <= hot:  # still short: every earlier position sits in its identity column
        ids = buffers.locs[row]
        yield 0, past.shape[0], torch.where(past >= 0, ids[past.long().clamp(min=0)], -1)
        return
    extra = torch.empty(0, dtype=torch.int64, device=dev) if scratch is None else scratch.to(dev)
    width = hot + extra.numel()
    # the call's columns: the hot region's (tracked), then the scratch rows (forgotten afterwards)
    held = torch.cat([buffers.tokens[layer, row, :hot].long(), torch.full_like(extra, -1)])
    locs = torch.cat([buffers.locs[row, :hot], extra])
    order = torch.cat([hot + torch.arange(extra.numel(), device=dev), buffers.lru[layer, row].long()])
    host_map = coord.req_to_host_device[row]
    host_kv, device_kv = coord.host.kv[layer], coord.device_kv[layer]
    row_bytes = device_kv.shape[-1] * device_kv.element_size()
    col_of = torch.full((start,), -1, dtype=torch.int64, device=dev)
    for a, b in group_bounds(past, width, start):
        group = past[a:b]
        mark = torch.zeros(start, dtype=torch.bool, device=dev)  # the union, ascending, without a sort
        mark[group[group >= 0].long()] = True
        union = torch.nonzero(mark).reshape(-1)
        col_of.fill_(-1)
        live = held >= 0
        col_of[held[live]] = torch.nonzero(live).reshape(-1)
        cols = col_of[union]
        hit = cols >= 0
        missed = union[~hit]
        wanted = torch.zeros(width, dtype=torch.bool, device=dev)
        wanted[cols[hit]] = True
        free = order[~wanted[order]]  # columns holding none of the union, least recent first
        victims = free[: missed.numel()]
        if missed.numel():
            src = host_map[missed]
            if bool((src < 0).any()):
                raise RuntimeError(f"row {row} layer {layer}: an earlier prompt position has no host copy")
            # a CPU gather (through a pinned block on CUDA): ``prefill_targets`` waited for the copies
            # that wrote these rows (the previous chunks'; a shared prefix's landed before it was cached)
            device_kv[locs[victims]] = to_device(host_kv, src, device_kv.device)
            held[victims] = missed
            col_of[missed] = victims
        order = torch.cat([free[missed.numel() :], order[wanted[order]], victims])
        coord.counters.add_prefill_loads(layer, int(hit.sum()), missed.numel(), missed.numel() * row_bytes)
        entry_cols = col_of[group.long().clamp(min=0)]
        yield a, b, torch.where(group >= 0, locs[entry_cols.clamp(min=0)], -1)
    buffers.tokens[layer, row, :hot] = held[:hot].to(buffers.tokens.dtype)
    buffers.lru[layer, row] = order[order < hot].to(buffers.lru.dtype)
