"""The FP8 Triton kernels (sparse MLA and the indexer's scores) read the bytes ``kernels.kv_fp8``
stores and equal the torch path, which dequantizes the same bytes before the float path.

The dequantized values are the same float32 numbers in both (an e4m3 value times its float32 scale,
one rounding); what differs is the order in which the dots and the softmax sum them, so float32
results agree to float32 rounding of O(1) sums (1e-5, as for the unquantized kernel), and integer
inputs, whose every product and sum is exact, select exactly the same positions.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels import kv_fp8
from kernels.indexer_topk import indexer_scores_reference, indexer_topk
from kernels.sparse_mla import sparse_mla, sparse_mla_reference
from kernels.sparse_mla_fp8_triton import e4m3_to_float32, float32_from_bytes, words

pytestmark = pytest.mark.interpreter

NAN_BYTE = 0x7F  # an e4m3 NaN: a canary byte the kernel reads would make its result NaN


def random_rows(gen, n, latent, rope, *, zero_tiles=True):
    """FP8 rows as stored, from arbitrary bytes: every e4m3 code but the NaNs (subnormals and both
    zeros included), scales over several magnitudes (some tiles all zero with scale 1, as the
    quantizer writes them), random bfloat16 rope values."""
    tiles = -(-latent // kv_fp8.TILE)
    codes = torch.randint(0, 254, (n, latent), generator=gen)
    codes = codes + (codes >= NAN_BYTE).long()  # skip 0x7F; 0xFF is past the range
    scales = torch.exp2(torch.randint(-12, 3, (n, tiles), generator=gen).float()) * (
        1 + torch.rand(n, tiles, generator=gen)
    )
    if zero_tiles:
        zero = torch.rand(n, tiles, generator=gen) < 0.2
        codes.view(n, -1)[zero.repeat_interleave(kv_fp8.TILE, dim=1)[:, :latent]] = 0
        scales[zero] = 1.0
    rope = torch.randn(n, rope, generator=gen).to(torch.bfloat16)
    return torch.cat(
        [codes.to(torch.uint8), scales.view(torch.uint8), rope.view(torch.uint8)], dim=-1
    ).contiguous()


def placed(pool: torch.Tensor, offset: int, extra: int) -> torch.Tensor:
    """``pool``'s bytes at byte ``offset`` of a buffer of NaN bytes, rows ``extra`` bytes apart
    beyond their width (a canary row before and after)."""
    n, width = pool.shape
    stride = width + extra
    buf = torch.full((offset + (n + 2) * stride,), NAN_BYTE, dtype=torch.uint8)
    view = torch.as_strided(buf, (n, width), (stride, 1), offset + stride)
    view.copy_(pool)
    return view


def mla_case(
    seed, *, tokens=3, heads=5, latent=24, rope=8, rows=50, top_k=40, dtype=torch.float32, p_masked=0.2
):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.stack([torch.randperm(rows, generator=gen)[:top_k] for _ in range(tokens)])
    slots[torch.rand(tokens, top_k, generator=gen) < p_masked] = -1
    return dict(
        q_latent=torch.randn(tokens, heads, latent, generator=gen).to(dtype),
        q_rope=torch.randn(tokens, heads, rope, generator=gen).to(dtype),
        kv=random_rows(gen, rows, latent, rope),
        slots=slots,
    )


# --- the decoding helpers ------------------------------------------------------------------------


@triton.jit
def _decode_kernel(byte_ptr, out_ptr, scale_out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ok = i < n
    tl.store(out_ptr + i, e4m3_to_float32(tl.load(byte_ptr + i, mask=ok, other=0)), mask=ok)
    words = i < n // 4
    tl.store(scale_out_ptr + i, float32_from_bytes(byte_ptr + 4 * i, words), mask=words)


def test_every_e4m3_byte_and_float32_decodes_like_torch():
    """All 256 codes (zeros, subnormals, normals, NaNs, both signs) equal torch's e4m3 -> float32,
    and the same bytes read as 64 little-endian float32 equal torch's view."""
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = torch.empty(256, dtype=torch.float32)
    floats = torch.empty(64, dtype=torch.float32)
    _decode_kernel[(1,)](raw, got, floats, 256, BLOCK=256)
    want = raw.view(kv_fp8.E4M3).float()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0.0 (and 0xFF's NaN) negative
    assert torch.equal(floats.view(torch.int32), raw.view(torch.int32))


# --- sparse MLA ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        dict(),  # C % 4 == 0 and 44-byte rows: the scales and rope read as words
        dict(latent=20, rope=5, top_k=17),  # 34-byte rows: every value from its bytes
        dict(latent=200, rope=6, heads=3, top_k=70, rows=90),  # two tiles, the last one short
        dict(latent=130, rope=4, heads=17, tokens=2),  # C % 4 != 0; two head blocks
    ],
)
def test_sparse_mla_equals_the_torch_path(shape):
    case = mla_case(3, **shape)
    case["slots"][1] = -1  # an all-masked query
    want = sparse_mla_reference(**case, scale=0.3)
    got = sparse_mla(**case, scale=0.3, impl="triton", validate=True)
    assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
    assert not got[1].any(), "an all-masked query gives zeros"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sparse_mla_v32_sizes():
    """C = 512, R = 64 (656-byte rows, aligned), 16 heads, top-k 256."""
    case = mla_case(5, tokens=2, heads=16, latent=512, rope=64, rows=400, top_k=256, p_masked=0.1)
    assert case["kv"].shape[1] == 656
    want = sparse_mla_reference(**case, scale=0.05)
    torch.testing.assert_close(sparse_mla(**case, scale=0.05, impl="triton"), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("latent", "rope", "offset", "extra", "aligned"),
    [(24, 8, 4, 4, True), (24, 8, 1, 0, False), (24, 8, 0, 2, False), (20, 5, 3, 7, False)],
)
def test_sparse_mla_reads_only_its_rows(latent, rope, offset, extra, aligned):
    """A pool inside a buffer of NaN bytes, word-aligned or not (its offset, its row stride, its
    width), rows padded or not: no NaN byte is read, and every layout gives the same result."""
    case = mla_case(11, latent=latent, rope=rope)
    want = sparse_mla(**case, scale=0.3, impl="triton")
    case["kv"] = placed(case["kv"], offset, extra)
    assert (words(case["kv"]) is not None) == aligned
    got = sparse_mla(**case, scale=0.3, impl="triton", validate=True)
    assert torch.equal(got, want)


def test_sparse_mla_quantized_rows_with_zero_and_subnormal_tiles():
    """Rows written by the quantizer: an all-zero tile (scale 1) and tiles whose small values
    quantize to subnormal codes beside their largest."""
    gen = torch.Generator().manual_seed(2)
    latent, rope, n = 256, 16, 40
    rows = torch.randn(n, latent + rope, generator=gen)
    rows[::3, :128] = 0.0
    rows[1::3, 128:latent] *= 1e-5
    rows[1::3, 128] = 1.0
    stored = kv_fp8.quantize_rows(rows, latent)
    codes = stored[:, :latent].int()
    assert bool(((codes & 0x78) == 0).any() & ((codes & 0x7) != 0).any()), "subnormal codes present"
    slots = torch.randint(-1, n, (4, 32), generator=gen)
    q_latent, q_rope = torch.randn(4, 6, latent, generator=gen), torch.randn(4, 6, rope, generator=gen)
    want = sparse_mla_reference(q_latent, q_rope, stored, slots, 0.1)
    got = sparse_mla(q_latent, q_rope, stored, slots, 0.1, impl="triton")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sparse_mla_half_queries():
    """bfloat16 queries: the result is rounded to bfloat16 by both paths (one ulp apart at most)."""
    case = mla_case(8, dtype=torch.bfloat16)
    want = sparse_mla_reference(**case, scale=0.3)
    got = sparse_mla(**case, scale=0.3, impl="triton")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_sparse_mla_dispatch(monkeypatch):
    """``auto`` on a CPU stays on the torch path (bit for bit the reference); ``triton`` runs the FP8
    kernel; ``numba`` refuses an FP8 pool."""
    import kernels.sparse_mla_fp8_triton as fp8

    case = mla_case(4)
    assert torch.equal(sparse_mla(**case, scale=0.3), sparse_mla_reference(**case, scale=0.3))
    calls = []
    kernel = fp8.sparse_mla_fp8_triton
    monkeypatch.setattr(fp8, "sparse_mla_fp8_triton", lambda *a: calls.append(1) or kernel(*a))
    sparse_mla(**case, scale=0.3)
    sparse_mla(**case, scale=0.3, impl="torch")
    assert not calls
    sparse_mla(**case, scale=0.3, impl="triton")
    assert calls == [1]
    with pytest.raises(ValueError, match="numba"):
        sparse_mla(**case, scale=0.3, impl="numba")
    with pytest.raises(ValueError, match="size limits"):
        big = torch.zeros(1, 1, fp8.MAX_LATENT + 4)
        kv = torch.zeros(2, kv_fp8.row_bytes(fp8.MAX_LATENT + 4, 4), dtype=torch.uint8)
        sparse_mla(big, torch.zeros(1, 1, 4), kv, torch.zeros(1, 1, dtype=torch.long), 1.0, impl="triton")


# --- the indexer ---------------------------------------------------------------------------------


def index_case(
    seed, *, tokens=5, heads=4, dim=16, n_reqs=3, max_ctx=40, rows=64, exact=False, dtype=torch.float32
):
    """FP8 keys and the queries' tables. ``exact``: small integer queries, weights and key codes
    with power-of-two scales, so that every product and sum is exact (many ties)."""
    gen = torch.Generator().manual_seed(seed)
    if exact:
        codes = torch.randint(0, 3, (rows, dim), generator=gen) * 8 + 0x30  # 1.0, 2.0, 4.0 (e4m3)
        codes = torch.where(torch.rand(rows, dim, generator=gen) < 0.5, codes + 0x80, codes)  # sign
        codes[torch.rand(rows, dim, generator=gen) < 0.2] = 0
        scales = torch.exp2(torch.randint(-2, 2, (rows, 1), generator=gen).float())
        q = torch.randint(-2, 3, (tokens, heads, dim), generator=gen).to(dtype)
        w = torch.randint(-2, 3, (tokens, heads), generator=gen).to(dtype)
    else:
        codes = torch.randint(0, 254, (rows, dim), generator=gen)
        codes = codes + (codes >= NAN_BYTE).long()
        scales = torch.rand(rows, 1, generator=gen) * 0.01
        q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
        w = torch.randn(tokens, heads, generator=gen).to(dtype)
    keys = torch.cat([codes.to(torch.uint8), scales.view(torch.uint8)], dim=-1).contiguous()
    req_rows = torch.randint(0, n_reqs, (tokens,), generator=gen)
    lens = torch.randint(0, max_ctx + 1, (tokens,), generator=gen)
    table = torch.randint(0, rows, (n_reqs, max_ctx), generator=gen)
    return dict(index_q=q, index_w=w, index_k=keys, req_to_token=table, req_rows=req_rows, seq_lens=lens)


@pytest.mark.parametrize(
    ("dim", "offset", "extra", "dtype", "aligned"),
    [
        (16, 0, 0, torch.float32, True),
        (16, 1, 0, torch.float32, False),
        (6, 0, 3, torch.float32, False),
        (16, 0, 4, torch.bfloat16, True),
    ],
)
def test_indexer_selects_like_the_torch_path_on_exact_inputs(dim, offset, extra, dtype, aligned):
    """Exact scores, ties included: the same positions, in the contract's order, -1 padded; a key
    pool of 16 + 4 bytes is read as words, 6 + 4 or one at an odd offset from its bytes."""
    case = index_case(7, dim=dim, exact=True, dtype=dtype)
    want = indexer_topk(**case, top_k=12, scale=0.5, impl="torch")
    case["index_k"] = placed(case["index_k"], offset, extra)
    assert (words(case["index_k"]) is not None) == aligned
    got = indexer_topk(**case, top_k=12, scale=0.5, impl="triton", validate=True)
    assert torch.equal(got, want)
    assert bool((got == -1).any()), "some queries see fewer than top_k positions"


def test_indexer_scores_close_on_random_bytes():
    from kernels.indexer_fp8_triton import indexer_scores_fp8_triton

    case = index_case(9, dim=32)
    max_len = int(case["seq_lens"].max())
    got = indexer_scores_fp8_triton(**case, scale=0.3, max_len=max_len)
    plain = {**case, "index_k": kv_fp8.dequantize_keys(case["index_k"], torch.float32)}
    want = indexer_scores_reference(**plain, scale=0.3, max_len=max_len)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_indexer_dispatch(monkeypatch):
    """``auto`` on a CPU dequantizes and stays on the float paths; ``triton`` runs the FP8 kernel."""
    import kernels.indexer_fp8_triton as fp8

    case = index_case(3, exact=True)
    calls = []
    kernel = fp8.indexer_topk_fp8_triton
    monkeypatch.setattr(fp8, "indexer_topk_fp8_triton", lambda *a: calls.append(1) or kernel(*a))
    auto = indexer_topk(**case, top_k=8, scale=0.5)
    assert not calls
    assert torch.equal(indexer_topk(**case, top_k=8, scale=0.5, impl="triton", max_seq_len=40), auto)
    assert calls == [1]
    empty = {k: v[:0] if k in ("index_q", "index_w", "req_rows", "seq_lens") else v for k, v in case.items()}
    assert indexer_topk(**empty, top_k=8, scale=0.5, impl="triton").shape == (0, 8)
