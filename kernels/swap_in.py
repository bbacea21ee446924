"""Swap-in: resolve the indexer's top-k positions to physical device slots, loading misses from host.

One call handles one layer for a batch of requests, each with ``S`` steps (``S = 1`` for decode,
``S = D`` for a verify pass). Per request, in step order, for a step whose query sees ``n`` positions
(``n = seq_lens[b, s]``; 0 marks a padding step, which outputs -1 and changes nothing):

* **Fast path** ``n <= hot``: entry t is valid iff ``0 <= t < n``; it maps to ``buffer_locs[t]`` (the
  identity column) when that is >= 0, else to the first newest/draft column ``c`` in
  ``[hot, hot + P)`` with ``buffer_tokens[c] == t`` and ``buffer_locs[c] >= 0``, else -1. No LRU
  update, no host load.
* **Long path** ``n > hot``:

  1. invalid entries (t < 0 or t >= n) give -1; entries found in the newest/draft columns give that
     slot; the rest are *wanted* from the hot columns;
  2. scan ``lru`` from least to most recent: a column holding a wanted position is a **hit**; a
     column returned by an earlier step of this call is **protected**; every other column is
     **evictable**, in LRU order;
  3. the replacement policy (``policy``, ``kernels.swap_in_policy``) picks as many *victims* among
     the evictable columns as the step has loadable misses; under ``lru`` (the default) they are the
     least recently used ones. Each missed unique position, in order of first appearance in the
     top-k row, that has a host copy takes the next victim in LRU order: host row
     ``req_to_host[r, t]`` is copied into ``device_kv[buffer_locs[col]]`` and
     ``buffer_tokens[col] = t``. A miss without a host copy gives -1 (**unrecoverable**; the caller
     treats it as an invariant violation);
  4. new LRU order::

         [evictables kept | protected, unwanted | newly loaded | hits]
          old order        old order             miss order     old order  (least -> most recent)

  Duplicate entries of one position resolve to the same slot and count once.

* **Multi-step.** The steps of one call are resolved in order on the evolving state, so a position
  loaded by step j is a hit for step j + 1 (each position is copied at most once per call), and no
  step evicts a hot column that an earlier step of the call returned (fast-path identity columns
  included). If a step's loadable misses outnumber its evictable columns, the call **stops before
  that step**: it and every later step output -1 and leave no trace in the state, and
  ``steps_done[b]`` is the index of that step (``S`` when every step was handled; padding steps count
  as handled). The caller attends over the resolved steps and calls again for the rest, with
  protection starting afresh. ``hot >= top_k`` guarantees progress (the first non-padding step of a
  call always fits: hits + misses <= top_k <= hot, nothing is protected yet); ``hot >= S * top_k``
  guarantees that one call resolves every step.

Counters, per request (``SwapInResult``), each over the *unique valid* positions of each resolved
step, so ``hits + misses + unrecoverable`` is the number of (step, unique valid position) pairs:

* ``hits``: resolved without a copy: fast-path identity or draft-column entries, long-path draft
  columns and hot-column hits (a position loaded by an earlier step of the call is a hit);
* ``misses``: positions loaded host->device (= rows copied);
* ``unrecoverable``: valid positions left at -1 (long path: no host copy; fast path: no slot);
* ``bytes_copied``: ``misses * row bytes`` of ``device_kv``.

Preconditions (checked with ``validate=True``, which synchronises on CUDA): ``req_rows`` unique and in
range; ``0 <= seq_lens <= max_ctx``; each ``lru`` row a permutation of ``0..hot-1``; in the long path
every hot column has a slot; valid hot-column tokens unique per request; physical slots disjoint
across requests (so every row copy of a call has its own destination).
"""

from __future__ import annotations

import torch

from kernels.checks import check_index_range, check_same_device, check_tensor, check_unique, resolve_impl
from kernels.swap_in_policy import NEAR_POLICIES, POLICIES
from kernels.swap_in_result import SwapInResult

# Triton kernel size limits. One program per request walks the top-k row, the hot columns, the
# newest/draft columns and the near row in fixed tiles (``kernels.swap_in_triton``), so its registers
# do not grow with the sizes; its work does (compares of a top-k tile with every other tile). HOT and
# top-k stop at the largest the tests run against the reference (V3.2's top-k 2048 with SGLang's HOT
# 4096); larger shapes take the torch path until a test has run them.
TRITON_MAX_HOT = 4096
TRITON_MAX_TOP_K = 2048
TRITON_MAX_EXTRA = 1024  # newest + draft columns (P)
TRITON_MAX_NEAR = 2048  # near positions per step (the near-policies' default margin is top_k)


def check_swap_in_args(
    top_k_pos, seq_lens, req_rows, buffer_tokens, buffer_locs, lru, req_to_host, host_kv, device_kv, hot
) -> None:
    """Shapes, dtypes, strides and devices (no synchronisation)."""
    check_tensor("top_k_pos", top_k_pos, ndim=3, dtype=torch.int32, contiguous_last=True)
    b, s, k = top_k_pos.shape
    check_tensor("seq_lens", seq_lens, dtype=torch.int64, shape=(b, s), contiguous_last=True)
    check_tensor("req_rows", req_rows, dtype=torch.int64, shape=(b,), contiguous_last=True)
    check_tensor("buffer_tokens", buffer_tokens, ndim=2, dtype=torch.int32, contiguous_last=True)
    n, width = buffer_tokens.shape
    if not isinstance(hot, int) or hot < 1 or width <= hot:
        raise ValueError(
            f"hot must be an int in [1, {width}) (buffer_tokens has {width} columns), got {hot!r}"
        )
    if k > hot:
        raise ValueError(f"top_k_pos has top_k={k} > hot={hot}: a single step might not fit")
    check_tensor("buffer_locs", buffer_locs, dtype=torch.int64, shape=(n, width), contiguous_last=True)
    check_tensor("lru", lru, dtype=torch.int32, shape=(n, hot), contiguous_last=True)
    check_tensor("req_to_host", req_to_host, ndim=2, dtype=torch.int64, contiguous_last=True)
    if req_to_host.shape[0] != n:
        raise ValueError(f"req_to_host must have {n} rows like buffer_tokens, got {tuple(req_to_host.shape)}")
    check_tensor("device_kv", device_kv, ndim=2, contiguous_last=True)
    check_tensor(
        "host_kv",
        host_kv,
        ndim=2,
        dtype=device_kv.dtype,
        shape=(None, device_kv.shape[1]),
        contiguous_last=True,
    )
    names = (
        "top_k_pos",
        "seq_lens",
        "req_rows",
        "buffer_tokens",
        "buffer_locs",
        "lru",
        "req_to_host",
        "device_kv",
    )
    check_same_device(
        names, (top_k_pos, seq_lens, req_rows, buffer_tokens, buffer_locs, lru, req_to_host, device_kv)
    )


def check_swap_in_state(seq_lens, req_rows, buffer_locs, lru, req_to_host, host_kv, device_kv) -> None:
    """The data preconditions of the module docstring (synchronises on CUDA)."""
    n, max_ctx = req_to_host.shape
    hot = lru.shape[1]
    check_index_range("req_rows", req_rows, n)
    check_unique("req_rows", req_rows)
    check_index_range("seq_lens", seq_lens, max_ctx + 1)
    rows = req_rows.long()
    perm_ok = torch.sort(lru[rows].long(), dim=1).values == torch.arange(hot, device=lru.device)
    if not bool(perm_ok.all()):
        raise ValueError("lru rows of req_rows must be permutations of 0..hot-1")
    check_index_range("buffer_locs", buffer_locs[rows], device_kv.shape[0], allow_negative=True)
    check_unique("buffer_locs", buffer_locs[rows], ignore_negative=True)
    check_index_range("req_to_host", req_to_host[rows], host_kv.shape[0], allow_negative=True)


def identity_only(
    top_k_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    req_rows: torch.Tensor,
    buffer_locs: torch.Tensor,
    hot: int,
) -> SwapInResult | None:
    """The whole call on the fast path, as a few tensor ops, when it can be (CPU tensors): every
    step sees at most ``hot`` positions and every valid entry's identity column has a slot. Then
    each valid entry maps to its identity column, every unique one counts as a hit, and nothing
    else changes (no draft column is consulted, no LRU order or token moves), which is exactly what
    the implementations do on such a call. None when the call needs them (some step is long, or an
    identity column has no slot yet)."""
    if seq_lens.numel() == 0 or int(seq_lens.max()) > hot:
        return None
    pos = top_k_pos.long()
    valid = (pos >= 0) & (pos < seq_lens[..., None])  # [B, S, K]
    locs = buffer_locs.index_select(0, req_rows)[:, None, :].expand(-1, pos.shape[1], -1)  # [B, S, HOT+P]
    slots = torch.gather(locs, 2, pos.clamp(0, hot - 1))
    if bool((valid & (slots < 0)).any()):
        return None
    # unique valid positions per step: the marks they leave in a [B, S, hot] table (invalid -> column hot)
    seen = torch.zeros(*pos.shape[:2], hot + 1, dtype=torch.int32)
    seen.scatter_(2, torch.where(valid, pos, hot), 1)
    hits = seen[..., :hot].sum(dim=(1, 2), dtype=torch.int32)
    counts = torch.zeros(hits.shape[0], 4, dtype=torch.int32)
    counts[:, 0] = pos.shape[1]
    counts[:, 1] = hits
    return SwapInResult(
        slots=torch.where(valid, slots, -1).to(torch.int32),
        counts=counts,
        row_bytes=0,  # nothing is copied
        totals=(int(hits.sum()), 0, 0, 0),
        complete=True,
    )


def swap_in(
    top_k_pos: torch.Tensor,  # [B, S, K] int32, -1 = none, duplicates allowed
    seq_lens: torch.Tensor,  # [B, S] int64 visible length of each step's query, 0 = padding
    req_rows: torch.Tensor,  # [B] int64
    buffer_tokens: torch.Tensor,  # [N, HOT+P] int32, mutated
    buffer_locs: torch.Tensor,  # [N, HOT+P] int64
    lru: torch.Tensor,  # [N, HOT] int32, mutated
    req_to_host: torch.Tensor,  # [N, max_ctx] int64
    host_kv: torch.Tensor,  # [host_rows, dim]
    device_kv: torch.Tensor,  # [dev_rows, dim], rows loaded
    hot: int,
    *,
    impl: str = "auto",
    policy: str = "lru",
    near: torch.Tensor | None = None,
    validate: bool = False,
    check: bool = True,
) -> SwapInResult:
    """Resolve top-k positions to device slots for one layer (contract: module docstring).

    ``impl``: ``"torch"`` (reference), ``"triton"``, ``"numba"`` (CPU, compiled) or ``"auto"``
    (Triton when the metadata is on CUDA and the shapes fit ``TRITON_MAX_*``, else torch; on CPU,
    ``identity_only`` when the whole call is on the fast path, else numba). ``host_kv`` may live on
    another device (pinned host memory); the row copies then go through torch.
    ``check=False`` skips the shape/dtype/device checks of the arguments: for callers that built them
    themselves (the engine's attention backends), where the checks are per-call overhead only.
    ``policy``: the replacement policy choosing the victims (``kernels.swap_in_policy.POLICIES``).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    args = (
        top_k_pos, seq_lens, req_rows, buffer_tokens, buffer_locs, lru, req_to_host, host_kv, device_kv, hot
    )
    if check:
        check_swap_in_args(*args)
        if near is not None:
            check_tensor(
                "near",
                near,
                ndim=3,
                dtype=torch.int32,
                shape=(*top_k_pos.shape[:2], None),
                contiguous_last=True,
            )
            check_same_device(("top_k_pos", "near"), (top_k_pos, near))
    if policy not in NEAR_POLICIES or (near is not None and near.shape[2] == 0):
        near = None  # only the near-policies read it
    if validate:
        check_swap_in_state(seq_lens, req_rows, buffer_locs, lru, req_to_host, host_kv, device_kv)
    fits = (
        hot <= TRITON_MAX_HOT
        and top_k_pos.shape[2] <= TRITON_MAX_TOP_K
        and buffer_tokens.shape[1] - hot <= TRITON_MAX_EXTRA
        and (near is None or near.shape[2] <= TRITON_MAX_NEAR)
    )
    if impl == "auto" and top_k_pos.device.type == "cpu":
        # (one step of one request costs the per-request loops less than these tensor ops)
        short = (
            identity_only(top_k_pos, seq_lens, req_rows, buffer_locs, hot) if seq_lens.numel() > 1 else None
        )
        if short is not None:
            return short
        impl = "numba"
    if impl == "numba":
        from kernels.swap_in_numba import swap_in_numba

        if top_k_pos.device.type != "cpu":
            raise ValueError(f"impl='numba' needs CPU tensors, got top_k_pos on {top_k_pos.device}")
        return swap_in_numba(*args, policy, near)
    if resolve_impl(impl, (top_k_pos, buffer_tokens, device_kv), triton_fits=fits) == "triton":
        from kernels.swap_in_triton import swap_in_triton

        return swap_in_triton(*args, policy, near)
    from kernels.swap_in_reference import swap_in_reference

    return swap_in_reference(*args, policy, near)
