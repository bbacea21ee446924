"""The compiled CPU RMSNorm and RoPE rotation (``kernels/small_ops_numba.py``) against the torch ops."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import small_ops_numba as so


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), rows=st.integers(0, 9), dim=st.integers(1, 300), strided=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_rms_norm_equals_torch(seed, rows, dim, strided, dtype):
    """To rounding (the sum of squares runs in another order), on contiguous rows and on column
    slices of a wider tensor (what the fused layer hands it), in the input's dtype and shape."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, dim + 5, generator=g).to(dtype) * 3
    x = wide[:, 2 : 2 + dim] if strided else wide[:, :dim].contiguous()
    weight = torch.randn(dim, generator=g).to(dtype)
    got = so.rms_norm(x, weight, 1e-6)
    want = torch.rms_norm(x, (dim,), weight, 1e-6)
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if rows:
        assert torch.equal(so.rms_norm(x[None], weight, 1e-6)[0], got)  # leading dimensions flatten


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), tokens=st.integers(0, 5), heads=st.integers(1, 6),
       half=st.integers(1, 16), interleaved=st.booleans(), strided=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_rotate_equals_the_torch_ops_bit_for_bit(seed, tokens, heads, half, interleaved, strided, dtype):
    """The same two products and one sum per element as ``x' * cos + roll(x', R/2) * sin'``."""
    g = torch.Generator().manual_seed(seed)
    dim = 2 * half
    full = torch.randn(tokens, heads + 2, dim, generator=g).to(dtype)
    x = full[:, 1 : 1 + heads] if strided else full[:, :heads].contiguous()
    cos = torch.randn(tokens, dim, generator=g).to(dtype)
    sin = torch.randn(tokens, dim, generator=g).to(dtype)
    ref = x.unflatten(-1, (half, 2)).transpose(-1, -2).reshape(x.shape) if interleaved else x
    want = ref * cos[:, None] + ref.roll(half, dims=-1) * sin[:, None]
    got = so.rotate(x, cos, sin, interleaved)
    assert got.is_contiguous() and got.dtype == dtype
    assert torch.equal(got, want)


def test_mismatched_shapes_raise_instead_of_reading_past_a_tensor():
    with pytest.raises(ValueError, match="weight"):
        so.rms_norm(torch.ones(2, 4), torch.ones(3), 1e-6)
    with pytest.raises(ValueError, match="cos"):
        so.rotate(torch.ones(2, 1, 4), torch.ones(2, 2), torch.ones(2, 2), False)
    with pytest.raises(ValueError, match="cos"):
        so.rotate(torch.ones(3, 1, 4), torch.ones(2, 4), torch.ones(2, 4), True)


def test_fits_only_cpu_tensors_of_one_float_dtype():
    x = torch.ones(2, 3)
    assert so.fits(x, torch.ones(3))
    assert not so.fits(x, torch.ones(3, dtype=torch.float64))
    assert not so.fits(x.half(), torch.ones(3).half())
    assert not so.fits(x.to(torch.bfloat16))


def test_training_norm_records_the_gradient():
    """With a gradient recorded, RMSNorm keeps its torch ops (the loop records none)."""
    from pipeline.model.layers import RMSNorm

    norm = RMSNorm(4)
    x = torch.randn(3, 4, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(
            norm(x), torch.rms_norm(x, (4,), norm.weight, norm.eps), rtol=1e-6, atol=1e-6
        )


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    rows=st.integers(0, 5),
    dim=st.integers(1, 64),
    strided=st.booleans(),
    lead=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_compiled_norm_is_rms_norm_bit_for_bit(seed, rows, dim, strided, lead, dtype):
    """The weight's handle runs the same loop on the same arrays as ``rms_norm``."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, dim + 3, generator=g).to(dtype)
    x = wide[:, 1 : 1 + dim] if strided else wide[:, :dim].contiguous()
    x = x[None] if lead else x
    weight = torch.randn(dim, generator=g).to(dtype)
    norm = so.CompiledNorm(weight, 1e-5)
    assert norm.takes(x) and norm.current(weight)
    got = norm(x)
    assert got.shape == x.shape and torch.equal(got, so.rms_norm(x, weight, 1e-5))


def test_compiled_norm_knows_what_it_cannot_take():
    weight = torch.ones(4)
    norm = so.CompiledNorm(weight, 1e-6)
    assert not norm.takes(torch.ones(2, 4, dtype=torch.float64))  # another dtype
    assert not norm.takes(torch.ones(2, 5))  # another width
    assert not norm.current(torch.ones(4))  # another weight
    half = torch.ones(4, dtype=torch.bfloat16)
    assert not so.CompiledNorm(half, 1e-6).takes(half[None])  # a dtype the loop does not take
    assert so.CompiledNorm(half, 1e-6).current(half)  # ... remembered: asked again only for a new weight
    assert not so.CompiledNorm(torch.ones(2, 2), 1e-6).takes(torch.ones(3, 2))


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    tokens=st.integers(0, 4),
    heads=st.integers(1, 5),
    half=st.integers(1, 8),
    interleaved=st.booleans(),
    strided=st.booleans(),
)
def test_rotate_with_tables_is_rotate(seed, tokens, heads, half, interleaved, strided):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(tokens, heads + 2, 2 * half, generator=g)
    x = full[:, 1 : 1 + heads] if strided else full[:, :heads].contiguous()
    cos, sin = torch.randn(tokens, 2 * half, generator=g), torch.randn(tokens, 2 * half, generator=g)
    got = so.rotate_with_tables(x, cos.numpy(), sin.numpy(), interleaved)
    assert torch.equal(got, so.rotate(x, cos, sin, interleaved))
