"""The compiled few-token experts (``kernels/moe_numba.py``) against the module path's arithmetic."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import moe_numba


def _reference(x, ids, weights, gate_up, down, shared_gate_up=None, shared_down=None):
    """``RoutedExperts``' sum in expert order, then the shared expert's output added."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot, e in sorted(enumerate(ids[t].tolist()), key=lambda chosen: chosen[1]):
            gate, up = F.linear(x[t : t + 1], gate_up[e]).chunk(2, dim=-1)
            out[t : t + 1] += F.linear(F.silu(gate) * up, down[e]) * weights[t, slot]
    if shared_gate_up is not None:
        gate, up = F.linear(x, shared_gate_up).chunk(2, dim=-1)
        out = out + F.linear(F.silu(gate) * up, shared_down)
    return out


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), tokens=st.integers(0, moe_numba.MAX_TOKENS), experts=st.integers(1, 6),
       k=st.integers(1, 3), dim=st.integers(1, 40), inner=st.integers(1, 24), shared=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_equals_the_module_arithmetic_and_each_token_is_its_own(
    seed, tokens, experts, k, dim, inner, shared, dtype
):
    k = min(k, experts)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inner, dim, generator=g) / dim**0.5).to(dtype)
    down = (torch.randn(experts, dim, inner, generator=g) / inner**0.5).to(dtype)
    ids = (
        torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
        if tokens
        else torch.zeros(0, k, dtype=torch.int64)
    )
    weights = torch.rand(tokens, k, generator=g).to(dtype)
    extra = (
        (
            (torch.randn(2 * inner, dim, generator=g) / dim**0.5).to(dtype),
            (torch.randn(dim, inner, generator=g) / inner**0.5).to(dtype),
        )
        if shared
        else ()
    )
    assert moe_numba.fits(x, gate_up, down, weights)
    got = moe_numba.moe(x, ids, weights, gate_up, down, *extra)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, _reference(x, ids, weights, gate_up, down, *extra), rtol=tol, atol=tol)
    for t in range(tokens):  # a token's result is the one it gets alone, bit for bit
        alone = moe_numba.moe(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], gate_up, down, *extra)
        assert torch.equal(alone[0], got[t])


def test_fits_only_a_few_cpu_tokens_of_one_float_dtype():
    x, w = torch.zeros(2, 8), torch.zeros(2, 2)
    gate_up, down = torch.zeros(4, 6, 8), torch.zeros(4, 8, 3)
    assert moe_numba.fits(x, gate_up, down, w)
    assert not moe_numba.fits(torch.zeros(moe_numba.MAX_TOKENS + 1, 8), gate_up, down, w)
    assert not moe_numba.fits(x.double(), gate_up, down, w)
    assert not moe_numba.fits(x.bfloat16(), gate_up.bfloat16(), down.bfloat16(), w.bfloat16())
    assert not moe_numba.fits(x, torch.zeros(1, 2048, 1024), down, w)  # an expert BLAS serves better
