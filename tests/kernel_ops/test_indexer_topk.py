"""Indexer top-k: a dense float64 oracle, the tie-break contract, -1 padding, Triton == reference."""

from __future__ import annotations

import importlib

import pytest
import torch
from _kernel_canary import strided_last
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import indexer_topk_numba
from kernels.indexer_topk import (
    MATMUL_MIN_QUERIES,
    indexer_scores_reference,
    indexer_topk,
    indexer_topk_oracle,
    indexer_topk_reference,
    stable_topk_positions,
    topk_positions,
)

CANARY = 3
BIG = 1000.0  # canary key value: a read of a canary row would dominate every score


def make_case(seed, *, tokens=4, heads=3, dim=8, n_reqs=3, max_ctx=40, rows=60, lens=None,
              dtype=torch.float32, integer=True, zero_weights=False, distinct_slots=False):
    """Inputs plus ``index_k`` surrounded by canary rows; invisible table entries hold junk.

    A request's positions may share a slot (so a key) unless ``distinct_slots``, as the memory keeps
    them. Shared integer keys score exactly alike and test the tie rule; shared float keys score
    alike only in exact arithmetic, and each implementation rounds its sums its own way, so which of
    the two comes first is no part of the contract: an oracle comparison over float keys asks for
    distinct slots."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        x = (
            torch.randint(-2, 3, shape, generator=g).double()
            if integer
            else torch.randn(*shape, generator=g).double()
        )
        return x.to(dtype)

    keys_full = torch.full((rows + 2 * CANARY, dim), BIG, dtype=dtype)
    keys_full[CANARY:-CANARY] = draw(rows, dim)
    req_rows = torch.randint(0, n_reqs, (tokens,), generator=g)
    seq_lens = (
        torch.tensor(lens) if lens is not None else torch.randint(0, max_ctx + 1, (tokens,), generator=g)
    )
    if distinct_slots:
        req_to_token = torch.stack([torch.randperm(rows, generator=g)[:max_ctx] for _ in range(n_reqs)])
    else:
        req_to_token = torch.randint(0, rows, (n_reqs, max_ctx), generator=g)
    pos = torch.arange(max_ctx)
    for t in range(tokens):  # junk beyond each query's window must never be read
        invisible = pos >= seq_lens[t]
        beyond = invisible & (pos >= seq_lens[req_rows == req_rows[t]].max())
        req_to_token[req_rows[t], beyond] = 10**9
    w = torch.zeros(tokens, heads, dtype=dtype) if zero_weights else draw(tokens, heads)
    return dict(
        index_q=draw(tokens, heads, dim),
        index_w=w,
        index_k=keys_full[CANARY:-CANARY],
        req_to_token=req_to_token,
        req_rows=req_rows,
        seq_lens=seq_lens,
    )


def dense_oracle(case, top_k, scale):
    """Python loops in float64 and an explicit (-score, position) sort."""
    q, w, k = case["index_q"].double(), case["index_w"].double(), case["index_k"].double()
    out = []
    for t in range(q.shape[0]):
        row, n = int(case["req_rows"][t]), int(case["seq_lens"][t])
        scored = []
        for s in range(n):
            key = k[int(case["req_to_token"][row, s])]
            score = sum(float(torch.relu(q[t, h] @ key * scale)) * float(w[t, h]) for h in range(q.shape[1]))
            scored.append((-score, s))
        picked = [s for _, s in sorted(scored)[:top_k]]
        out.append(picked + [-1] * (top_k - len(picked)))
    return torch.tensor(out, dtype=torch.int32).view(q.shape[0], top_k)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), top_k=st.integers(1, 24), heads=st.integers(1, 4), dim=st.integers(1, 9))
def test_reference_equals_dense_oracle_float64(seed, top_k, heads, dim):
    integer = seed % 2 == 0
    case = make_case(
        seed, heads=heads, dim=dim, dtype=torch.float64, integer=integer, distinct_slots=not integer
    )
    got = indexer_topk(**case, top_k=top_k, scale=0.5, impl="torch")
    assert torch.equal(got, dense_oracle(case, top_k, 0.5))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    tokens=st.integers(1, 40),
    n_reqs=st.integers(1, 4),
    top_k=st.integers(1, 45),
    heads=st.integers(1, 4),
    dim=st.integers(1, 9),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_matmul_reference_equals_oracle_on_exact_inputs(seed, tokens, n_reqs, top_k, heads, dim, dtype):
    # small integers: every product and sum is exact, so the scores (and their many ties) agree
    # bit for bit whatever the summation order; requests of different lengths share the batch, and
    # the ones with more than MATMUL_MIN_QUERIES queries take the matmul
    case = make_case(seed, tokens=tokens, n_reqs=n_reqs, heads=heads, dim=dim, dtype=dtype)
    want = indexer_topk_oracle(**case, top_k=top_k, scale=0.5)
    assert torch.equal(indexer_topk_reference(**case, top_k=top_k, scale=0.5), want)
    assert torch.equal(indexer_topk(**case, top_k=top_k, scale=0.5, impl="torch"), want)


def test_matmul_reference_chunks_a_long_prompt(monkeypatch):
    module = importlib.import_module("kernels.indexer_topk")
    tokens = 3 * MATMUL_MIN_QUERIES
    case = make_case(4, tokens=tokens, n_reqs=1, heads=3, dim=6, max_ctx=40, lens=[40] * tokens)
    want = indexer_topk_oracle(**case, top_k=10, scale=0.5)
    chunks = []
    score = module._request_scores
    monkeypatch.setattr(module, "_SCORE_BUDGET", 3 * 40 * 2)  # two queries per chunk
    monkeypatch.setattr(module, "_request_scores", lambda q, *a: chunks.append(q.shape[0]) or score(q, *a))
    assert torch.equal(indexer_topk_reference(**case, top_k=10, scale=0.5), want)
    assert chunks == [2] * (tokens // 2)


@pytest.mark.parametrize(
    ("sizes", "lens", "grouped"),
    [
        (
            (12, 12, 12),
            [30] * 12 + [25] * 12 + [40] * 12,
            True,
        ),  # prompts of similar sizes: one batched matmul
        (
            (12, 12, 12),
            [40] * 12 + [2] * 24,
            False,
        ),  # padding short prompts to a long one's positions would not pay
        ((9, 40, 9), [40] * 58, False),  # nor padding 9 queries to 40
    ],
)
def test_prompts_of_similar_sizes_are_scored_together(sizes, lens, grouped, monkeypatch):
    """Several requests with many queries each (a batch of prompts) take one grouped matmul when
    padding them to one shape at most doubles the dots, and ``_request_topk`` per request otherwise;
    the oracle's selection either way."""
    module = importlib.import_module("kernels.indexer_topk")
    case = make_case(9, tokens=len(lens), n_reqs=len(sizes), heads=3, dim=6, max_ctx=40, lens=lens)
    case["req_rows"] = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    want = indexer_topk_oracle(**case, top_k=10, scale=0.5)
    calls = []
    for name in ("_grouped_topk", "_request_topk"):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _f=original: calls.append(_n) or _f(*a))
    assert torch.equal(indexer_topk_reference(**case, top_k=10, scale=0.5), want)
    assert calls == (["_grouped_topk"] if grouped else ["_request_topk"] * len(sizes))


def test_grouped_requests_in_chunks_of_requests(monkeypatch):
    # decode / verify shapes: several requests with a few queries each, of different lengths
    module = importlib.import_module("kernels.indexer_topk")
    case = make_case(6, tokens=MATMUL_MIN_QUERIES, n_reqs=5, heads=2, dim=4, max_ctx=40)
    want = indexer_topk_oracle(**case, top_k=7, scale=0.5)
    monkeypatch.setattr(module, "_SCORE_BUDGET", 1)  # one request per chunk
    assert torch.equal(indexer_topk_reference(**case, top_k=7, scale=0.5), want)


def test_matmul_reference_close_to_oracle_on_random_inputs():
    case = make_case(8, tokens=4 * MATMUL_MIN_QUERIES, n_reqs=2, heads=4, dim=16, integer=False)
    got = indexer_topk_reference(**case, top_k=12, scale=0.3)
    want = indexer_topk_oracle(**case, top_k=12, scale=0.3)
    assert (got == want).float().mean() > 0.99  # equal but where two scores lie within rounding


def _tied_scores(seed: int, rows: int, n: int) -> torch.Tensor:
    """Scores with many exact ties: zeros of both signs, repeated values, -inf (not visible)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (rows, n), generator=g).double() * 0.5
    scores[torch.rand(rows, n, generator=g) < 0.3] = 0.0
    scores[torch.rand(rows, n, generator=g) < 0.2] = -0.0
    scores[torch.rand(rows, n, generator=g) < 0.2] = float("-inf")
    if seed % 3 == 0:
        scores += torch.randn(rows, n, generator=g).double()  # distinct values too
    return scores


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    rows=st.integers(0, 6),
    n=st.integers(0, 70),
    top_k=st.integers(1, 80),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]),
)
def test_topk_positions_equals_the_stable_sort(seed, rows, n, top_k, dtype):
    scores = _tied_scores(seed, rows, n).to(dtype)
    assert torch.equal(topk_positions(scores, top_k), stable_topk_positions(scores, top_k))


def test_topk_positions_ties_negative_zero_with_zero_and_keeps_leading_dims():
    scores = torch.tensor([[[0.0, -0.0, 1.0, -0.0, 0.0, float("-inf"), 0.0]], [[-0.0] * 7]])  # [2, 1, 7]
    got = topk_positions(scores, 9)
    assert got.shape == (2, 1, 9)
    assert got[0, 0].tolist() == [2, 0, 1, 3, 4, 6, -1, -1, -1]
    assert got[1, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, -1, -1]
    assert torch.equal(got, stable_topk_positions(scores, 9))


def test_reference_float32_scores_close_to_float64():
    case64 = make_case(3, dtype=torch.float64, integer=False)
    case32 = {k: (v.float() if v.is_floating_point() else v) for k, v in case64.items()}
    max_len = int(case64["seq_lens"].max())
    s64 = indexer_scores_reference(**case64, scale=0.7, max_len=max_len)
    s32 = indexer_scores_reference(**case32, scale=0.7, max_len=max_len)
    assert s32.dtype == torch.float32
    torch.testing.assert_close(s32.double(), s64, rtol=1e-5, atol=1e-5)


IMPLS = ["torch", "numba", pytest.param("triton", marks=pytest.mark.interpreter)]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    tokens=st.integers(1, 40),
    n_reqs=st.integers(1, 4),
    top_k=st.integers(1, 45),
    heads=st.integers(1, 4),
    dim=st.integers(1, 9),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_compiled_equals_oracle_on_exact_inputs(seed, tokens, n_reqs, top_k, heads, dim, dtype):
    # the heap selection against the stable sort, on exact (heavily tied) scores, rows shorter than
    # top_k, requests of different lengths in one call; junk table entries past each window unread
    case = make_case(seed, tokens=tokens, n_reqs=n_reqs, heads=heads, dim=dim, dtype=dtype)
    want = indexer_topk_oracle(**case, top_k=top_k, scale=0.5)
    assert torch.equal(indexer_topk(**case, top_k=top_k, scale=0.5, impl="numba"), want)
    assert torch.equal(indexer_topk(**case, top_k=top_k, scale=0.5, impl="auto"), want)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    n_reqs=st.integers(1, 5),
    steps=st.integers(1, 5),
    top_k=st.integers(1, 30),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_compiled_verify_runs_equal_oracle(seed, n_reqs, steps, top_k, dtype):
    # verify shapes: each request's queries consecutive, seeing one more position each (a run shares
    # its key blocks), requests of different lengths, some queries seeing nothing (padding steps)
    g = torch.Generator().manual_seed(seed)
    case = make_case(seed, tokens=n_reqs * steps, n_reqs=n_reqs, heads=2, dim=5, dtype=dtype, max_ctx=40)
    case["req_rows"] = torch.arange(n_reqs).repeat_interleave(steps)
    base = torch.randint(0, 40 - steps + 1, (n_reqs,), generator=g).repeat_interleave(steps)
    lens = base + torch.arange(steps).repeat(n_reqs)
    case["seq_lens"] = torch.where(torch.rand(lens.shape, generator=g) < 0.1, 0, lens)
    case["req_to_token"] = torch.randint(0, case["index_k"].shape[0], (n_reqs, 40), generator=g)
    want = indexer_topk_oracle(**case, top_k=top_k, scale=0.5)
    assert torch.equal(indexer_topk(**case, top_k=top_k, scale=0.5, impl="numba"), want)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), top_k=st.integers(1, 24), heads=st.integers(1, 4), dim=st.integers(1, 9))
def test_compiled_equals_dense_oracle_float64(seed, top_k, heads, dim):
    integer = seed % 2 == 0
    case = make_case(
        seed, heads=heads, dim=dim, dtype=torch.float64, integer=integer, distinct_slots=not integer
    )
    assert torch.equal(
        indexer_topk(**case, top_k=top_k, scale=0.5, impl="numba"), dense_oracle(case, top_k, 0.5)
    )


def test_compiled_close_to_oracle_on_random_inputs_and_strided_keys():
    case = make_case(8, tokens=24, n_reqs=5, heads=4, dim=16, integer=False, max_ctx=300, rows=400)
    want = indexer_topk_oracle(**case, top_k=12, scale=0.3)
    got = indexer_topk(**case, top_k=12, scale=0.3, impl="numba")
    assert (got == want).float().mean() > 0.99  # equal but where two scores lie within rounding
    wide = torch.full((case["index_k"].shape[0], 40), BIG)  # keys in rows of a wider tensor
    wide[:, :16] = case["index_k"]
    assert torch.equal(
        indexer_topk(**{**case, "index_k": wide[:, :16]}, top_k=12, scale=0.3, impl="numba"), got
    )


def test_compiled_heap_keeps_order_through_every_kind_of_entry():
    # one long row: distinct values arriving in every order, runs of equal values, -0.0 beside 0.0;
    # the heap must come out as the stable descending sort of the whole row
    g = torch.Generator().manual_seed(3)
    n = 500
    keys = torch.randint(-3, 4, (n, 1), generator=g).double() * torch.rand(n, 1, generator=g).round(
        decimals=1
    )
    case = dict(
        index_q=torch.ones(1, 1, 1, dtype=torch.float64),
        index_w=-torch.ones(1, 1, dtype=torch.float64),
        index_k=keys,
        req_to_token=torch.randperm(n, generator=g)[None],
        req_rows=torch.tensor([0]),
        seq_lens=torch.tensor([n]),
    )
    for top_k in (1, 2, 7, 64, 499, 500, 600):
        want = indexer_topk_oracle(**case, top_k=top_k, scale=1.0)
        assert torch.equal(indexer_topk(**case, top_k=top_k, scale=1.0, impl="numba"), want)


def test_auto_sends_few_queries_and_short_contexts_to_the_compiled_loop(monkeypatch):
    """Decode and verify queries go to the compiled loop, and so does a prefill whose queries see at
    most ``prefill_context`` positions; a longer prefill goes to the matmuls. The oracle's selection
    every way."""
    module = importlib.import_module("kernels.indexer_topk")
    calls = []
    compiled = indexer_topk_numba.indexer_topk_numba
    monkeypatch.setattr(
        indexer_topk_numba,
        "indexer_topk_numba",
        lambda q, *a: calls.append(("numba", q.shape[0])) or compiled(q, *a),
    )
    request = module._request_topk
    monkeypatch.setattr(
        module, "_request_topk", lambda q, *a: calls.append(("matmul", q.shape[0])) or request(q, *a)
    )
    heads, dim = 2, 4
    monkeypatch.setattr(indexer_topk_numba, "PREFILL_DOTS", 30 * heads * dim)  # prefill_context: 30
    assert indexer_topk_numba.prefill_context(heads, dim) == 30
    many = MATMUL_MIN_QUERIES + 3
    # a prefill of one request (row 0) beside three decode queries and a two-step verify
    case = make_case(
        2,
        tokens=many + 5,
        n_reqs=4,
        heads=heads,
        dim=dim,
        max_ctx=40,
        lens=[*range(30, 30 + many), 7, 40, 12, 13, 8],
    )
    case["req_rows"] = torch.tensor([0] * many + [1, 2, 3, 3, 1])
    case["req_to_token"] = torch.randint(
        0, case["index_k"].shape[0], (4, 40), generator=torch.Generator().manual_seed(0)
    )
    want = indexer_topk_oracle(**case, top_k=9, scale=0.5)
    assert torch.equal(indexer_topk(**case, top_k=9, scale=0.5), want)
    assert calls == [("numba", 5), ("matmul", many)]  # the prefill's last queries see 31 and more
    calls.clear()
    short = {**case, "seq_lens": torch.tensor([*range(20, 20 + many), 7, 30, 12, 13, 8])}
    assert torch.equal(
        indexer_topk(**short, top_k=9, scale=0.5), indexer_topk_oracle(**short, top_k=9, scale=0.5)
    )
    assert calls == [("numba", many + 5)]  # every query sees 30 or fewer: one compiled call
    calls.clear()
    # two prefills, a short one (row 0) and a long one (row 2): each where its context sends it
    mixed = {
        **case,
        "req_rows": torch.tensor([0] * many + [2] * 5),
        "seq_lens": torch.tensor([*range(10, 10 + many), 36, 37, 38, 39, 40]),
    }
    got = indexer_topk(**mixed, top_k=9, scale=0.5)
    assert torch.equal(got, indexer_topk_oracle(**mixed, top_k=9, scale=0.5))
    assert calls == [("numba", many + 5)]  # the long one has only 5 queries: few, compiled too
    calls.clear()
    mixed["req_rows"] = torch.tensor([0] * 5 + [2] * many)
    mixed["seq_lens"] = torch.tensor([3, 4, 5, 6, 7, *range(40 - many + 1, 41)])
    got = indexer_topk(**mixed, top_k=9, scale=0.5)
    assert torch.equal(got, indexer_topk_oracle(**mixed, top_k=9, scale=0.5))
    assert calls == [("numba", 5), ("matmul", many)]
    calls.clear()
    decode = {**case, **{k: case[k][many:] for k in ("index_q", "index_w", "req_rows", "seq_lens")}}
    indexer_topk(**decode, top_k=9, scale=0.5)  # decode and verify only: one compiled call
    indexer_topk(
        **{k: v[:1] if k in ("index_q", "index_w", "req_rows", "seq_lens") else v for k, v in case.items()},
        top_k=9,
        scale=0.5,
    )  # a batch of one
    half = {
        **case,
        "index_q": case["index_q"].half(),
        "index_w": case["index_w"].half(),
        "index_k": case["index_k"].half(),
    }
    indexer_topk(**half, top_k=9, scale=0.5)  # float16: the torch path
    assert calls == [("numba", 5), ("numba", 1), ("matmul", many)]
    with pytest.raises(ValueError, match="numba"):
        indexer_topk(**half, top_k=9, scale=0.5, impl="numba")


@pytest.mark.parametrize("impl", IMPLS)
def test_all_ties_pick_lowest_positions_and_pad(impl):
    case = make_case(1, lens=[0, 3, 17, 40], zero_weights=True)  # every score is exactly 0
    got = indexer_topk(**case, top_k=8, scale=1.0, impl=impl)
    assert got.tolist() == [[-1] * 8, [0, 1, 2] + [-1] * 5, list(range(8)), list(range(8))]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_many_exact_ties_follow_contract(impl, dtype):
    if impl == "numba" and dtype == torch.float16:
        dtype = torch.float64  # the compiled loop reads float32/64 only
    # integer inputs give exact, heavily tied scores in every implementation
    case = make_case(5, tokens=4, lens=[40, 39, 12, 1], dtype=dtype)
    got = indexer_topk(**case, top_k=16, scale=0.5, impl=impl)
    assert torch.equal(got, dense_oracle(case, 16, 0.5))


@pytest.mark.interpreter
@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    top_k=st.integers(1, 40),
    heads=st.integers(1, 5),
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
def test_triton_equals_reference_on_exact_inputs(seed, top_k, heads, dtype):
    case = make_case(seed, heads=heads, dtype=dtype)
    ref = indexer_topk(**case, top_k=top_k, scale=0.25, impl="torch")
    tri = indexer_topk(**case, top_k=top_k, scale=0.25, impl="triton")
    assert torch.equal(tri, ref)


@pytest.mark.interpreter
def test_triton_scores_close_on_random_inputs():
    from kernels.indexer_topk_triton import indexer_scores_triton

    case = make_case(9, tokens=3, heads=4, dim=16, integer=False, lens=[40, 25, 7])
    ref = indexer_scores_reference(**case, scale=0.3, max_len=40)
    tri = indexer_scores_triton(**case, scale=0.3, max_len=40)
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)
    assert torch.isinf(tri[2, 7:]).all()


@pytest.mark.interpreter
def test_triton_selection_ties_negative_zero_with_zero():
    from kernels.indexer_topk_triton import select_topk_triton

    scores = torch.tensor(
        [
            [
                0.0,
                -0.0,
                1.0,
                -0.0,
                0.0,
                -1.0,
                -0.5,
                2.0,
                0.0,
                -2.0,
                0.0,
                0.0,
                3.0,
                0.0,
                -0.0,
                0.0,
                5.0,
                -0.0,
                0.0,
                0.5,
            ]
        ]
    )
    lens = torch.tensor([19])
    want = stable_topk_positions(scores[:, :19], 20)
    assert torch.equal(select_topk_triton(scores, lens, 20), want)


def test_wrapper_rejects_bad_arguments():
    case = make_case(0)
    for name, bad in [
        ("index_q", case["index_q"][0]),
        ("index_w", case["index_w"][:, :1]),
        ("index_k", case["index_k"][:, :3]),
        ("req_rows", case["req_rows"].int()),
        ("seq_lens", case["seq_lens"][:2]),
        ("req_to_token", case["req_to_token"].float()),
    ]:
        with pytest.raises(ValueError, match=name):
            indexer_topk(**{**case, name: bad}, top_k=4, scale=1.0, impl="torch")
    with pytest.raises(ValueError, match="top_k"):
        indexer_topk(**case, top_k=0, scale=1.0)
    with pytest.raises(ValueError, match="impl"):
        indexer_topk(**case, top_k=4, scale=1.0, impl="fast")


def test_wrapper_validates_the_values_the_kernel_trusts():
    """``validate=True``: request rows inside ``req_to_token`` and lengths within its positions; a
    ``max_seq_len`` past its positions is refused always (no synchronisation needed)."""
    case = make_case(0)
    rows, max_ctx = case["req_to_token"].shape
    indexer_topk(**case, top_k=4, scale=1.0, validate=True)  # a valid case passes
    for name, bad in [
        ("req_rows", torch.full_like(case["req_rows"], rows)),
        ("seq_lens", torch.full_like(case["seq_lens"], max_ctx + 1)),
        ("seq_lens", torch.full_like(case["seq_lens"], -1)),
    ]:
        with pytest.raises(ValueError, match=name):
            indexer_topk(**{**case, name: bad}, top_k=4, scale=1.0, validate=True)
    with pytest.raises(ValueError, match="max_seq_len"):
        indexer_topk(**case, top_k=4, scale=1.0, max_seq_len=max_ctx + 1)


# --- canaries around every buffer the Triton kernels touch, and the wrapper's layout checks ---------


def _fill(kind: str):
    """Canary contents: NaN, or huge values of either sign (a read would swamp every score)."""
    g = torch.Generator().manual_seed(17)
    if kind == "nan":
        return lambda shape, dtype: torch.full(shape, float("nan"), dtype=dtype)
    sign = 1.0 if kind == "big" else -1.0
    return lambda shape, dtype: (sign * BIG * (torch.randn(shape, generator=g).abs() + 1)).to(dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize(("fill", "max_seq_len"), [("nan", None), ("big", 20), ("-big", None)])
def test_triton_touches_nothing_outside_its_buffers(fill, max_seq_len, monkeypatch):
    """Every input is a view with canary rows before and after it and canary columns beside it
    (queries and weights: an extra head and extra dims; keys: extra dims and rows at locations -1
    and past the end; req_to_token: -1, i.e. a canary key row, in its padding and at every position
    no query sees), and both outputs (the score scratch and the top-k) sit inside flat sentinels.
    The result equals the dense oracle, every output element is written, nothing outside the
    outputs is, and no input changes."""
    from _kernel_canary import CanaryOutputs, assert_unchanged, embed, snapshot

    import kernels.indexer_topk_triton as triton_module

    max_ctx, top_k = 20, 8
    case = make_case(11, tokens=4, heads=3, dim=5, n_reqs=3, max_ctx=max_ctx, rows=30, lens=[17, 13, 7, 0])
    r2t = case["req_to_token"]
    for row in range(r2t.shape[0]):  # positions no query of the row sees: a read lands on a canary
        mine = case["seq_lens"][case["req_rows"] == row]
        r2t[row, int(mine.max()) if mine.numel() else 0 :] = -1
    want = dense_oracle(case, top_k, 0.5)
    f = _fill(fill)
    args = dict(
        index_q=embed(case["index_q"], (CANARY, 1, 3), f, lead=CANARY),
        index_w=embed(case["index_w"], (CANARY, 2), f, lead=CANARY),
        index_k=embed(case["index_k"], (CANARY, 4), f, lead=CANARY),
        req_to_token=embed(r2t, (CANARY, 5), -1, lead=CANARY),
        req_rows=embed(case["req_rows"], (CANARY,), -1, lead=CANARY),
        seq_lens=embed(case["seq_lens"], (CANARY,), max_ctx, lead=CANARY),
    )
    assert args["index_k"].stride(0) == 5 + 4 and args["req_to_token"].stride(0) == max_ctx + 5
    before = snapshot(args)
    outputs = CanaryOutputs()
    monkeypatch.setattr(triton_module, "torch", outputs.proxy)
    got = indexer_topk(**args, top_k=top_k, scale=0.5, impl="triton", max_seq_len=max_seq_len)
    outputs.check()
    assert len(outputs.allocated) == 2, "a score scratch and the top-k"
    assert torch.equal(got, want)
    assert torch.equal(indexer_topk(**args, top_k=top_k, scale=0.5, impl="torch"), want)
    assert_unchanged(args, before)


# (argument, what is wrong, how to break it, what the message says)
INDEXER_LAYOUT = [
    ("index_q", "stride", strided_last, "must be contiguous in its last dim"),
    ("index_q", "dtype", lambda x: x.long(), "must have dtype"),
    ("index_q", "shape", lambda x: x[0], "must have 3 dims"),
    ("index_w", "stride", strided_last, "must be contiguous in its last dim"),
    ("index_w", "dtype", lambda x: x.int(), "must have dtype"),
    ("index_w", "shape", lambda x: x[:, :1], "must have shape"),
    ("index_k", "stride", strided_last, "must be contiguous in its last dim"),
    ("index_k", "dtype", lambda x: x.long(), "must have dtype"),
    ("index_k", "shape", lambda x: x[:, :3], "must have shape"),
    ("req_to_token", "stride", strided_last, "must be contiguous in its last dim"),
    ("req_to_token", "dtype", lambda x: x.float(), "must have dtype"),
    ("req_to_token", "shape", lambda x: x[0], "must have 2 dims"),
    # a strided 1-D req_rows / seq_lens used to pass and the Triton kernel read them with stride 1
    ("req_rows", "stride", strided_last, "must be contiguous in its last dim"),
    ("req_rows", "dtype", lambda x: x.int(), "must have dtype"),
    ("req_rows", "shape", lambda x: x[:2], "must have shape"),
    ("seq_lens", "stride", strided_last, "must be contiguous in its last dim"),
    ("seq_lens", "dtype", lambda x: x.int(), "must have dtype"),
    ("seq_lens", "shape", lambda x: torch.cat([x, x[:1]]), "must have shape"),
]


@pytest.mark.parametrize(
    ("name", "kind", "breaks", "says"), INDEXER_LAYOUT, ids=[f"{r[0]}-{r[1]}" for r in INDEXER_LAYOUT]
)
@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_wrapper_rejects_a_bad_layout_naming_the_argument(name, kind, breaks, says, impl):
    """Checked before any launch (so no kernel runs here): a non-contiguous last dim, a wrong dtype,
    a mismatched shape each raise a ValueError that starts with the argument's name."""
    case = make_case(0, lens=[5, 9, 0, 40])
    bad = breaks(case[name])
    if kind == "stride":
        assert torch.equal(bad, case[name]), "the same values, only the layout differs"
    with pytest.raises(ValueError, match=rf"^{name} {says}"):
        indexer_topk(**{**case, name: bad}, top_k=4, scale=1.0, impl=impl)


def test_warm_up_compiles_the_loops_of_a_cpu_run_and_nothing_elsewhere(monkeypatch):
    import kernels
    from kernels import swap_in_numba

    narrow = dict(index_heads=4, index_dim=32)
    kernels.warm_up(torch.device("cpu"), torch.float64, **narrow, swap_in=True)
    assert any(sig[0].dtype.name == "float64" for sig in indexer_topk_numba._kernel.signatures)
    called = []
    monkeypatch.setattr(indexer_topk_numba, "warm_up", called.append)
    monkeypatch.setattr(swap_in_numba, "warm_up", lambda: called.append("swap_in"))
    kernels.warm_up(torch.device("cuda"), torch.float32, **narrow, swap_in=True)  # not a CPU run: nothing
    kernels.warm_up("cpu", torch.bfloat16, **narrow, swap_in=False)  # the loop skips bfloat16 itself
    kernels.warm_up(
        "cpu", torch.float32, index_heads=64, index_dim=128, swap_in=True
    )  # auto keeps it on torch
    assert called == [torch.bfloat16, "swap_in"]


def test_auto_keeps_wide_indexers_on_the_torch_path(monkeypatch):
    # past MAX_HEAD_DIMS head x dim products per key BLAS does the dots faster than the loop
    calls = []
    compiled = indexer_topk_numba.indexer_topk_numba
    monkeypatch.setattr(
        indexer_topk_numba, "indexer_topk_numba", lambda q, *a: calls.append(q.shape) or compiled(q, *a)
    )
    narrow = make_case(3, tokens=4, n_reqs=4, heads=4, dim=8)
    wide_dim = indexer_topk_numba.MAX_HEAD_DIMS // 4 + 1
    wide = make_case(3, tokens=4, n_reqs=4, heads=4, dim=wide_dim)
    for case in (narrow, wide):
        assert torch.equal(
            indexer_topk(**case, top_k=6, scale=0.5), indexer_topk_oracle(**case, top_k=6, scale=0.5)
        )
    assert calls == [(4, 4, 8)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_nan_score_is_never_selected(impl, dtype):
    """Non-finite keys (a NaN weight upstream) give NaN scores: they are never selected, as ``-inf``,
    and every position is one the query sees or -1 (a NaN once broke the compiled loop's ranking and
    left a rank unwritten: a garbage position that read far out of bounds)."""
    if impl == "triton" and dtype == torch.float64:
        dtype = torch.float32  # the Triton kernels read float32 and narrower
    case = make_case(7, tokens=4, lens=[40, 33, 20, 5], dtype=dtype, integer=False)
    keys = case["index_k"]
    poisoned = case["req_to_token"][case["req_rows"][0], [0, 3, 4, 9, 30]]
    keys[poisoned] = float("nan")
    got = indexer_topk(**case, top_k=16, scale=0.5, impl=impl)
    lens = case["seq_lens"].tolist()
    for t in range(got.shape[0]):
        row = got[t].tolist()
        seen = [p for p in row if p >= 0]
        assert all(p < lens[t] for p in seen) and len(set(seen)) == len(seen)
        visible = case["req_to_token"][case["req_rows"][t], : lens[t]]
        bad = {s for s in range(lens[t]) if bool(torch.isnan(keys[visible[s]]).any())}
        assert not bad & set(seen), f"query {t} selected a NaN-scored position"
        assert len(seen) == min(16, lens[t] - len(bad))
