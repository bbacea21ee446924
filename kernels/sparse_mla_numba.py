"""Sparse MLA on a CPU as one compiled loop (contract: ``kernels.sparse_mla``), with numba.

A decode step of a small model attends each query head over a few dozen rows. The torch path
spends its time in a dozen tensor calls per layer (gather the rows, concatenate the query, two
batched matmuls, scale, mask, softmax, the all-masked repair, cast), each of which costs more to
dispatch than it computes. Here each query reads its rows where they lie (``kv[slots[t, i]]``):

* one pass over the query's valid slots forms every head's logit from the rows, four rows at a time
  (each element of the head's query ``[q_latent | q_rope]`` read once for four dots, then times
  ``scale``);
* a softmax per head over those logits (max, ``exp``, sum, each probability divided by the sum, as
  torch's softmax does);
* one more pass over the rows adds, for every head, its probabilities times the rows' latent parts,
  again four rows at a time (one load and store of the head's sum per four rows: the loops are
  short, 64 channels of the bundled model, so their count is what costs).

The query's result does not depend on the other queries of the call, so a verify step's or a
prefill's queries attend exactly as they would one by one (the torch path's batched matmuls make
no such promise). Sums run in the score dtype (float32; float64 for float64 tensors) in the order
the compiler vectorises them (``reassoc``), so the result agrees with the torch path's to rounding,
as the Triton kernel's does. A query with no valid slot yields zeros. Float32 and float64 tensors of
one dtype only (the loop reads numpy views); ``sparse_mla(impl="auto")`` sends CPU calls here when
numba is installed and a query's work is small (``MAX_QUERY_ELEMENTS``). A slot past the last row
raises ``IndexError``, as the torch path's gather does; the loop never reads outside ``kv``.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

DTYPES = (torch.float32, torch.float64)
# ``sparse_mla(impl="auto")`` runs the loop when a query's heads x slots x (C + R) products number at
# most this: there the torch path's dozen calls cost more than they compute. Beyond it BLAS's
# blocked matmuls over the gathered rows are faster than the loop's dots (the shapes measured on
# each side: docs/performance-notes.md).
MAX_QUERY_ELEMENTS = 1 << 17


def _jit(**options):
    """Compiled on first call and cached on disk."""
    return numba.njit(cache=True, nogil=True, **options)


@_jit(fastmath={"reassoc", "contract", "nsz"})
def _kernel(q_latent, q_rope, kv, slots, scale, out):  # pragma: no cover - compiled
    num_tokens, heads, latent = q_latent.shape
    rope = q_rope.shape[2]
    width = latent + rope
    top_k = slots.shape[1]
    rows = kv.shape[0]
    zero = scale - scale  # of the score dtype (scale * 0 would be float64)
    logits = np.empty((heads, top_k), q_latent.dtype)
    used = np.empty(top_k, np.int64)
    query = np.empty((heads, width), q_latent.dtype)
    acc = np.empty((heads, latent), q_latent.dtype)
    for t in range(num_tokens):
        n = 0
        for i in range(top_k):
            s = slots[t, i]
            if s < 0:
                continue
            if s >= rows:  # never read outside ``kv`` (the torch path raises here too)
                raise IndexError("slots: a slot past the last row of kv")
            used[n] = s
            n += 1
        for h in range(heads):  # each head's query as one row: [latent | rope]
            for j in range(latent):
                query[h, j] = q_latent[t, h, j]
            for j in range(rope):
                query[h, latent + j] = q_rope[t, h, j]
        k = 0
        while k + 4 <= n:  # four rows at a time: each query element read once for four dots
            r0, r1, r2, r3 = kv[used[k]], kv[used[k + 1]], kv[used[k + 2]], kv[used[k + 3]]
            for h in range(heads):
                q = query[h]
                d0 = d1 = d2 = d3 = zero
                for j in range(width):
                    x = q[j]
                    d0 += x * r0[j]
                    d1 += x * r1[j]
                    d2 += x * r2[j]
                    d3 += x * r3[j]
                logits[h, k] = d0 * scale
                logits[h, k + 1] = d1 * scale
                logits[h, k + 2] = d2 * scale
                logits[h, k + 3] = d3 * scale
            k += 4
        for rest in range(k, n):
            r0 = kv[used[rest]]
            for h in range(heads):
                q = query[h]
                d0 = zero
                for j in range(width):
                    d0 += q[j] * r0[j]
                logits[h, rest] = d0 * scale
        for h in range(heads):
            for j in range(latent):
                acc[h, j] = zero
            if n == 0:
                continue
            top = logits[h, 0]
            for k in range(1, n):
                top = max(top, logits[h, k])
            total = zero
            for k in range(n):
                e = np.exp(logits[h, k] - top)
                logits[h, k] = e
                total += e
            for k in range(n):
                logits[h, k] = logits[h, k] / total
        k = 0
        while k + 4 <= n:  # four rows at a time into every head's sum: a quarter of its loads and stores
            r0, r1, r2, r3 = kv[used[k]], kv[used[k + 1]], kv[used[k + 2]], kv[used[k + 3]]
            for h in range(heads):
                p0, p1, p2, p3 = logits[h, k], logits[h, k + 1], logits[h, k + 2], logits[h, k + 3]
                a = acc[h]
                for j in range(latent):
                    a[j] += p0 * r0[j] + p1 * r1[j] + p2 * r2[j] + p3 * r3[j]
            k += 4
        for rest in range(k, n):
            r0 = kv[used[rest]]
            for h in range(heads):
                p0 = logits[h, rest]
                a = acc[h]
                for j in range(latent):
                    a[j] += p0 * r0[j]
        for h in range(heads):
            for j in range(latent):
                out[t, h, j] = acc[h, j]


def fits(q_latent: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> bool:
    """This implementation takes the call: CPU tensors of one float32/64 dtype."""
    return (
        q_latent.device.type == q_rope.device.type == kv.device.type == slots.device.type == "cpu"
        and q_latent.dtype in DTYPES
        and q_latent.dtype == q_rope.dtype == kv.dtype
    )


def pays_for(heads: int, row_dim: int, top_k: int) -> bool:
    """A query of ``heads`` over ``top_k`` rows of ``row_dim`` (C + R) is small enough for the loop
    to beat BLAS (independent of the number of queries, so that how a caller splits its queries
    never changes which implementation, and so which rounding, they get)."""
    return heads * row_dim * top_k <= MAX_QUERY_ELEMENTS


def sparse_mla_numba(
    q_latent: torch.Tensor,  # [T, H, C]
    q_rope: torch.Tensor,  # [T, H, R]
    kv: torch.Tensor,  # [rows, C + R]
    slots: torch.Tensor,  # [T, K] int32/int64, -1 = masked
    scale: float,
) -> torch.Tensor:  # [T, H, C]
    """Every query of the call by the compiled loop (arguments checked by ``sparse_mla``; the
    tensors must ``fits``). Tensors that require a gradient are read detached (no gradient flows)."""
    out = torch.empty(q_latent.shape, dtype=q_latent.dtype)
    if q_latent.shape[0] and slots.shape[1]:
        wide = np.float64 if q_latent.dtype == torch.float64 else np.float32
        _kernel(
            q_latent.detach().contiguous().numpy(), q_rope.detach().contiguous().numpy(),
            kv.detach().numpy(), slots.contiguous().numpy(), wide(scale), out.numpy(),
        )
    else:
        out.zero_()
    return out


def warm_up(dtype: torch.dtype = torch.float32) -> None:
    """Compile (or load from numba's disk cache) the loop for ``dtype``'s tensors and int32 and
    int64 slots, so that a process's first decode step does not pay for it."""
    if dtype not in DTYPES:
        return
    q = torch.zeros(1, 1, 1, dtype=dtype)
    for slot_dtype in (torch.int32, torch.int64):
        sparse_mla_numba(q, q, torch.zeros(1, 2, dtype=dtype), torch.zeros(1, 1, dtype=slot_dtype), 1.0)
