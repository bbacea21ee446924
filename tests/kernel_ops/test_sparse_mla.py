"""Sparse MLA: equal to dense attention restricted to the same rows; Triton == reference; canaries."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.sparse_mla import sparse_mla

CANARY = 2
BIG = 1e4  # canary row value: reading one would swamp the softmax


def make_case(seed, *, tokens=3, heads=5, latent=24, rope=8, rows=50, top_k=40, dtype=torch.float32,
              p_masked=0.2, slot_dtype=torch.int64):
    """Slots unique per query (as swap-in returns them), -1 sprinkled in; kv inside canary rows."""
    g = torch.Generator().manual_seed(seed)
    kv_full = torch.full((rows + 2 * CANARY, latent + rope), BIG, dtype=dtype)
    kv_full[CANARY:-CANARY] = torch.randn(rows, latent + rope, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(rows, generator=g)[:top_k] for _ in range(tokens)])
    slots[torch.rand(tokens, top_k, generator=g) < p_masked] = -1
    return dict(
        q_latent=torch.randn(tokens, heads, latent, generator=g).to(dtype),
        q_rope=torch.randn(tokens, heads, rope, generator=g).to(dtype),
        kv=kv_full[CANARY:-CANARY],
        slots=slots.to(slot_dtype),
    )


def dense_restricted(case, scale):
    """Attention over *all* rows with a mask keeping the selected ones, in float64."""
    q_lat, q_rope, kv = case["q_latent"].double(), case["q_rope"].double(), case["kv"].double()
    c = q_lat.shape[-1]
    logits = (q_lat @ kv[:, :c].T + q_rope @ kv[:, c:].T) * scale  # [T, H, rows]
    keep = torch.zeros(q_lat.shape[0], kv.shape[0], dtype=torch.bool)
    for t, row in enumerate(case["slots"].tolist()):
        keep[t, [s for s in row if s >= 0]] = True
    logits = logits.masked_fill(~keep[:, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    return probs @ kv[:, :c]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), heads=st.integers(1, 6), top_k=st.integers(1, 50),
       p_masked=st.sampled_from([0.0, 0.3, 1.0]))
def test_reference_equals_dense_float64(seed, heads, top_k, p_masked):
    case = make_case(seed, heads=heads, top_k=top_k, dtype=torch.float64, p_masked=p_masked)
    got = sparse_mla(**case, scale=0.2, impl="torch", validate=True)
    torch.testing.assert_close(got, dense_restricted(case, 0.2), rtol=1e-12, atol=1e-12)


def test_reference_float32_close_and_low_precision_computed_in_float32():
    case = make_case(4)
    want = dense_restricted(case, 0.2)
    torch.testing.assert_close(sparse_mla(**case, scale=0.2, impl="torch").double(), want, rtol=1e-5, atol=1e-5)
    half = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in case.items()}
    out = sparse_mla(**half, scale=0.2, impl="torch")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_restricted(half, 0.2), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_all_masked_query_gives_zeros(impl):
    case = make_case(1, tokens=2)
    case["slots"][0] = -1
    out = sparse_mla(**case, scale=0.5, impl=impl)
    assert not out[0].any() and out[1].abs().sum() > 0


@pytest.mark.interpreter
@pytest.mark.parametrize(
    ("dtype", "tol", "shape"),
    [
        (torch.float32, 1e-5, dict(heads=5, top_k=40)),
        (torch.float32, 1e-5, dict(heads=20, top_k=70, rows=90, latent=32, rope=16)),  # 2 head blocks, 2 slot blocks
        (torch.float16, 2e-3, dict(heads=3, top_k=17, latent=20, rope=4)),
        (torch.float32, 1e-5, dict(heads=4, top_k=9, slot_dtype=torch.int32, p_masked=0.6)),
    ],
)
def test_triton_equals_reference(dtype, tol, shape):
    case = make_case(7, dtype=dtype, **shape)
    ref = sparse_mla(**case, scale=0.3, impl="torch")
    tri = sparse_mla(**case, scale=0.3, impl="triton", validate=True)
    assert tri.dtype == dtype
    torch.testing.assert_close(tri.float(), ref.float(), rtol=tol, atol=tol)


def test_wrapper_rejects_bad_arguments():
    case = make_case(0)
    for name, bad in [("q_latent", case["q_latent"][0]), ("q_rope", case["q_rope"].double()),
                      ("kv", case["kv"][:, :10]), ("slots", case["slots"].float()),
                      ("slots", case["slots"][:1])]:
        with pytest.raises(ValueError, match=name):
            sparse_mla(**{**case, name: bad}, scale=1.0, impl="torch")
    case["slots"][0, 0] = case["kv"].shape[0]
    with pytest.raises(ValueError, match="slots"):
        sparse_mla(**case, scale=1.0, validate=True)
