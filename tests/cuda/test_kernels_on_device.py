"""Every kernel on the device against its torch reference, in float32 and bfloat16, at sizes up to
DeepSeek-V3.2's (top-k 2,048, HOT 4,096; ``sizes``).

Each op runs as the engine calls it on the device (``impl="auto"``: the Triton kernel where the
shapes fit it, the torch path where they do not) and is compared with its torch reference: the
swap-in (against the reference on the CPU) and the row copies exactly (results, every mutated
table, canaries), the indexer's selection exactly on inputs whose scores are exact (small
integers), sparse MLA to the dtype's rounding against the reference in float64 on the device.
On CUDA the host KV pool of the swap-in and of the copies lives in pinned host memory, as the
engine keeps it (the row-copy kernel then addresses it directly), or on the device. Sparse MLA and
the indexer also read FP8 caches (``uint8`` rows in ``kernels.kv_fp8``'s layout), and the copies
move such rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _device_sizes import KernelCase, Sizes

from kernels import kv_copy, kv_fp8
from kernels.indexer_topk import indexer_topk
from kernels.kv_copy import backup_rows, copy_rows, load_rows
from kernels.sparse_mla import sparse_mla, sparse_mla_reference
from kernels.swap_in import swap_in
from kernels.swap_in_policy import DEFAULT_POLICY

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel_ops"))
from _swap_in_world import World, assert_canaries, assert_same, build_world

pytestmark = pytest.mark.cuda

DTYPES = [torch.float32, torch.bfloat16]


def _rows(count: int, dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(count, dim, generator=gen).to(dtype)


def _world(case: KernelCase, dim: int, dtype: torch.dtype, seed: int) -> World:
    """A swap-in world of ``case``'s sizes whose KV rows are random ``dim``-wide rows of ``dtype``."""
    world = build_world(seed, num_reqs=case.requests, num_steps=case.steps, top_k=case.top_k, hot=case.hot,
                        extra=case.extra, dim=1, p_pad=0.1, p_no_host=0.0)
    gen = torch.Generator().manual_seed(seed)
    world.host_full = _rows(world.host_full.shape[0], dim, dtype, gen)
    world.device_full = _rows(world.device_full.shape[0], dim, dtype, gen)
    return world


def _loading_world(case: KernelCase, dim: int, dtype: torch.dtype) -> World:
    """The first world of ``case`` (seed by seed) whose swap-in loads rows: misses and evictions."""
    for seed in range(100):
        world = _world(case, dim, dtype, seed)
        if int(swap_in(*world.clone().args(), impl="torch", policy=DEFAULT_POLICY).misses.sum()) > 0:
            return world
    raise AssertionError(f"no world of {case.id} misses")


def _on(world: World, device: torch.device, host: str) -> World:
    moved = world.clone()
    for name in ("top_k_pos", "seq_lens", "req_rows", "buffer_tokens", "buffer_locs", "lru", "req_to_host",
                 "device_full"):
        setattr(moved, name, getattr(moved, name).to(device))  # (the clone's: on a CPU .to keeps it)
    moved.host_full = moved.host_full.pin_memory() if host == "pinned" else moved.host_full.to(device)
    return moved


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swap_in_equals_reference(device, sizes, swap_case, dtype, host, monkeypatch):
    """(``swap_case`` and ``host`` are parametrized by the conftest, from the sizes and the device.)
    From pinned host memory the row-copy kernel loads the rows, driven by the plan on the device:
    the CPU path of the plan must not run."""
    case = swap_case
    ref_world = _loading_world(case, sizes.row_dim, dtype)
    world = _on(ref_world, device, host)
    before = world.clone()
    if host == "pinned":
        from kernels import swap_in_triton

        def refused(*args) -> None:
            why = kv_copy.host_launch_failure()
            raise AssertionError(f"the swap-in's host loads went through the CPU ({why})")

        monkeypatch.setattr(swap_in_triton, "_run_plan_through_host", refused)
    got = swap_in(*world.args(), impl="auto", policy=DEFAULT_POLICY, validate=True)
    want = swap_in(*ref_world.args(), impl="torch", policy=DEFAULT_POLICY, validate=True)
    assert_same(world, got, ref_world, want, f"{case.id} {dtype} host on {host}")
    assert_canaries(before, world)
    assert int(want.misses.sum()) > 0, "the case must load rows"


def _index_case(sizes: Sizes, dtype: torch.dtype, device: torch.device, queries: list[tuple[int, int]],
                seed: int) -> dict[str, torch.Tensor]:
    """Integer-valued queries, weights and keys (every score exact in float32); ``queries`` lists
    (request row, visible positions). Each request's positions have distinct key slots."""
    g = torch.Generator().manual_seed(seed)
    n_reqs, ctx = 1 + max(r for r, _ in queries), sizes.index_context
    rows = n_reqs * ctx + 7

    def ints(*shape: int) -> torch.Tensor:
        return torch.randint(-2, 3, shape, generator=g).to(dtype)

    return dict(
        index_q=ints(len(queries), sizes.index_heads, sizes.index_dim).to(device),
        index_w=ints(len(queries), sizes.index_heads).to(device),
        index_k=ints(rows, sizes.index_dim).to(device),
        req_to_token=torch.randperm(rows, generator=g)[: n_reqs * ctx].view(n_reqs, ctx).to(device),
        req_rows=torch.tensor([r for r, _ in queries], dtype=torch.int64, device=device),
        seq_lens=torch.tensor([n for _, n in queries], dtype=torch.int64, device=device),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ["decode", "verify", "prefill"])
def test_indexer_topk_equals_reference(device, sizes, dtype, shape):
    ctx, k = sizes.index_context, sizes.index_top_k
    if shape == "decode":  # one query per request, contexts past top-k (and one shorter than it)
        queries = [(0, ctx), (1, ctx - 5), (2, k // 2)]
    elif shape == "verify":  # 4 consecutive queries of one request, one of another
        queries = [(0, ctx - 3 + i) for i in range(4)] + [(1, k + 1)]
    else:  # a prefill chunk: many queries of one request
        queries = [(0, n) for n in range(ctx - 40, ctx)]
    case = _index_case(sizes, dtype, device, queries, seed=len(queries))
    got = indexer_topk(**case, top_k=k, scale=0.5, impl="auto", validate=True)
    want = indexer_topk(**case, top_k=k, scale=0.5, impl="torch")
    assert got.device == device
    assert torch.equal(got.cpu(), want.cpu())
    valid = (want >= 0).sum(dim=1).cpu()
    assert valid.tolist() == [min(k, n) for _, n in queries]  # every visible position up to top-k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("queries", [1, 4, 33])
def test_sparse_mla_equals_reference(device, sizes, dtype, queries):
    g = torch.Generator().manual_seed(queries)
    rows, k = 3 * sizes.mla_top_k, sizes.mla_top_k
    slots = torch.stack([torch.randperm(rows, generator=g)[:k] for _ in range(queries)])
    slots[torch.rand(queries, k, generator=g) < 0.1] = -1
    slots[0, 1:] = -1  # a query with one row
    if queries > 1:
        slots[1] = -1  # and one with none (its output is zero)
    q_latent = torch.randn(queries, sizes.heads, sizes.latent, generator=g)
    q_rope = torch.randn(queries, sizes.heads, sizes.rope, generator=g)
    kv = torch.randn(rows, sizes.latent + sizes.rope, generator=g)
    scale = (sizes.latent + sizes.rope) ** -0.5
    args = [t.to(dtype) for t in (q_latent, q_rope, kv)]
    got = sparse_mla(*[t.to(device) for t in args], slots.to(device), scale, impl="auto", validate=True)
    want = sparse_mla_reference(*[t.double().to(device) for t in args], slots.to(device), scale).cpu()
    assert got.dtype == dtype and got.device == device
    tol = 2e-3 if dtype == torch.float32 else 3e-2  # float32: TF32 products allowed
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)
    if queries > 1:
        assert not got[1].any()


def _copy_case(sizes: Sizes, kind: str) -> tuple[torch.dtype, int]:
    """(element type, row width): float rows, or FP8 rows as the engine stores them (bytes)."""
    if kind == "fp8":
        return kv_fp8.STORAGE, kv_fp8.row_bytes(sizes.latent, sizes.rope)
    return getattr(torch, kind), sizes.row_dim


def _random_pool(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    return torch.randn(shape, generator=gen).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality."""
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("layered", [False, True], ids=["one-layer", "all-layers"])
def test_kv_copy_equals_reference(device, sizes, kind, layered):
    dtype, dim = _copy_case(sizes, kind)
    g = torch.Generator().manual_seed(3)
    rows, n = 4 * sizes.hot, sizes.hot
    shape = (sizes.layers, rows, dim) if layered else (rows, dim)
    dst, src = _random_pool(shape, dtype, g), _random_pool(shape, dtype, g)
    dst_idx = torch.randperm(rows, generator=g)[:n]
    src_idx = torch.randint(0, rows, (n,), generator=g)  # a source row may be read twice
    want = dst.clone()
    want[..., dst_idx, :] = src[..., src_idx, :]

    # device -> device (the Triton kernel on CUDA)
    on_dst, on_src = dst.to(device), src.to(device)
    copy_rows(on_dst, dst_idx.to(device), on_src, src_idx.to(device), impl="auto")
    assert _same(on_dst, want) and _same(on_src, src)

    # host -> device and device -> host (pinned host memory on CUDA)
    host_src = src.pin_memory() if device.type == "cuda" else src.clone()
    on_dst = dst.to(device)
    load_rows(on_dst, dst_idx.to(device), host_src, src_idx)
    assert _same(on_dst, want)
    host_dst = dst.pin_memory() if device.type == "cuda" else dst.clone()
    backup_rows(host_dst, dst_idx, src.to(device), src_idx.to(device))
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert _same(host_dst, want)



@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sparse_mla_reads_an_fp8_cache(device, sizes, dtype):
    """FP8 rows (``uint8``, V3.2's layout) as the device path reads them, against the reference over
    the same rows dequantized, in float64."""
    g = torch.Generator().manual_seed(5)
    queries, rows, k = 4, 2 * sizes.mla_top_k, sizes.mla_top_k
    slots = torch.stack([torch.randperm(rows, generator=g)[:k] for _ in range(queries)])
    slots[torch.rand(queries, k, generator=g) < 0.1] = -1
    q_latent = torch.randn(queries, sizes.heads, sizes.latent, generator=g).to(dtype)
    q_rope = torch.randn(queries, sizes.heads, sizes.rope, generator=g).to(dtype)
    stored = kv_fp8.quantize_rows(torch.randn(rows, sizes.latent + sizes.rope, generator=g), sizes.latent)
    assert stored.shape[1] == kv_fp8.row_bytes(sizes.latent, sizes.rope)
    scale = (sizes.latent + sizes.rope) ** -0.5
    got = sparse_mla(q_latent.to(device), q_rope.to(device), stored.to(device), slots.to(device), scale,
                     impl="auto", validate=True)
    rows64 = kv_fp8.dequantize_rows(stored, sizes.latent, torch.float64)
    q64 = [t.double().to(device) for t in (q_latent, q_rope)]
    want = sparse_mla_reference(*q64, rows64.to(device), slots.to(device), scale).cpu()
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_indexer_topk_reads_an_fp8_cache(device, sizes, dtype):
    """FP8 keys whose every value e4m3 holds exactly (multiples of 1/4 up to 7/4, each key's largest
    7/4, so its scale is 1/256): the device path selects what the reference selects over the same
    keys dequantized, exactly."""
    ctx, k = sizes.index_context, sizes.index_top_k
    queries = [(0, ctx), (1, ctx - 7), (1, ctx - 6), (2, k // 2)]
    case = _index_case(sizes, dtype, torch.device("cpu"), queries, seed=11)
    g = torch.Generator().manual_seed(12)
    values = torch.tensor([0.0, 0.5, -0.5, 1.0, -1.0, 1.75, -1.75])
    keys = values[torch.randint(0, len(values), case["index_k"].shape, generator=g)]
    keys[:, 0] = 1.75
    stored = kv_fp8.quantize_keys(keys)
    assert torch.equal(kv_fp8.dequantize_keys(stored, torch.float32), keys)
    on = {name: t.to(device) for name, t in case.items() if name != "index_k"}
    got = indexer_topk(**on, index_k=stored.to(device), top_k=k, scale=0.5, impl="auto", validate=True)
    want = indexer_topk(**{**case, "index_k": keys.to(dtype)}, top_k=k, scale=0.5, impl="torch")
    assert torch.equal(got.cpu(), want)
