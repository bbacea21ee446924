"""A few tokens' routed and shared experts on a CPU as one compiled loop, with numba.

A decode step of a small MoE model runs a few tokens through two chosen experts and a shared one.
The torch path (``pipeline.model.fused``) spends its time dispatching about twenty tensor calls per
layer (two matmuls per expert, the activation, the weighting, the sums), each costing more than it
computes. Here each token is one pass: for each chosen expert in expert order, ``gate_up`` times the
token (rows read where they lie, ``[E, 2I, D]``), ``silu(gate) * up``, ``down`` times that, weighted
and added; then the shared expert's ``down(silu(gate) * up)`` is added. That is the module path's
arithmetic (``RoutedExperts`` accumulates its experts in expert order in the activations' dtype,
the shared expert's output added last); the dot products run in the order the compiler vectorises
them (``reassoc``), so the result agrees with torch's to rounding.

A token's result does not depend on the other tokens of the call, so a verify step's tokens get
the bits each would get alone (a decode step of one token), which the torch path's batched
matmuls do not promise. Float32 and float64 tensors of one dtype only; ``fits`` says when.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

DTYPES = (torch.float32, torch.float64)
# the most tokens a call takes: beyond it the torch path's matmuls read each expert's weights once
# for many tokens, which the per-token loop cannot
MAX_TOKENS = 8
# the largest expert (2I x D and D x I products) the loop takes: a small model's; bigger experts are
# BLAS's
MAX_EXPERT_ELEMENTS = 1 << 20


def _jit(**options):
    return numba.njit(cache=True, nogil=True, **options)


@_jit(fastmath={"reassoc", "contract", "nsz"})
def _mlp(x, gate_up, down, zero, one, h, act, y):  # pragma: no cover - compiled
    """``y = down @ (silu(gate) * up)`` with ``[gate; up] = gate_up @ x`` for one token (``zero``,
    ``one``: constants of the tensors' dtype, so that nothing is computed wider)."""
    two_i, dim = gate_up.shape
    inner = two_i // 2
    for j in range(two_i):
        total = zero
        for d in range(dim):
            total += gate_up[j, d] * x[d]
        h[j] = total
    for i in range(inner):
        g = h[i]
        act[i] = g / (one + np.exp(-g)) * h[inner + i]
    for j in range(dim):
        total = zero
        for i in range(inner):
            total += down[j, i] * act[i]
        y[j] = total


@_jit()
def _kernel(
    x, ids, weights, gate_up, down, shared_gate_up, shared_down, has_shared, zero, one, out
):  # pragma: no cover
    tokens, dim = x.shape
    k = ids.shape[1]
    two_i = gate_up.shape[1]
    h = np.empty(max(two_i, shared_gate_up.shape[0]), x.dtype)
    act = np.empty(h.shape[0] // 2, x.dtype)
    y = np.empty(dim, x.dtype)
    order = np.empty(k, np.int64)
    for t in range(tokens):
        for j in range(dim):
            out[t, j] = zero
        for a in range(k):  # the chosen experts in expert order (insertion sort of k ids)
            order[a] = a
            b = a
            while b > 0 and ids[t, order[b - 1]] > ids[t, order[b]]:
                order[b - 1], order[b] = order[b], order[b - 1]
                b -= 1
        for a in range(k):
            slot = order[a]
            e = ids[t, slot]
            w = weights[t, slot]
            _mlp(x[t], gate_up[e], down[e], zero, one, h, act, y)
            for j in range(dim):
                out[t, j] += y[j] * w
        if has_shared:
            _mlp(x[t], shared_gate_up, shared_down, zero, one, h, act, y)
            for j in range(dim):
                out[t, j] += y[j]


def fits(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor) -> bool:
    """The loop takes the call: CPU tensors of one float32/64 dtype (the routing
    weights too), at most ``MAX_TOKENS`` tokens and experts of at most ``MAX_EXPERT_ELEMENTS``."""
    dtype = x.dtype
    return (
        dtype in DTYPES
        and x.shape[0] <= MAX_TOKENS
        and gate_up[0].numel() <= MAX_EXPERT_ELEMENTS
        and all(t.dtype == dtype and t.device.type == "cpu" for t in (x, gate_up, down, weights))
    )


def moe(
    x: torch.Tensor,  # [T, D]
    ids: torch.Tensor,  # [T, k] int64 chosen experts
    weights: torch.Tensor,  # [T, k] their routing weights (x's dtype)
    gate_up: torch.Tensor,  # [E, 2I, D] gate rows first
    down: torch.Tensor,  # [E, D, I]
    shared_gate_up: torch.Tensor | None = None,  # [2Is, D]
    shared_down: torch.Tensor | None = None,  # [D, Is]
) -> torch.Tensor:  # [T, D]
    """The routed experts' weighted sum plus the shared expert's output, per token (``fits``)."""
    wide = np.float64 if x.dtype == torch.float64 else np.float32
    out = np.empty(x.shape, wide)
    if x.shape[0]:
        has_shared = shared_gate_up is not None and shared_down is not None
        if shared_gate_up is None or shared_down is None:
            shared_gate_up = torch.zeros(2, x.shape[1], dtype=x.dtype)
            shared_down = torch.zeros(x.shape[1], 1, dtype=x.dtype)
        _kernel(
            x.detach().contiguous().numpy(),
            ids.contiguous().numpy(),
            weights.detach().contiguous().numpy(),
            gate_up.detach().numpy(),
            down.detach().numpy(),
            shared_gate_up.detach().numpy(),
            shared_down.detach().numpy(),
            has_shared,
            wide(0),
            wide(1),
            out,
        )
    return torch.from_numpy(out)


def warm_up(dtype: torch.dtype = torch.float32) -> None:
    """Compile (or load from numba's disk cache) the loop for ``dtype``, with and without a shared
    expert."""
    if dtype not in DTYPES:
        return
    x = torch.ones(1, 2, dtype=dtype)
    ids = torch.zeros(1, 1, dtype=torch.int64)
    w = torch.ones(1, 1, dtype=dtype)
    gate_up, down = torch.ones(1, 2, 2, dtype=dtype), torch.ones(1, 2, 1, dtype=dtype)
    moe(x, ids, w, gate_up, down, gate_up[0], down[0])
    moe(x, ids, w, gate_up, down)
