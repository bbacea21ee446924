"""A decoder layer's projections and MLP for a few tokens on a CPU as two compiled calls, with numba.

A decode step of a small model at a small batch costs what its torch calls cost to dispatch: the
fused layer (``pipeline.model.fused``) still makes about forty of them per layer for one token (two
norms, two matmuls, the splits, the rope rotations, the absorbed query, the concatenations, the
value up-projection, the output projection, the residual adds, the MLP), whose dispatch costs
several times their arithmetic for the bundled model (docs/performance-notes.md). Here the work
before the attention is one call (``project``) and the work after it is another (``finish``); the
attention itself stays the backend's (``AttentionBackend.attend``), so every backend, HiSparse and
resident, serves the layer unchanged.

``project``: ``h = rms_norm(x)``; ``[q_a | latent, k_rope | index_k | index_w] = W_in h``;
``q = W_q rms_norm(q_a)``; the absorbed query ``q_nope W_UK`` per head; the query heads' and the new
key's rope channels rotated (interleaved), the indexer's query heads' and key's by the indexer's
rope; the cache row ``[rms_norm(latent) | k_rope]``; the indexer key ``layer_norm(index_k)`` rotated;
the indexer's head weights ``index_w * heads ** -0.5``.

``finish``: ``x + W_o (out W_UV)`` per head, then ``rms_norm``, then the MLP, then the residual: a
dense SwiGLU MLP, or the router (sigmoid scores, the correction bias steering the choice of the top
``k``, the chosen scores normalised and scaled) and the routed experts in expert order with the
shared expert (``kernels.moe_numba``'s loop), as the module path computes them.

Each token is computed alone, so a verify step's tokens get the bits each would get in a decode step
of its own, which BLAS's batched matmuls do not promise. The dot products and norms run in the order
the compiler vectorises them (``reassoc``), so the results agree with the torch path's to rounding;
the rope rotations are ``kernels.small_ops_numba``'s loop (the torch path's bits, given its input).
Float32 and float64 arrays of one dtype; the caller (``pipeline.model.fused``) decides when the
calls are made and hands numpy views of the weights it checked (``LayerWeights``).

For more tokens than ``tokens_for`` the layer's bytes (below) BLAS's matmuls read each weight once
for all of them, which the per-token loops cannot; there the caller runs ``W_in``, ``W_q``,
``o_proj`` and the MLP with torch and the pieces between them here (``rms_rows``, ``assemble``:
``project`` after its two matmuls, ``up_values``, ``add_norm``, and ``route``: the router, whose
dozen small torch calls cost more than its products).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from kernels import moe_numba, small_ops_numba

# The loops read each of a layer's weights once per token; beyond some tokens BLAS's matmuls, which
# read it once for all of them, cost less. Where depends on the layer's bytes: while they stay in the
# CPU's caches from one token to the next, the loops win far longer. Measured on a 2-core CPU, one
# thread, float32 decode steps (step time, loops over the hybrid path; docs/kernels.md): a layer of
# 2.9 MiB (the bundled model) 0.75x at 9 tokens, 0.95x at 32, 1.02x at 48; of 11 MiB 0.81x at 9,
# 0.95x at 16, 1.07x at 24; of 35 MiB 1.35x at 9. So a call takes up to ``tokens_for(bytes)``:
# ``LOOP_BYTES`` over the layer's bytes, between ``MIN_TOKENS`` and ``MAX_TOKENS``.
MAX_TOKENS = 32
MIN_TOKENS = moe_numba.MAX_TOKENS  # (8: the bound before it was measured per layer size)
LOOP_BYTES = 160 << 20


def tokens_for(layer_bytes: int) -> int:
    """The most tokens the loops take of a layer whose weights (the arrays they read) are
    ``layer_bytes``: ``LOOP_BYTES / layer_bytes`` within ``[MIN_TOKENS, MAX_TOKENS]``."""
    return min(MAX_TOKENS, max(MIN_TOKENS, LOOP_BYTES // max(layer_bytes, 1)))

_rotate = small_ops_numba._rotate
_experts = moe_numba._kernel


def _jit(**options):
    return numba.njit(cache=True, nogil=True, **options)


_FAST = {"reassoc", "contract", "nsz"}


@_jit(fastmath=_FAST)
def _matvec(w, x, zero, out):  # pragma: no cover - compiled
    """``out = w @ x`` for ``w [O, I]``, ``x [I]``."""
    rows, dim = w.shape
    for o in range(rows):
        total = zero
        for i in range(dim):
            total += w[o, i] * x[i]
        out[o] = total


@_jit(fastmath={"reassoc", "nsz"})
def _rms(x, weight, eps, size, out):  # pragma: no cover - compiled
    """``small_ops_numba``'s RMSNorm of one vector."""
    zero = eps - eps
    one = eps / eps
    total = zero
    for j in range(x.shape[0]):
        total += x[j] * x[j]
    scale = one / np.sqrt(total / size + eps)
    for j in range(x.shape[0]):
        out[j] = weight[j] * (x[j] * scale)


@_jit(fastmath={"reassoc", "nsz"})
def _layer_norm(x, weight, bias, eps, out):  # pragma: no cover - compiled
    """``torch.layer_norm`` of one vector (biased variance)."""
    n = x.shape[0]
    zero = eps - eps
    one = eps / eps
    total = zero
    for j in range(n):
        total += x[j]
    mean = total / n
    total = zero
    for j in range(n):
        d = x[j] - mean
        total += d * d
    inv = one / np.sqrt(total / n + eps)
    for j in range(n):
        out[j] = (x[j] - mean) * inv * weight[j] + bias[j]


@_jit(fastmath=_FAST)
def _project(  # pragma: no cover - compiled
    x, norm_w, norm_eps, w_in, q_lora, q_norm_w, q_eps, w_q, kv_b, nope, kv_norm_w, kv_eps,
    has_index, index_heads, k_norm_w, k_norm_b, k_norm_eps, index_w_scale, index_interleaved, cos, sin,
    q_latent, q_rope, kv_rows, index_q, index_w, index_k,
):
    tokens, dim = x.shape
    zero = norm_eps - norm_eps
    h = np.empty(dim, x.dtype)
    p = np.empty((tokens, w_in.shape[0]), x.dtype)
    qr = np.empty(q_lora, x.dtype)
    qs = np.empty((tokens, w_q.shape[0]), x.dtype)
    for t in range(tokens):
        _rms(x[t], norm_w, norm_eps, norm_w.shape[0], h)
        _matvec(w_in, h, zero, p[t])
        _rms(p[t, :q_lora], q_norm_w, q_eps, q_lora, qr)
        _matvec(w_q, qr, zero, qs[t])
    _assemble(
        p,
        qs,
        q_lora,
        kv_b,
        nope,
        kv_norm_w,
        kv_eps,
        has_index,
        index_heads,
        k_norm_w,
        k_norm_b,
        k_norm_eps,
        index_w_scale,
        index_interleaved,
        cos,
        sin,
        q_latent,
        q_rope,
        kv_rows,
        index_q,
        index_w,
        index_k,
    )


@_jit(fastmath=_FAST)
def _assemble(  # pragma: no cover - compiled
    p,
    qs,
    q_lora,
    kv_b,
    nope,
    kv_norm_w,
    kv_eps,
    has_index,
    index_heads,
    k_norm_w,
    k_norm_b,
    k_norm_eps,
    index_w_scale,
    index_interleaved,
    cos,
    sin,
    q_latent,
    q_rope,
    kv_rows,
    index_q,
    index_w,
    index_k,
):
    """Everything of the projection after its two matmuls ``p = W_in rms_norm(x)`` and
    ``qs = W_q rms_norm(q_a)`` (rows per token): the absorbed query, the rotations, the cache row
    and the indexer's inputs."""
    tokens = p.shape[0]
    heads, _, latent_dim = kv_b.shape
    rope = q_rope.shape[2]
    qk = nope + rope
    index_dim = index_k.shape[1]
    zero = kv_eps - kv_eps
    key_norm = np.empty(index_dim, p.dtype)
    rope_in = np.empty((tokens, heads + 1, rope), p.dtype)
    index_in = np.empty((tokens, index_heads + 1, rope), p.dtype)
    for t in range(tokens):
        for hh in range(heads):
            base = hh * qk
            for c in range(latent_dim):
                q_latent[t, hh, c] = zero
            for n in range(nope):  # q_nope @ W_UK, the rows of W_UK read in order
                a = qs[t, base + n]
                for c in range(latent_dim):
                    q_latent[t, hh, c] += a * kv_b[hh, n, c]
            for i in range(rope):
                rope_in[t, hh, i] = qs[t, base + nope + i]
        for i in range(rope):
            rope_in[t, heads, i] = p[t, q_lora + latent_dim + i]
        _rms(p[t, q_lora : q_lora + latent_dim], kv_norm_w, kv_eps, latent_dim, kv_rows[t, :latent_dim])
        if has_index:
            off = q_lora + latent_dim + rope
            _layer_norm(p[t, off : off + index_dim], k_norm_w, k_norm_b, k_norm_eps, key_norm)
            for g in range(index_heads):
                q_off = heads * qk + g * index_dim
                for i in range(rope):
                    index_in[t, g, i] = qs[t, q_off + i]
                for i in range(rope, index_dim):
                    index_q[t, g, i] = qs[t, q_off + i]
                index_w[t, g] = p[t, off + index_dim + g] * index_w_scale
            for i in range(rope):
                index_in[t, index_heads, i] = key_norm[i]
            for i in range(rope, index_dim):
                index_k[t, i] = key_norm[i]
    _rotate_into(rope_in, cos, sin, True, q_rope, kv_rows, latent_dim)
    if has_index:
        _rotate_into(index_in, cos, sin, index_interleaved, index_q, index_k, 0)


@_jit()
def _rotate_into(x, cos, sin, interleaved, heads_out, key_out, key_start):  # pragma: no cover - compiled
    """``x [T, n + 1, R]``: n query heads' rope channels and a key's, rotated (``small_ops_numba``'s
    loop); each head's into the first R channels of ``heads_out[t, h]``, the key's into
    ``key_out[t, key_start : key_start + R]``."""
    tokens, rows, rope = x.shape
    heads = rows - 1
    out = np.empty_like(x)
    _rotate(x, cos, sin, interleaved, out)
    for t in range(tokens):
        for h in range(heads):
            for i in range(rope):
                heads_out[t, h, i] = out[t, h, i]
        for i in range(rope):
            key_out[t, key_start + i] = out[t, heads, i]


@_jit(fastmath=_FAST)
def _up_values(attn, kv_b, nope, zero, out):  # pragma: no cover - compiled
    """``out [T, H * v]``: each head's attention output times its ``W_UV`` (rows ``nope:`` of
    ``kv_b [H, nope + v, C]``), heads side by side (the output projection's input)."""
    tokens = attn.shape[0]
    heads, rows, latent_dim = kv_b.shape
    value_dim = rows - nope
    for t in range(tokens):
        for hh in range(heads):
            for j in range(value_dim):
                total = zero
                for c in range(latent_dim):
                    total += attn[t, hh, c] * kv_b[hh, nope + j, c]
                out[t, hh * value_dim + j] = total


@_jit(fastmath={"reassoc", "nsz"})
def _add_norm(x, a, norm_w, norm_eps, resid, normed):  # pragma: no cover - compiled
    """``resid = x + a`` and its RMSNorm, per token."""
    tokens, dim = x.shape
    for t in range(tokens):
        for j in range(dim):
            resid[t, j] = x[t, j] + a[t, j]
        _rms(resid[t], norm_w, norm_eps, dim, normed[t])


@_jit(fastmath=_FAST)
def _route(h, gate_w, bias, top_k, normalise, scaling, tiny, ids, weights):  # pragma: no cover - compiled
    """One token's chosen experts (the highest ``score + bias``, the lower id first among equals)
    and their weights (the chosen sigmoid scores, normalised to sum 1 when ``normalise``: divided by
    their sum plus ``tiny``, 1e-20 in the weights' dtype, as the router does; then scaled)."""
    experts = gate_w.shape[0]
    zero = scaling - scaling
    one = scaling / scaling
    scores = np.empty(experts, h.dtype)
    for e in range(experts):
        total = zero
        for j in range(h.shape[0]):
            total += gate_w[e, j] * h[j]
        scores[e] = one / (one + np.exp(-total))
    taken = np.zeros(experts, np.bool_)
    for a in range(top_k):
        best = -1
        for e in range(experts):
            if taken[e]:
                continue
            if best < 0 or scores[e] + bias[e] > scores[best] + bias[best]:
                best = e
        taken[best] = True
        ids[a] = best
        weights[a] = scores[best]
    if normalise:
        total = zero
        for a in range(top_k):
            total += weights[a]
        total += tiny
        for a in range(top_k):
            weights[a] = weights[a] / total
    if scaling != one:
        for a in range(top_k):
            weights[a] = weights[a] * scaling


@_jit(fastmath=_FAST)
def _finish(  # pragma: no cover - compiled
    x,
    attn,
    kv_b,
    nope,
    w_o,
    norm_w,
    norm_eps,
    routed,
    gate_w,
    bias,
    top_k,
    normalise,
    scaling,
    tiny,
    gate_up,
    down,
    shared_gate_up,
    shared_down,
    has_shared,
    out,
):
    tokens, dim = x.shape
    zero = norm_eps - norm_eps
    one = norm_eps / norm_eps
    o = np.empty((tokens, w_o.shape[1]), x.dtype)
    _up_values(attn, kv_b, nope, zero, o)
    a = np.empty((tokens, dim), x.dtype)
    for t in range(tokens):
        _matvec(w_o, o[t], zero, a[t])
    resid = np.empty((tokens, dim), x.dtype)
    normed = np.empty((tokens, dim), x.dtype)
    _add_norm(x, a, norm_w, norm_eps, resid, normed)
    k = top_k if routed else 0
    ids = np.empty((tokens, k), np.int64)
    weights = np.empty((tokens, k), x.dtype)
    if routed:
        for t in range(tokens):
            _route(normed[t], gate_w, bias, top_k, normalise, scaling, tiny, ids[t], weights[t])
    mlp = np.empty((tokens, dim), x.dtype)
    _experts(normed, ids, weights, gate_up, down, shared_gate_up, shared_down, has_shared, zero, one, mlp)
    for t in range(tokens):
        for j in range(dim):
            out[t, j] = resid[t, j] + mlp[t, j]


class LayerWeights:
    """One layer's weights (numpy views) and constants, as the compiled calls take them: ``w`` by
    name (``pipeline.model.fused`` builds it: the keys ``warm_up`` shows), and the argument runs of
    each call laid out once, so that a call per layer per step does not look them up again."""

    def __init__(self, w: dict[str, Any]) -> None:  # arrays, numpy scalars, ints, flags: numba types them
        self.w = w
        heads, _, latent = w["kv_b"].shape
        self.index_heads: int = w["index_heads"] if w["has_index"] else 0
        self.index_dim: int = w["index_dim"] if w["has_index"] else 0
        self.heads, self.latent, self.rope = heads, latent, w["rope"]
        index = (
            w["has_index"],
            self.index_heads,
            w["k_norm_w"],
            w["k_norm_b"],
            w["k_norm_eps"],
            w["index_w_scale"],
            w["index_interleaved"],
        )
        self.project_args = (
            w["norm_w"],
            w["norm_eps"],
            w["w_in"],
            w["q_lora"],
            w["q_norm_w"],
            w["q_eps"],
            w["w_q"],
            w["kv_b"],
            w["nope"],
            w["kv_norm_w"],
            w["kv_eps"],
            *index,
        )
        self.assemble_args = (w["q_lora"], w["kv_b"], w["nope"], w["kv_norm_w"], w["kv_eps"], *index)
        self.finish_args = (
            w["kv_b"],
            w["nope"],
            w["w_o"],
            w["post_w"],
            w["post_eps"],
            w["routed"],
            w["gate_w"],
            w["bias"],
            w["top_k"],
            w["normalise"],
            w["scaling"],
            w["tiny"],
            w["gate_up"],
            w["down"],
            w["shared_gate_up"],
            w["shared_down"],
            w["has_shared"],
        )

    def inputs(self, tokens: int, dtype) -> tuple[np.ndarray, ...]:
        """The attention inputs' arrays for ``tokens`` tokens (the indexer's empty without one)."""
        heads, latent, rope, index_heads, index_dim = (
            self.heads,
            self.latent,
            self.rope,
            self.index_heads,
            self.index_dim,
        )
        return (
            np.empty((tokens, heads, latent), dtype),  # q_latent
            np.empty((tokens, heads, rope), dtype),  # q_rope
            np.empty((tokens, latent + rope), dtype),  # kv_rows
            np.empty((tokens, index_heads, index_dim), dtype),  # index_q
            np.empty((tokens, index_heads), dtype),  # index_w
            np.empty((tokens, index_dim), dtype),  # index_k
        )


def project(x: np.ndarray, w: LayerWeights, cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, ...]:
    """``x [T, D]`` (the layer's input, before its norm) -> ``(q_latent [T, H, C], q_rope [T, H, R],
    kv_rows [T, C + R], index_q [T, Hi, Di], index_w [T, Hi], index_k [T, Di])`` (the last three
    empty without an indexer). ``cos``, ``sin [T, R]``: the forward's rope tables (``sin`` signed
    ``[-s | s]``)."""
    out = w.inputs(x.shape[0], x.dtype)
    _project(x, *w.project_args, cos, sin, *out)
    return out


def finish(x: np.ndarray, attn: np.ndarray, w: LayerWeights) -> np.ndarray:
    """The layer's output ``[T, D]`` from its input ``x`` and the attention's ``attn [T, H, C]``."""
    out = np.empty(x.shape, x.dtype)
    _finish(x, attn, *w.finish_args, out)
    return out


# --- the pieces between a larger batch's matmuls (BLAS does those: ``pipeline.model.fused``) ------


def rms_rows(x: np.ndarray, weight: np.ndarray, eps) -> np.ndarray:
    """RMSNorm of each row of ``x [T, n]`` (a strided view is read in place)."""
    out = np.empty(x.shape, x.dtype)
    small_ops_numba._rms_norm(x, weight, eps, eps.dtype.type(x.shape[1]), out)
    return out


def assemble(
    p: np.ndarray, qs: np.ndarray, w: LayerWeights, cos: np.ndarray, sin: np.ndarray
) -> tuple[np.ndarray, ...]:
    """``project``'s outputs from its two matmuls' rows ``p = W_in rms_norm(x)`` and
    ``qs = W_q rms_norm(q_a)``."""
    out = w.inputs(p.shape[0], p.dtype)
    _assemble(p, qs, *w.assemble_args, cos, sin, *out)
    return out


def up_values(attn: np.ndarray, w: LayerWeights) -> np.ndarray:
    """``[T, H * v]``: the attention output of each head times its ``W_UV``."""
    a = w.w
    out = np.empty((attn.shape[0], a["w_o"].shape[1]), attn.dtype)
    _up_values(attn, a["kv_b"], a["nope"], a["post_eps"] - a["post_eps"], out)
    return out


@_jit()
def _route_rows(
    h, gate_w, bias, top_k, normalise, scaling, tiny, ids, weights
):  # pragma: no cover - compiled
    for t in range(h.shape[0]):
        _route(h[t], gate_w, bias, top_k, normalise, scaling, tiny, ids[t], weights[t])


def route(h: np.ndarray, w: LayerWeights) -> tuple[np.ndarray, np.ndarray]:
    """The router over the rows of ``h [T, D]`` (a layer whose loops hold routed experts): each
    token's expert ids ``[T, k]`` int64 and their weights ``[T, k]``, as ``_route`` gives them."""
    a = w.w
    k = a["top_k"]
    ids, weights = np.empty((h.shape[0], k), np.int64), np.empty((h.shape[0], k), h.dtype)
    _route_rows(h, a["gate_w"], a["bias"], k, a["normalise"], a["scaling"], a["tiny"], ids, weights)
    return ids, weights


def add_norm(x: np.ndarray, a: np.ndarray, w: LayerWeights) -> tuple[np.ndarray, np.ndarray]:
    """``(x + a, rms_norm(x + a))`` with the layer's post-attention norm."""
    resid, normed = np.empty(x.shape, x.dtype), np.empty(x.shape, x.dtype)
    _add_norm(x, a, w.w["post_w"], w.w["post_eps"], resid, normed)
    return resid, normed


def warm_up(dtype) -> None:
    """Compile (or load from numba's disk cache) both calls for ``dtype``'s arrays (``torch.float32``
    or ``torch.float64``), with and without an indexer, routed experts and a shared expert (one
    signature: the flags are arguments), and the pieces between a larger batch's matmuls, so that a
    process's first decode, verify or short prefill does not pay for it."""
    import torch

    if dtype not in (torch.float32, torch.float64):
        return
    f = np.float64 if dtype == torch.float64 else np.float32
    dim, heads, nope, value, latent, rope, q_lora, index_heads, index_dim = 4, 1, 2, 2, 2, 2, 2, 1, 2
    z = lambda *shape: np.zeros(shape, f)  # noqa: E731
    ones = lambda n: np.ones(n, f)  # noqa: E731
    w: dict[str, Any] = {
        "norm_w": ones(dim),
        "norm_eps": f(1e-6),
        "w_in": z(q_lora + latent + rope + index_dim + index_heads, dim),
        "q_lora": q_lora,
        "q_norm_w": ones(q_lora),
        "q_eps": f(1e-6),
        "w_q": z(heads * (nope + rope) + index_heads * index_dim, q_lora),
        "kv_b": z(heads, nope + value, latent),
        "nope": nope,
        "kv_norm_w": ones(latent),
        "kv_eps": f(1e-6),
        "has_index": True,
        "index_heads": index_heads,
        "index_dim": index_dim,
        "k_norm_w": ones(index_dim),
        "k_norm_b": z(index_dim),
        "k_norm_eps": f(1e-6),
        "index_w_scale": f(1.0),
        "index_interleaved": False,
        "rope": rope,
        "w_o": z(dim, heads * value),
        "post_w": ones(dim),
        "post_eps": f(1e-6),
        "routed": True,
        "gate_w": z(2, dim),
        "bias": z(2),
        "top_k": 1,
        "normalise": True,
        "scaling": f(1.0),
        "tiny": f(1e-20),
        "gate_up": z(2, 2, dim),
        "down": z(2, dim, 1),
        "shared_gate_up": z(2, dim),
        "shared_down": z(dim, 1),
        "has_shared": True,
    }
    x, cos, weights = z(1, dim), z(1, rope), LayerWeights(w)
    project(x, weights, cos, cos)
    finish(x, z(1, heads, latent), weights)
    # the pieces between BLAS's matmuls, for the arrays and views ``pipeline.model.fused`` hands them
    p = z(1, w["w_in"].shape[0])
    rms_rows(x, w["norm_w"], w["norm_eps"])
    rms_rows(p[:, :q_lora], w["q_norm_w"], w["q_eps"])
    assemble(p, z(1, w["w_q"].shape[0]), weights, cos, cos)
    up_values(z(1, heads, latent), weights)
    add_norm(x, z(1, dim), weights)
    route(x, weights)
