"""Sparse MLA on a CPU as one compiled loop (contract: ``kernels.sparse_mla``), with numba.

A decode step of a small model attends each query head over a few dozen rows. The torch path
spends its time in a dozen tensor calls per layer (gather the rows, concatenate the query, two
batched matmuls, scale, mask, softmax, the all-masked repair, cast), each of which costs more to
dispatch than it computes. Here each query reads its rows where they lie (``kv[slots[t, i]]``):

* one pass over the query's valid slots forms every head's logit from the row, while the row is in
  cache (``q_latent . row[:C] + q_rope . row[C:]``, then times ``scale``);
* a softmax per head over those logits (max, ``exp``, sum, each probability divided by the sum, as
  torch's softmax does);
* one more pass over the rows adds, for every head, its probability times the row's latent part.

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

import numpy as np
import torch

try:
    import numba
except ImportError:  # a platform without numba's wheels: the torch path does the work
    numba = None

AVAILABLE = numba is not None
DTYPES = (torch.float32, torch.float64)
# ``sparse_mla(impl="auto")`` runs the loop when a query's heads x slots x (C + R) products number at
# most this: there the torch path's dozen calls cost more than they compute. Beyond it BLAS's
# blocked matmuls over the gathered rows are faster than the loop's dots. Measured on a 2-core x86
# CPU, one thread: 4 heads x 64 slots x (64 + 16) ran 2.5-4x the torch path at 1-4 queries and
# 1.2x at 32-512, 16 x 64 x 80 2.4x, 8 x 256 x 80 0.75x, 16 x 512 x 160 0.55x.
MAX_QUERY_ELEMENTS = 1 << 17


def _jit(**options):
    """Compiled on first call (and cached on disk) where numba is installed; plain Python otherwise."""
    if numba is None:
        return lambda fn: fn
    return numba.njit(cache=True, nogil=True, **options)


@_jit(fastmath={"reassoc", "contract", "nsz"})
def _kernel(q_latent, q_rope, kv, slots, scale, out):  # pragma: no cover - compiled
    num_tokens, heads, latent = q_latent.shape
    rope = q_rope.shape[2]
    top_k = slots.shape[1]
    rows = kv.shape[0]
    zero = scale - scale  # of the score dtype (scale * 0 would be float64)
    logits = np.empty((heads, top_k), q_latent.dtype)
    used = np.empty(top_k, np.int64)
    acc = np.empty((heads, latent), q_latent.dtype)
    for t in range(num_tokens):
        n = 0
        for i in range(top_k):
            s = slots[t, i]
            if s < 0:
                continue
            if s >= rows:  # never read outside ``kv`` (the torch path raises here too)
                raise IndexError("slots: a slot past the last row of kv")
            for h in range(heads):
                dot = zero
                for j in range(latent):
                    dot += q_latent[t, h, j] * kv[s, j]
                for j in range(rope):
                    dot += q_rope[t, h, j] * kv[s, latent + j]
                logits[h, n] = dot * scale
            used[n] = s
            n += 1
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
        for k in range(n):  # each row once, into every head's sum
            s = used[k]
            for h in range(heads):
                p = logits[h, k]
                for j in range(latent):
                    acc[h, j] += p * kv[s, j]
        for h in range(heads):
            for j in range(latent):
                out[t, h, j] = acc[h, j]


def fits(q_latent: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> bool:
    """This implementation takes the call: numba installed, CPU tensors of one float32/64 dtype."""
    return (
        AVAILABLE
        and q_latent.device.type == q_rope.device.type == kv.device.type == slots.device.type == "cpu"
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
    if not AVAILABLE or dtype not in DTYPES:
        return
    q = torch.zeros(1, 1, 1, dtype=dtype)
    for slot_dtype in (torch.int32, torch.int64):
        sparse_mla_numba(q, q, torch.zeros(1, 2, dtype=dtype), torch.zeros(1, 1, dtype=slot_dtype), 1.0)
