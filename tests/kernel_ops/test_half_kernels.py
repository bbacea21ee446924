"""bfloat16 and float16 through every implementation of the four ops (docs/kernels.md, "Half
precision"): each one either computes the float64 answer to half-precision rounding (exactly, where
the op only moves bits or the inputs make every score exact), or is refused when asked for by
name, and ``auto`` then takes an implementation that does.

The row copies are covered for every dtype and implementation in ``test_kv_copy.py``; the swap-in's
compiled loop moving half-precision rows in ``test_swap_in.py``."""

from __future__ import annotations

import pytest
import torch
from _swap_in_world import assert_canaries, assert_same, build_world

from kernels import hisparse_attend_numba, indexer_topk_numba, sparse_mla_numba
from kernels.indexer_topk import indexer_scores_reference, indexer_topk, indexer_topk_oracle
from kernels.sparse_mla import sparse_mla, sparse_mla_reference
from kernels.swap_in import swap_in
from kernels.swap_in_oracle import swap_in_oracle

HALF = [torch.bfloat16, torch.float16]
TRITON = pytest.param("triton", marks=pytest.mark.interpreter)
# one rounding of the output (8 / 11 significant bits), a few of the inputs' products
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _as(case: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in case.items()}


# --- indexer top-k ------------------------------------------------------------------------------


def indexer_case(seed: int, *, integer: bool, tokens=5, heads=3, dim=16, n_reqs=3, max_ctx=48, rows=80):
    """float64 inputs; integer ones are exact in every half dtype, and so is every score."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return (
            torch.randint(-3, 4, shape, generator=g).double() if integer else torch.randn(*shape, generator=g)
        )

    req_rows = torch.randint(0, n_reqs, (tokens,), generator=g)
    seq_lens = torch.randint(1, max_ctx + 1, (tokens,), generator=g)
    req_to_token = torch.stack([torch.randperm(rows, generator=g)[:max_ctx] for _ in range(n_reqs)])
    return dict(
        index_q=draw(tokens, heads, dim).double(),
        index_w=draw(tokens, heads).double(),
        index_k=draw(rows, dim).double(),
        req_to_token=req_to_token,
        req_rows=req_rows,
        seq_lens=seq_lens,
    )


@pytest.mark.parametrize("impl", ["torch", "auto", TRITON])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_indexer_half_selects_the_float64_top_k_on_exact_scores(impl, dtype):
    for seed in range(4):
        case = indexer_case(seed, integer=True)
        want = indexer_topk_oracle(**case, top_k=12, scale=0.5)
        assert torch.equal(indexer_topk(**_as(case, dtype), top_k=12, scale=0.5, impl=impl), want)


@pytest.mark.parametrize("impl", ["torch", TRITON])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_indexer_half_scores_are_float32_and_close(impl, dtype):
    case = indexer_case(7, integer=False)
    half = _as(case, dtype)
    want = indexer_scores_reference(**half, scale=0.3, max_len=48)  # float32 scores of the half inputs
    assert want.dtype == torch.float32
    exact = indexer_scores_reference(**_as(half, torch.float64), scale=0.3, max_len=48)
    finite = torch.isfinite(exact)
    torch.testing.assert_close(want[finite].double(), exact[finite], rtol=1e-5, atol=1e-5)
    if impl == "triton":
        from kernels.indexer_topk_triton import indexer_scores_triton

        got = indexer_scores_triton(**half, scale=0.3, max_len=48)
        assert got.dtype == torch.float32
        assert torch.equal(torch.isfinite(got), finite)
        torch.testing.assert_close(got[finite].double(), exact[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_indexer_numba_refuses_half_and_auto_takes_torch(dtype):
    half = _as(indexer_case(3, integer=True), dtype)
    assert not indexer_topk_numba.fits(half["index_q"], half["index_w"], half["index_k"])
    with pytest.raises(ValueError, match="numba"):
        indexer_topk(**half, top_k=12, scale=0.5, impl="numba")
    assert torch.equal(
        indexer_topk(**half, top_k=12, scale=0.5), indexer_topk(**half, top_k=12, scale=0.5, impl="torch")
    )


# --- sparse MLA ---------------------------------------------------------------------------------


def mla_case(seed: int, *, tokens=3, heads=4, latent=32, rope=8, rows=60, top_k=24) -> dict:
    g = torch.Generator().manual_seed(seed)
    slots = torch.stack([torch.randperm(rows, generator=g)[:top_k] for _ in range(tokens)])
    slots[torch.rand(tokens, top_k, generator=g) < 0.2] = -1
    slots[-1, :] = -1  # a query with nothing to attend: zeros
    return dict(
        q_latent=torch.randn(tokens, heads, latent, generator=g, dtype=torch.float64),
        q_rope=torch.randn(tokens, heads, rope, generator=g, dtype=torch.float64),
        kv=torch.randn(rows, latent + rope, generator=g, dtype=torch.float64),
        slots=slots,
    )


@pytest.mark.parametrize("impl", ["torch", "auto", TRITON])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_sparse_mla_half_close_to_float64(impl, dtype):
    half = _as(mla_case(11), dtype)
    exact = sparse_mla_reference(**_as(half, torch.float64), scale=0.25)  # the same (rounded) inputs
    got = sparse_mla(**half, scale=0.25, impl=impl, validate=True)
    assert got.dtype == dtype
    assert not got[-1].any()
    torch.testing.assert_close(got.double(), exact, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_sparse_mla_numba_refuses_half_and_auto_takes_torch(dtype):
    half = _as(mla_case(12), dtype)
    assert not sparse_mla_numba.fits(half["q_latent"], half["q_rope"], half["kv"], half["slots"])
    with pytest.raises(ValueError, match="numba"):
        sparse_mla(**half, scale=0.25, impl="numba")
    assert torch.equal(sparse_mla(**half, scale=0.25), sparse_mla(**half, scale=0.25, impl="torch"))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_one_call_attention_leaves_half_to_the_step_by_step_path(dtype):
    """The compiled one-call layer (``hisparse_attend_numba``) takes float32/64 only; a half-precision
    engine runs the ops one by one (tests/hisparse/test_half_precision.py serves it end to end)."""
    m, i = mla_case(13), indexer_case(13, integer=False)
    args = [t.to(dtype) for t in (m["q_latent"], m["kv"], i["index_k"], i["index_q"], m["kv"])]
    assert not hisparse_attend_numba.fits(*args, 8)
    assert hisparse_attend_numba.fits(*[t.float() for t in args], 8)


# --- swap-in ------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["torch", "numba", "auto", TRITON])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_swap_in_moves_half_rows_exactly(impl, dtype):
    loaded = 0
    for seed in range(6):
        world = build_world(seed, num_reqs=3, num_steps=2, top_k=6, hot=8, extra=2)
        world.host_full = (world.host_full * 1.37 + 0.11).to(dtype)
        world.device_full = world.device_full.to(dtype)
        expected_world, got_world = world.clone(), world.clone()
        expected = swap_in_oracle(*expected_world.args())
        got = swap_in(*got_world.args(), impl=impl, validate=True)
        assert_same(expected_world, expected, got_world, got, f"{impl} vs oracle, {dtype}")
        assert torch.equal(got_world.device_full, expected_world.device_full)
        assert_canaries(world, got_world)
        assert int(got.bytes_copied.sum()) == int(got.misses.sum()) * world.device_full.shape[1] * (
            world.device_full.element_size()
        )
        loaded += int(got.misses.sum())
    assert loaded
