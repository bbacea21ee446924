"""Sparse MLA: equal to dense attention restricted to the same rows; Triton == reference; canaries."""

from __future__ import annotations

import pytest
import torch
from _kernel_canary import strided_last
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
    torch.testing.assert_close(
        sparse_mla(**case, scale=0.2, impl="torch").double(), want, rtol=1e-5, atol=1e-5
    )
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
        (
            torch.float32,
            1e-5,
            dict(heads=20, top_k=70, rows=90, latent=32, rope=16),
        ),  # 2 head blocks, 2 slot blocks
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
    for name, bad in [
        ("q_latent", case["q_latent"][0]),
        ("q_rope", case["q_rope"].double()),
        ("kv", case["kv"][:, :10]),
        ("slots", case["slots"].float()),
        ("slots", case["slots"][:1]),
    ]:
        with pytest.raises(ValueError, match=name):
            sparse_mla(**{**case, name: bad}, scale=1.0, impl="torch")
    case["slots"][0, 0] = case["kv"].shape[0]
    with pytest.raises(ValueError, match="slots"):
        sparse_mla(**case, scale=1.0, validate=True)


# --- canaries around every buffer the Triton kernel touches, and the wrapper's layout checks ------


def _fill(kind: str):
    """Canary contents: NaN, or huge values (a read row would swamp the softmax)."""
    g = torch.Generator().manual_seed(23)
    if kind == "nan":
        return lambda shape, dtype: torch.full(shape, float("nan"), dtype=dtype)
    return lambda shape, dtype: (BIG * (torch.randn(shape, generator=g).abs() + 1)).to(dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize(("fill", "heads"), [("nan", 3), ("nan", 17), ("big", 17)])
def test_triton_touches_nothing_outside_its_buffers(fill, heads, monkeypatch):
    """Queries, rows and slots are views with canary rows before and after and canary columns
    beside them (an extra head and extra dims for the queries, extra columns past C + R for the
    rows, slot columns past K naming the canary row just past the last row); the output sits inside
    a flat sentinel. 17 heads take two head blocks, the second one mostly masked. The result equals
    dense attention over the selected rows, an all-masked query gives zeros, every output element
    is written, nothing outside the output is, and no input changes."""
    from _kernel_canary import CanaryOutputs, assert_unchanged, embed, snapshot

    import kernels.sparse_mla_triton as triton_module

    rows = 30
    case = make_case(13, tokens=3, heads=heads, latent=20, rope=6, rows=rows, top_k=24, p_masked=0.3)
    case["slots"][2] = -1  # an all-masked query
    want = dense_restricted(case, 0.3)
    f = _fill(fill)
    args = dict(
        q_latent=embed(case["q_latent"], (CANARY, 1, 5), f, lead=CANARY),
        q_rope=embed(case["q_rope"], (CANARY, 1, 3), f, lead=CANARY),
        kv=embed(case["kv"], (CANARY, 7), f, lead=CANARY),
        slots=embed(case["slots"], (CANARY, 9), rows, lead=CANARY),  # slot `rows`: a canary row
    )
    assert args["kv"].stride(0) == 20 + 6 + 7 and args["slots"].stride(0) == 24 + 9
    before = snapshot(args)
    outputs = CanaryOutputs()
    monkeypatch.setattr(triton_module, "torch", outputs.proxy)
    got = sparse_mla(**args, scale=0.3, impl="triton", validate=True)
    outputs.check()
    assert len(outputs.allocated) == 1
    assert got.shape == (3, heads, 20) and bool(torch.isfinite(got).all())
    assert not got[2].any(), "an all-masked query gives zeros"
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        sparse_mla(**args, scale=0.3, impl="torch").double(), want, rtol=1e-5, atol=1e-5
    )
    assert_unchanged(args, before)


# (argument, what is wrong, how to break it, what the message says)
SPARSE_MLA_LAYOUT = [
    ("q_latent", "stride", strided_last, "must be contiguous in its last dim"),
    ("q_latent", "dtype", lambda x: x.long(), "must have dtype"),
    ("q_latent", "shape", lambda x: x[0], "must have 3 dims"),
    ("q_rope", "stride", strided_last, "must be contiguous in its last dim"),
    ("q_rope", "dtype", lambda x: x.double(), "must have dtype torch.float32"),  # must match q_latent
    ("q_rope", "shape", lambda x: x[:, :1], "must have shape"),  # 1 head, q_latent has 5
    ("kv", "stride", strided_last, "must be contiguous in its last dim"),
    ("kv", "dtype", lambda x: x.long(), "must have dtype"),
    ("kv", "shape", lambda x: x[:, :10], "must have shape"),  # not C + R columns
    ("slots", "stride", strided_last, "must be contiguous in its last dim"),
    ("slots", "dtype", lambda x: x.float(), "must have dtype"),
    ("slots", "shape", lambda x: x[:1], "must have shape"),  # not one row per query
]


@pytest.mark.parametrize(
    ("name", "kind", "breaks", "says"), SPARSE_MLA_LAYOUT, ids=[f"{r[0]}-{r[1]}" for r in SPARSE_MLA_LAYOUT]
)
@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_wrapper_rejects_a_bad_layout_naming_the_argument(name, kind, breaks, says, impl):
    """Checked before any launch (so no kernel runs here): a non-contiguous last dim, a wrong dtype,
    a mismatched shape each raise a ValueError that starts with the argument's name."""
    case = make_case(0)
    bad = breaks(case[name])
    if kind == "stride":
        assert torch.equal(bad, case[name]), "the same values, only the layout differs"
    with pytest.raises(ValueError, match=rf"^{name} {says}"):
        sparse_mla(**{**case, name: bad}, scale=1.0, impl=impl)


# --- the compiled CPU loop (kernels/sparse_mla_numba.py) ----------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    tokens=st.integers(1, 6),
    heads=st.integers(1, 6),
    top_k=st.integers(1, 50),
    p_masked=st.sampled_from([0.0, 0.3, 1.0]),
    slot_dtype=st.sampled_from([torch.int32, torch.int64]),
    duplicates=st.booleans(),
)
def test_numba_equals_reference(seed, tokens, heads, top_k, p_masked, slot_dtype, duplicates):
    """Float64 to rounding, float32 within the reference's own error; masked slots, all-masked
    queries (zeros), duplicated slots (each copy counts, as in the reference)."""
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        case = make_case(
            seed,
            tokens=tokens,
            heads=heads,
            top_k=top_k,
            dtype=dtype,
            p_masked=p_masked,
            slot_dtype=slot_dtype,
        )
        if duplicates and top_k > 1:
            case["slots"][:, -1] = case["slots"][:, 0]
        got = sparse_mla(**case, scale=0.2, impl="numba", validate=True)
        want = sparse_mla(**case, scale=0.2, impl="torch")
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert not got[(case["slots"] < 0).all(dim=1)].any()  # an all-masked query gives zeros


@pytest.mark.parametrize("impl", ["numba", "auto"])
def test_numba_slot_past_the_rows_raises(impl):
    """Without ``validate``, a slot past the last row is an IndexError, never a read outside ``kv``."""
    case = make_case(5, tokens=2, heads=4)
    case["slots"][1, 3] = case["kv"].shape[0]
    with pytest.raises(IndexError):
        sparse_mla(**case, scale=1.0, impl=impl)


def test_numba_empty_calls():
    """No queries, or no slot columns: an empty result, or zeros."""
    case = make_case(0, tokens=2, heads=3)
    none = sparse_mla(
        case["q_latent"][:0], case["q_rope"][:0], case["kv"], case["slots"][:0], 1.0, impl="numba"
    )
    assert none.shape == (0, 3, 24)
    zeros = sparse_mla(case["q_latent"], case["q_rope"], case["kv"], case["slots"][:, :0], 1.0, impl="numba")
    assert zeros.shape == (2, 3, 24) and not zeros.any()
    assert torch.equal(
        zeros,
        sparse_mla(case["q_latent"], case["q_rope"], case["kv"], case["slots"][:, :0], 1.0, impl="torch"),
    )


def test_numba_reads_strided_views_and_touches_nothing_else():
    """Queries and rows as views inside canary buffers (huge values): the result equals dense
    attention over the selected rows, and no input changes."""
    case = make_case(3, tokens=4, heads=3, latent=20, rope=6, rows=30, top_k=24)
    want = dense_restricted(case, 0.3)
    wide_q = torch.full((4, 5, 40), BIG)
    wide_q[:, 1:4, 3:23] = case["q_latent"]
    wide_r = torch.full((4, 5, 10), BIG)
    wide_r[:, 1:4, 2:8] = case["q_rope"]
    args = dict(q_latent=wide_q[:, 1:4, 3:23], q_rope=wide_r[:, 1:4, 2:8], kv=case["kv"], slots=case["slots"])
    before = {k: v.clone() for k, v in args.items()}
    got = sparse_mla(**args, scale=0.3, impl="numba")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    for k, v in args.items():
        assert torch.equal(v, before[k]), k


def test_numba_query_does_not_depend_on_the_other_queries():
    """A query's result is the same bits whether it is attended alone, in a slice, or in the whole
    call: a verify step or a prefill split into rounds attends exactly as it would at once."""
    case = make_case(11, tokens=9, heads=4, top_k=33)
    whole = sparse_mla(**case, scale=0.25, impl="numba")
    for lo, hi in [(0, 1), (3, 4), (2, 7), (8, 9)]:
        part = sparse_mla(
            case["q_latent"][lo:hi],
            case["q_rope"][lo:hi],
            case["kv"],
            case["slots"][lo:hi],
            scale=0.25,
            impl="numba",
        )
        assert torch.equal(part, whole[lo:hi])


def test_auto_takes_the_loop_for_small_queries_only(monkeypatch):
    """``auto`` on a CPU: small queries go to the loop, large ones (heads x slots x (C + R) beyond
    ``MAX_QUERY_ELEMENTS``), mixed dtypes and tensors that require a gradient to the torch path."""
    import sys

    import kernels.sparse_mla_numba as compiled

    module = sys.modules["kernels.sparse_mla"]

    calls = []
    original = compiled.sparse_mla_numba
    monkeypatch.setattr(compiled, "sparse_mla_numba", lambda *a: calls.append(a[0].shape) or original(*a))
    small = make_case(0, tokens=2, heads=4, latent=24, rope=8, top_k=40)
    module.sparse_mla(**small, scale=0.1)
    assert calls == [(2, 4, 24)]
    calls.clear()
    large = make_case(0, tokens=1, heads=16, latent=120, rope=8, rows=300, top_k=200)  # 16 * 200 * 128
    assert not compiled.pays_for(16, 128, 200)
    module.sparse_mla(**large, scale=0.1)
    mixed = {**small, "kv": small["kv"].double()}
    module.sparse_mla(**mixed, scale=0.1)
    grad = {**small, "q_latent": small["q_latent"].clone().requires_grad_()}
    out = module.sparse_mla(**grad, scale=0.1)
    assert out.requires_grad  # the torch path: the gradient flows
    assert calls == []
    with pytest.raises(ValueError, match="numba"):
        module.sparse_mla(**mixed, scale=0.1, impl="numba")


def test_warm_up_compiles_the_attention_loop_only_where_auto_takes_it(monkeypatch):
    import kernels
    import kernels.small_ops_numba as small
    import kernels.sparse_mla_numba as compiled

    kernels.warm_up("cpu", torch.float64, index_heads=4, index_dim=32, swap_in=False, attention=(4, 80, 64))
    assert any(sig[0].dtype.name == "float64" for sig in compiled._kernel.signatures)
    assert any(sig[0].dtype.name == "float64" for sig in small._rms_norm.signatures)
    called = []
    monkeypatch.setattr(compiled, "warm_up", called.append)
    kernels.warm_up(
        "cpu", torch.float32, index_heads=4, index_dim=32, swap_in=False, attention=(16, 576, 2048)
    )
    kernels.warm_up("cuda", torch.float32, index_heads=4, index_dim=32, swap_in=False, attention=(4, 80, 64))
    assert called == []  # too wide for the loop, or not a CPU run
    kernels.warm_up("cpu", torch.float32, index_heads=4, index_dim=32, swap_in=False, attention=(4, 80, 64))
    assert called == [torch.float32]
