"""Indexer top-k on a CPU as compiled loops (contract: ``kernels.indexer_topk``), with numba.

For a decode or verify step each query sees its request's whole context, a few thousand keys, and
selects a few dozen. The torch path gathers every request's keys into one tensor (a copy of the
keys the size of the batch's contexts), scores them by two batched matmuls and selects with
``torch.topk``: three passes over memory. Here each query walks its visible positions in blocks
of ``BLOCK``: the block's key rows are read where they lie (``index_k[req_to_token[row, s]]``) and
dotted with the query's heads, then the block's scores are formed, then each score above the worst
kept is offered to a bounded heap of the ``top_k`` best seen so far; nothing the size of the context
is written. Consecutive queries of one request (a verify step's) share each block's locations, so
the key rows the first of them read are still in cache for the others.

The heap keeps the contract's order: an entry is worse than another when its score is lower, or equal and its
position higher. Until it holds ``top_k`` entries they are kept in arrival order and ordered once, bottom-up,
when it fills, which costs less than sifting each one in. Positions come in increasing order, so a new score
enters a full heap only if it is strictly above the worst one (an equal score comes later and loses the tie).
The heap is not popped in order at the end (a sift-down per entry, each level an unpredictable branch): each
kept entry is written at its rank, the number of kept entries before it in contract order, counted branch-free
over all of them (``top_k`` squared comparisons that the compiler vectorises, cheaper than the pops at the
top-k sizes served; docs/performance-notes.md). Rows with fewer visible positions than ``top_k`` (never
ordered as a heap) are padded with -1, and a ``-inf`` score is never selected (the torch path writes -1 for it
too), nor is a NaN score (a NaN compares false both ways, which would leave two entries one rank and a rank
unwritten: a garbage position). ``-0.0`` equals ``0.0`` in every comparison.

Scores are summed in the score dtype (float32, float64 for float64 inputs) in the order the
compiler vectorises them (``reassoc``), so they agree with the torch path's to rounding, as the
Triton kernel's do; the selection given the scores is exact. Float32 and float64 tensors only (the
compiled loops read numpy views); ``indexer_topk(impl="auto")`` sends the queries of requests with
few queries each (decode, verify) here on a CPU when numba is installed and the heads are small
(``MAX_HEAD_DIMS``), and prefill to the matmuls, but for short contexts (``prefill_context``).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

DTYPES = (torch.float32, torch.float64)
BLOCK = 16  # positions scored together: their dots, then their scores, then the heap
# ``indexer_topk(impl="auto")`` runs the loop only for queries of at most this many head x dim
# products per key: there the torch path's gather of the keys costs more than its matmuls, which
# the loop beats; with more (16 heads of 64 and up, DeepSeek's 64 of 128) BLAS does the dots faster
# (the shapes measured on each side: docs/performance-notes.md).
MAX_HEAD_DIMS = 512
# ``indexer_topk(impl="auto")`` also sends the queries of a request with many of them (a prefill
# chunk) here when none sees more than ``prefill_context`` positions: this many head x dim x position
# products per query. The torch path's cost there is its selection (``torch.topk`` and the masks over
# score rows), not its matmuls, while a query sees few positions; a long prompt's later chunks
# stay on the matmuls (figures: docs/performance-notes.md).
PREFILL_DOTS = 1 << 16


def _jit(**options):
    """Compiled on first call and cached on disk."""
    return numba.njit(cache=True, nogil=True, **options)


@_jit(inline="always")
def _worse(score_a, pos_a, score_b, pos_b):  # pragma: no cover - compiled
    """Entry a comes after entry b in the contract's order."""
    return score_a < score_b or (score_a == score_b and pos_a > pos_b)


@_jit()
def _sift_from(heap_s, heap_p, size, i, score, pos):  # pragma: no cover - compiled
    """Put (score, pos) at index ``i`` of the min-heap ``[:size]`` (worst at the root), whose
    subtrees below ``i`` are heaps, and sift it down."""
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and _worse(heap_s[child + 1], heap_p[child + 1], heap_s[child], heap_p[child]):
            child += 1
        if not _worse(heap_s[child], heap_p[child], score, pos):
            break
        heap_s[i] = heap_s[child]
        heap_p[i] = heap_p[child]
        i = child
    heap_s[i] = score
    heap_p[i] = pos


@_jit()
def _sift_down(heap_s, heap_p, size, score, pos):  # pragma: no cover - compiled
    """Put (score, pos) at the root of the min-heap ``[:size]`` and restore it."""
    _sift_from(heap_s, heap_p, size, 0, score, pos)


@_jit()
def _heapify(heap_s, heap_p, size):  # pragma: no cover - compiled
    """Order the entries ``[:size]`` (in any order) as the min-heap (Floyd's bottom-up build)."""
    for start in range(size // 2 - 1, -1, -1):
        _sift_from(heap_s, heap_p, size, start, heap_s[start], heap_p[start])


@_jit(fastmath={"reassoc", "contract", "nsz"})
def _kernel(q, w, keys, req_to_token, rows, lens, scale, top_k, out):  # pragma: no cover - compiled
    num_tokens, heads, dim = q.shape
    zero = scale - scale  # of the score dtype (scale * 0 would be float64)
    heap_s = np.empty((num_tokens, top_k), q.dtype)
    heap_p = np.empty((num_tokens, top_k), np.int64)
    sizes = np.zeros(num_tokens, np.int64)
    locs = np.empty(BLOCK, np.int64)
    dots = np.empty((BLOCK, heads), q.dtype)
    scores = np.empty(BLOCK, q.dtype)
    first = 0
    while first < num_tokens:  # a run of consecutive queries of one request shares each key block
        row = rows[first]
        last = first + 1
        while last < num_tokens and rows[last] == row:
            last += 1
        longest = 0
        for t in range(first, last):
            longest = max(longest, lens[t])
        for start in range(0, longest, BLOCK):
            block = min(BLOCK, longest - start)
            for i in range(block):
                locs[i] = req_to_token[row, start + i]
            for t in range(first, last):
                seen = min(block, lens[t] - start)
                for i in range(seen):  # the block's dots first: its key rows load side by side
                    loc = locs[i]
                    for h in range(heads):
                        dot = zero
                        for j in range(dim):
                            dot += q[t, h, j] * keys[loc, j]
                        dots[i, h] = dot
                for i in range(seen):
                    score = zero
                    for h in range(heads):
                        score += max(dots[i, h] * scale, zero) * w[t, h]
                    scores[i] = score
                hs, hp, size = heap_s[t], heap_p[t], sizes[t]
                for i in range(seen):
                    score = scores[i]
                    if score != score:  # NaN: never selected, as -inf (it would break the ranking)
                        score = -np.inf
                    if size < top_k:  # filling: kept unordered, ordered once when full
                        if score != -np.inf:
                            hs[size] = score
                            hp[size] = start + i
                            size += 1
                            if size == top_k:
                                _heapify(hs, hp, size)
                    elif score > hs[0]:  # most are below the worst kept: skip the call
                        _sift_down(hs, hp, size, score, start + i)
                sizes[t] = size
        first = last
    for t in range(num_tokens):
        hs, hp, size = heap_s[t], heap_p[t], sizes[t]
        for k in range(size, top_k):
            out[t, k] = -1
        for i in range(size):  # each kept entry goes where the entries before it in contract order end
            score, pos = hs[i], hp[i]
            rank = 0
            for j in range(size):  # no branch: the compiler vectorises the count
                rank += (hs[j] > score) | ((hs[j] == score) & (hp[j] < pos))
            out[t, rank] = pos


def fits(index_q: torch.Tensor, index_w: torch.Tensor, index_k: torch.Tensor) -> bool:
    """This implementation takes the call: CPU tensors of one float32/64 dtype."""
    return (
        index_q.device.type == "cpu"
        and index_k.device.type == "cpu"
        and index_q.dtype in DTYPES
        and index_q.dtype == index_w.dtype == index_k.dtype
    )


def pays_for(heads: int, dim: int) -> bool:
    """An indexer of ``heads`` x ``dim`` has few enough dots per key for the loop to beat BLAS."""
    return heads * dim <= MAX_HEAD_DIMS


def prefill_context(heads: int, dim: int) -> int:
    """The most positions a prefill query of an indexer of ``heads`` x ``dim`` may see for the loop
    to take it (``PREFILL_DOTS``): 512 for 4 x 32, 128 for 8 x 64."""
    return PREFILL_DOTS // max(1, heads * dim)


def pays(index_q: torch.Tensor) -> bool:
    """``impl="auto"`` sends these queries here (beside ``fits``): few enough dots per key."""
    return pays_for(index_q.shape[1], index_q.shape[2])


def indexer_topk_numba(
    index_q: torch.Tensor,  # [T, Hi, Di]
    index_w: torch.Tensor,  # [T, Hi]
    index_k: torch.Tensor,  # [rows, Di]
    req_to_token: torch.Tensor,  # [N, max_ctx] int64 or int32
    req_rows: torch.Tensor,  # [T] int64
    seq_lens: torch.Tensor,  # [T] int64
    top_k: int,
    scale: float,
) -> torch.Tensor:  # [T, top_k] int32 positions in contract order, -1 padded
    """Every query of the call by the compiled loop (arguments checked by ``indexer_topk``; the
    tensors must ``fits``). A selection has no gradient: tensors that require one are read detached."""
    out = np.empty((index_q.shape[0], top_k), dtype=np.int32)
    if index_q.shape[0]:
        dtype = index_q.dtype
        scale_value = np.float64(scale) if dtype == torch.float64 else np.float32(scale)
        _kernel(
            index_q.detach().contiguous().numpy(),
            index_w.detach().contiguous().numpy(),
            index_k.detach().numpy(),
            req_to_token.numpy(),
            req_rows.numpy(),
            seq_lens.numpy(),
            scale_value,
            top_k,
            out,
        )
    return torch.from_numpy(out)


def warm_up(dtype: torch.dtype) -> None:
    """Compile (or load from numba's disk cache) the loop for ``dtype``'s tensors, so that a
    process's first decode step does not pay for it (a second or more in a fresh checkout)."""
    if dtype not in DTYPES:
        return
    keys = torch.zeros(4, 1, dtype=dtype)
    table = torch.arange(4).view(1, 4)
    query = torch.zeros(1, 1, 1, dtype=dtype)
    indexer_topk_numba(
        query, query[:, 0], keys, table, torch.zeros(1, dtype=torch.int64), torch.tensor([4]), 2, 1.0
    )
