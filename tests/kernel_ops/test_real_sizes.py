"""The Triton kernels at DeepSeek-V3.2's sizes (top-k 2,048, HOT up to 4,096, 64 x 128 indexer heads,
C = 512, R = 64) against their references, and which implementation a real config selects.

The interpreter runs the kernels on the CPU, slowly: each interpreter test keeps the batch small.
The swap-in's tiles are also shrunk to a few entries so that the hypothesis worlds cross tile edges
everywhere (a step's de-duplication, lookups, ranks and LRU compaction then span many tiles)."""

from __future__ import annotations

import importlib

import attrs
import pytest
import structlog
import torch
from _swap_in_world import CANARY, World, assert_canaries, assert_same, build_world, worlds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_swap_in_policy import _near_rows

import kernels.swap_in_triton as swap_in_triton
from kernels import kv_fp8
from kernels.indexer_topk import indexer_topk
from kernels.selection import AttentionShapes, log_selected, select_kernels
from kernels.sparse_mla import sparse_mla
from kernels.swap_in import swap_in
from kernels.swap_in_oracle import swap_in_oracle
from kernels.swap_in_policy import POLICIES

V32 = AttentionShapes(heads=128, latent=512, rope=64, index_heads=64, index_dim=128, top_k=2048,
                      hot=4096, extra=64, near=2048)


# --- swap-in -------------------------------------------------------------------------------------


def _decode_world(seed: int, *, num_reqs: int, hot: int, top_k: int, extra: int, ctx: int) -> World:
    """Requests past HOT (their hot columns full of distinct positions, every position with a host
    copy), and one short request on the identity layout (the fast path)."""
    g = torch.Generator().manual_seed(seed)
    width, n_rows, dim = hot + extra, num_reqs + 1, 4
    dev_slots = torch.randperm(n_rows * width + 5, generator=g)[: n_rows * width].view(n_rows, width)
    host_slots = torch.randperm(n_rows * ctx + 5, generator=g)[: n_rows * ctx].view(n_rows, ctx)
    tokens = torch.full((n_rows, width), -1, dtype=torch.int32)
    lens = torch.zeros(num_reqs, dtype=torch.int64)
    host = host_slots.clone()
    for b in range(num_reqs):
        if b == num_reqs - 1:  # short: positions 0..n-1 in their identity columns
            n = hot // 2
            tokens[b, :n] = torch.arange(n, dtype=torch.int32)
        else:
            n = ctx // 2 + int(torch.randint(0, ctx // 4, (1,), generator=g))
            tokens[b, :hot] = torch.randperm(n - extra, generator=g)[:hot].int()
            tokens[b, hot:] = torch.arange(n - extra, n, dtype=torch.int32)  # newest/draft zone
            host[b, torch.rand(ctx, generator=g) < 0.05] = -1  # no host copy: unrecoverable if selected
        lens[b] = n
    return World(
        top_k_pos=torch.empty(0),  # set per call
        seq_lens=lens,  # the current lengths until the first call
        req_rows=torch.arange(num_reqs),
        buffer_tokens=tokens,
        buffer_locs=dev_slots.clone(),
        lru=torch.stack([torch.randperm(hot, generator=g) for _ in range(n_rows)]).int(),
        req_to_host=host,
        host_full=torch.randn(n_rows * ctx + 5 + 2 * CANARY, dim, generator=g),
        device_full=torch.randn(n_rows * width + 5 + 2 * CANARY, dim, generator=g),
        hot=hot,
    )


def _next_call(world: World, g: torch.Generator, lens: torch.Tensor, steps: int, top_k: int):
    """``steps`` tokens past ``lens``: rows mixing held positions, recent ones, random ones,
    duplicates and -1; a request may pad its last step."""
    num_reqs = lens.shape[0]
    top = torch.full((num_reqs, steps, top_k), -1, dtype=torch.int32)
    seq = lens[:, None] + 1 + torch.arange(steps)
    for b in range(num_reqs):
        held = world.buffer_tokens[b][world.buffer_tokens[b] >= 0].long()
        for s in range(steps):
            n = int(seq[b, s])
            pool = torch.cat([
                held[torch.randint(0, held.numel(), (top_k,), generator=g)],
                torch.randint(0, n, (top_k,), generator=g),
                torch.randint(max(n - 3 * top_k, 0), n, (top_k,), generator=g),
            ])
            row = pool[torch.randperm(pool.numel(), generator=g)[:top_k]]
            row[torch.rand(top_k, generator=g) < 0.1] = -1
            dup = torch.rand(top_k, generator=g) < 0.1
            row[dup] = row[torch.randint(0, top_k, (top_k,), generator=g)][dup]
            top[b, s] = row.int()
    seq[-1, -1] = 0 if steps > 1 else seq[-1, -1]  # a padding step
    return top, seq


def _run_calls(hot: int, top_k: int, steps: list[int], *, policy: str = "lru", seed: int = 0):
    """Several calls in a row, the state carried over, Triton == the torch reference after each."""
    ref_world = _decode_world(seed, num_reqs=3, hot=hot, top_k=top_k, extra=64, ctx=3 * hot)
    tri_world = ref_world.clone()
    g = torch.Generator().manual_seed(seed + 1)
    lens = ref_world.seq_lens.clone()
    totals = torch.zeros(3, dtype=torch.int64)
    for s in steps:
        top, seq = _next_call(ref_world, g, lens, s, top_k)
        for w in (ref_world, tri_world):
            w.top_k_pos, w.seq_lens = top.clone(), seq.clone()
        near = _near_rows(ref_world, seed, top_k // 2) if policy in ("near", "near-adaptive") else None
        before = tri_world.clone()
        ref = swap_in(*ref_world.args(), impl="torch", policy=policy, near=near, validate=True)
        tri = swap_in(*tri_world.args(), impl="triton", policy=policy, near=near)
        assert_same(ref_world, ref, tri_world, tri, f"triton vs reference, {s} steps")
        assert_canaries(before, tri_world)
        assert ref.all_steps_done(s)
        totals += torch.stack([ref.hits.sum(), ref.misses.sum(), ref.unrecoverable.sum()]).long()
        lens = lens + s
    return totals


@pytest.mark.interpreter
def test_triton_swap_in_at_hot_2048_top_k_256_equals_the_reference():
    # decode, a verify of 3 steps (one request pads its last), decode again: hits, misses (every one
    # evicts: the hot columns are full), the newest/draft columns, the fast path
    hits, misses, lost = _run_calls(2048, 256, [1, 3, 1]).tolist()
    assert hits > 0 and misses > 0 and lost > 0


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["slide-lru", "near-adaptive"])
def test_triton_swap_in_at_hot_2048_under_other_policies(policy):
    hits, misses, _ = _run_calls(2048, 256, [2], policy=policy, seed=3).tolist()
    assert hits > 0 and misses > 0


@pytest.mark.interpreter
@pytest.mark.slow
def test_triton_swap_in_at_hot_4096_top_k_2048_equals_the_reference():
    hits, misses, _ = _run_calls(4096, 2048, [1], seed=5).tolist()
    assert hits > 0 and misses > 0


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 2 entries and 4 columns: the random worlds below span several of them."""
    monkeypatch.setattr(swap_in_triton, "TILE_K", 2)
    monkeypatch.setattr(swap_in_triton, "TILE_H", 4)


@pytest.mark.interpreter
@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    world=worlds(max_reqs=2, max_steps=3, hots=(5, 8)),
    policy=st.sampled_from(POLICIES),
    seed=st.integers(0, 2**31 - 1),
    margin=st.integers(0, 5),
)
def test_triton_swap_in_across_tile_edges_equals_the_oracle(small_tiles, world, policy, seed, margin):
    near = _near_rows(world, seed, margin)
    a, b = world.clone(), world.clone()
    expected = swap_in_oracle(*a.args(), policy=policy, near=near)
    got = swap_in(*b.args(), impl="triton", policy=policy, near=near, validate=True)
    assert_same(a, expected, b, got, f"triton (small tiles) vs oracle under {policy}")
    assert_canaries(world, b)


@pytest.mark.interpreter
def test_triton_swap_in_stops_across_tile_edges_like_the_oracle(small_tiles):
    # top_k == hot with several long steps: later steps overflow and stop the call
    stopped = 0
    for seed in (7, 12):  # worlds where some request stops before its last step
        world = build_world(seed, num_reqs=3, num_steps=3, top_k=8, hot=8, extra=3, p_pad=0.0)
        a, b = world.clone(), world.clone()
        expected = swap_in_oracle(*a.args())
        got = swap_in(*b.args(), impl="triton", validate=True)
        assert_same(a, expected, b, got, "triton (small tiles) vs oracle")
        stopped += int((expected.steps_done < 3).sum())
    assert stopped


@pytest.mark.interpreter
@pytest.mark.parametrize("policy", ["adaptive", pytest.param("near-adaptive", marks=pytest.mark.slow)])
def test_triton_adaptive_policies_see_every_recent_column_across_tiles(small_tiles, policy):
    # top_k == hot: the K most recently used columns are all of them, in several tiles, for the
    # entries of every top-k tile (seed 2 tells a kernel that skips some of them)
    for seed in (1, 2, 3):
        world = build_world(seed, num_reqs=2, num_steps=2, top_k=8, hot=8, extra=2, p_pad=0.0)
        near = _near_rows(world, seed, 3) if policy == "near-adaptive" else None
        a, b = world.clone(), world.clone()
        expected = swap_in_oracle(*a.args(), policy=policy, near=near)
        got = swap_in(*b.args(), impl="triton", policy=policy, near=near)
        assert_same(a, expected, b, got, f"triton (small tiles) vs oracle under {policy}, seed {seed}")


# --- sparse MLA and the indexer --------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_triton_sparse_mla_at_top_k_2048_c_512_r_64_equals_the_reference(dtype, tol):
    g = torch.Generator().manual_seed(0)
    tokens, heads, c, r, k, rows = 2, 16, 512, 64, 2048, 3000
    kv = torch.randn(rows, c + r, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(rows, generator=g)[:k] for _ in range(tokens)])
    slots[torch.rand(tokens, k, generator=g) < 0.1] = -1
    q_lat = torch.randn(tokens, heads, c, generator=g).to(dtype)
    q_rope = torch.randn(tokens, heads, r, generator=g).to(dtype)
    ref = sparse_mla(q_lat, q_rope, kv, slots, 0.04, impl="torch")
    tri = sparse_mla(q_lat, q_rope, kv, slots, 0.04, impl="triton", validate=True)
    torch.testing.assert_close(tri.float(), ref.float(), rtol=tol, atol=tol)


def _indexer_case(seed: int, *, heads: int, dim: int, lens: list[int]):
    """Small-integer inputs (exact scores, many ties), distinct key rows per request."""
    g = torch.Generator().manual_seed(seed)
    ctx = max(lens)
    rows = ctx + 7

    def draw(*shape):
        return torch.randint(-2, 3, shape, generator=g).float()

    tokens = len(lens)
    return dict(
        index_q=draw(tokens, heads, dim),
        index_w=draw(tokens, heads),
        index_k=draw(rows, dim),
        req_to_token=torch.stack([torch.randperm(rows, generator=g)[:ctx] for _ in range(tokens)]),
        req_rows=torch.arange(tokens),
        seq_lens=torch.tensor(lens),
    )


@pytest.mark.interpreter
@pytest.mark.slow
def test_triton_indexer_at_top_k_2048_64_heads_x_128_equals_the_reference():
    # past one selection block: 2,600 visible positions merge two blocks of 2,048; one query sees
    # fewer than top-k (padded with -1)
    case = _indexer_case(0, heads=64, dim=128, lens=[2600, 1500])
    ref = indexer_topk(**case, top_k=2048, scale=0.25, impl="torch")
    tri = indexer_topk(**case, top_k=2048, scale=0.25, impl="triton")
    assert torch.equal(tri, ref)
    assert (tri[1] == -1).sum() == 2048 - 1500


@pytest.mark.cuda
def test_cuda_kernels_at_v32_sizes_equal_the_references():
    dev = torch.device("cuda")
    case = {k: v.to(dev) for k, v in _indexer_case(1, heads=64, dim=128, lens=[33000, 40000, 900]).items()}
    ref = indexer_topk(**case, top_k=2048, scale=0.25, impl="torch")
    assert torch.equal(indexer_topk(**case, top_k=2048, scale=0.25), ref)
    ref_world = _decode_world(2, num_reqs=4, hot=4096, top_k=2048, extra=64, ctx=12288)
    g = torch.Generator().manual_seed(3)
    top, seq = _next_call(ref_world, g, ref_world.seq_lens.clone(), 2, 2048)
    ref_world.top_k_pos, ref_world.seq_lens = top, seq
    gpu = World(**{f.name: (v.to(dev) if isinstance(v := getattr(ref_world, f.name), torch.Tensor) else v)
                   for f in attrs.fields(World)})
    ref = swap_in(*ref_world.args(), impl="torch")
    got = swap_in(*gpu.args())
    assert_same(ref_world, ref, gpu, got, "cuda swap-in vs reference")


# --- which implementation runs ----------------------------------------------------------------------


def test_a_v32_config_on_cuda_selects_triton_for_every_kernel(monkeypatch):
    monkeypatch.setattr("kernels.selection.triton_available", lambda: True)
    choices = select_kernels("cuda", torch.bfloat16, V32)
    assert [(c.op, c.impl) for c in choices] == [
        ("swap_in", "triton"), ("sparse_mla", "triton"), ("indexer_topk", "triton")
    ]


def test_a_v32_config_with_an_fp8_cache_selects_the_fp8_kernels(monkeypatch):
    monkeypatch.setattr("kernels.selection.triton_available", lambda: True)
    choices = select_kernels("cuda", torch.bfloat16, V32, kv_dtype=kv_fp8.STORAGE)
    assert [(c.op, c.impl) for c in choices] == [
        ("swap_in", "triton"), ("sparse_mla", "triton-fp8"), ("indexer_topk", "triton-fp8")
    ]
    on_cpu = {c.op: c.impl for c in select_kernels("cpu", torch.float32, V32, kv_dtype=kv_fp8.STORAGE)}
    assert on_cpu["sparse_mla"] == "torch"


def test_a_fallback_names_the_limit_and_is_logged_as_a_warning(monkeypatch):
    monkeypatch.setattr("kernels.selection.triton_available", lambda: True)
    too_wide = attrs.evolve(V32, hot=1 << 20, index_heads=256)
    with structlog.testing.capture_logs() as logs:
        choices = log_selected("cuda", torch.bfloat16, too_wide)
    by_op = {c.op: c for c in choices}
    assert by_op["swap_in"].impl == "torch" and "hot" in by_op["swap_in"].reason
    assert by_op["indexer_topk"].impl == "torch" and "index heads" in by_op["indexer_topk"].reason
    assert by_op["sparse_mla"].impl == "triton"
    events = [(e["op"], e["log_level"]) for e in logs if e["event"] == "kernels.selected"]
    assert events == [("swap_in", "warning"), ("sparse_mla", "info"), ("indexer_topk", "warning")]
    monkeypatch.setattr("kernels.selection.triton_available", lambda: False)
    assert {c.impl for c in select_kernels("cuda", torch.bfloat16, V32)} == {"torch"}


class _Dispatched(Exception):
    pass


def test_the_selection_states_what_the_wrappers_decide(monkeypatch):
    """Each wrapper's fits flag (what ``resolve_impl`` gets) equals the selection's, inside and past
    every limit: tensors on the "meta" device take the wrappers past their CPU paths to the rule."""
    from kernels.selection import indexer_limits, sparse_mla_limits, swap_in_limits

    # (``kernels`` binds each op's name to its function, so the modules come from importlib)
    swap_module, mla_module, indexer_module = (
        importlib.import_module(f"kernels.{name}") for name in ("swap_in", "sparse_mla", "indexer_topk")
    )
    seen: dict[str, bool] = {}

    def spy(name):
        def resolve(impl, tensors, *, triton_fits=True):
            seen[name] = triton_fits
            raise _Dispatched

        return resolve

    for module, name in ((swap_module, "swap_in"), (mla_module, "sparse_mla"), (indexer_module, "indexer")):
        monkeypatch.setattr(module, "resolve_impl", spy(name))

    def meta(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device="meta")

    def shapes(**kw):
        base = dict(heads=2, latent=8, rope=4, index_heads=2, index_dim=8, top_k=4, hot=8, extra=64)
        return AttentionShapes(**{**base, **kw})

    for hot, top_k, extra in ((4096, 2048, 64), (swap_module.TRITON_MAX_HOT + 64, 4, 64),
                              (8192, swap_module.TRITON_MAX_TOP_K + 1, 64),
                              (64, 4, swap_module.TRITON_MAX_EXTRA + 1)):
        with pytest.raises(_Dispatched):
            top = meta(1, 1, top_k, dtype=torch.int32)
            swap_in(top, meta(1, 1), meta(1), meta(1, hot + extra), meta(1, 1), meta(1, hot), meta(1, 1),
                    meta(1, 1), meta(1, 1), hot, check=False)
        assert seen["swap_in"] == (not swap_in_limits(shapes(hot=hot, top_k=top_k, extra=extra)))
    for latent, dtype in ((512, torch.bfloat16), (mla_module.TRITON_MAX_LATENT + 16, torch.bfloat16),
                          (64, torch.float64)):
        with pytest.raises(_Dispatched):
            sparse_mla(meta(1, 2, latent, dtype=dtype), meta(1, 2, 64, dtype=dtype),
                       meta(3, latent + 64, dtype=dtype), meta(1, 4, dtype=torch.int64), 1.0, check=False)
        assert seen["sparse_mla"] == (not sparse_mla_limits(shapes(latent=latent, rope=64), dtype, dtype))
    for heads, top_k in ((64, 2048), (indexer_module.TRITON_MAX_HEADS * 2, 2048),
                         (64, indexer_module.TRITON_MAX_TOP_K + 1)):
        with pytest.raises(_Dispatched):
            indexer_topk(meta(1, heads, 128), meta(1, heads), meta(3, 128), meta(1, 3, dtype=torch.int64),
                         meta(1, dtype=torch.int64), meta(1, dtype=torch.int64), top_k, 1.0, check=False)
        shaped = shapes(index_heads=heads, index_dim=128, top_k=top_k)
        assert seen["indexer"] == (not indexer_limits(shaped, torch.float32))


def test_a_cpu_run_names_its_compiled_loops():
    choices = {c.op: c.impl for c in select_kernels("cpu", torch.float32, V32)}
    assert choices["swap_in"] == "numba"
    tiny = AttentionShapes(heads=4, latent=32, rope=8, index_heads=4, index_dim=32, top_k=16)
    assert {c.op: c.impl for c in select_kernels("cpu", torch.float32, tiny)} == {
        "sparse_mla": "numba", "indexer_topk": "numba+torch"
    }
