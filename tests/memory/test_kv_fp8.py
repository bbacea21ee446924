"""The FP8 KV cache (``kv_cache_dtype="fp8_e4m3"``): V3.2's row layouts, the round trip against a
float64 reference within FP8's error, the kernels reading FP8 pools as they read the dequantized
rows, and engines over FP8 pools: HiSparse == resident exactly (the same bytes are read either
way), with speculation and the prefix cache, every pool restored."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import attrs
import pytest
import torch

from kernels import kv_fp8
from kernels.indexer_topk import indexer_topk
from kernels.sparse_mla import sparse_mla, sparse_mla_reference
from pipeline.capacity import ModelDims, kv_format
from pipeline.config import HiSparseConfig
from pipeline.driver import SyncDriver
from pipeline.errors import ConfigError
from pipeline.executor import Executor
from pipeline.sampling import SamplingParams

from tiny_models import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from _reliability_util import HOT, small_config

E4M3_HALF_ULP = 2.0**-4  # e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # its subnormals are 2^-9 apart (in units of the scale)
BF16_HALF_ULP = 2.0**-8


def rows_of(n: int, latent: int, rope: int, seed: int = 0) -> torch.Tensor:
    """Rows whose tiles differ in magnitude by orders (one scale per tile must follow them)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, latent + rope, generator=gen, dtype=torch.float64)
    tiles = torch.logspace(-3, 2, steps=-(-latent // kv_fp8.TILE), dtype=torch.float64)
    x[:, :latent] *= tiles.repeat_interleave(kv_fp8.TILE)[:latent]
    x[0, :latent] = 0.0  # an all-zero row: scale 1, values 0
    return x


def test_v32_rows_and_keys_are_656_and_132_bytes():
    assert kv_fp8.row_bytes(512, 64) == 656
    assert kv_fp8.key_bytes(128) == 132
    fmt = kv_fp8.KVCacheFormat(latent=512, rope=64, index_dim=128, dtype=torch.bfloat16, kind="fp8_e4m3")
    assert (fmt.row_bytes, fmt.key_bytes, fmt.storage_dtype) == (656, 132, torch.uint8)
    plain = kv_fp8.KVCacheFormat(latent=512, rope=64, index_dim=128, dtype=torch.bfloat16)
    assert (plain.row_bytes, plain.key_bytes, plain.storage_dtype) == (1152, 256, torch.bfloat16)


@pytest.mark.parametrize("latent,rope", [(512, 64), (32, 16), (200, 8)])
def test_row_round_trip_is_within_fp8_error(latent, rope):
    x = rows_of(64, latent, rope)
    stored = kv_fp8.quantize_rows(x, latent)
    assert stored.dtype == torch.uint8 and stored.shape == (64, kv_fp8.row_bytes(latent, rope))
    back = kv_fp8.dequantize_rows(stored, latent, torch.float64)
    tiles = -(-latent // kv_fp8.TILE)
    scales = stored[:, latent : latent + 4 * tiles].contiguous().view(torch.float32).double()
    # the layout: one float32 scale per tile, its largest magnitude over 448 (1 for a zero tile)
    for t in range(tiles):
        part = x[:, t * kv_fp8.TILE : min(latent, (t + 1) * kv_fp8.TILE)]
        amax = part.float().abs().amax(dim=1)  # (float32, as stored)
        want = torch.where(amax > 0, amax / kv_fp8.E4M3_MAX, torch.ones_like(amax))
        assert torch.equal(scales[:, t], want.double())
    per_value = scales.repeat_interleave(kv_fp8.TILE, dim=1)[:, :latent]
    bound = torch.maximum(x[:, :latent].abs() * E4M3_HALF_ULP, per_value * E4M3_SUBNORMAL_HALF_STEP)
    assert bool(((back[:, :latent] - x[:, :latent]).abs() <= bound * (1 + 1e-6)).all())
    assert bool((back[0, :latent] == 0).all())
    rope_err = (back[:, latent:] - x[:, latent:]).abs()
    assert bool((rope_err <= x[:, latent:].abs() * BF16_HALF_ULP).all())  # the rope part is bfloat16
    # the stored rope bytes are exactly the bfloat16 values
    rope_bytes = stored[:, latent + 4 * tiles :].contiguous().view(torch.bfloat16)
    assert torch.equal(rope_bytes, x[:, latent:].to(torch.bfloat16))


def test_key_round_trip_is_within_fp8_error():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(50, 128, generator=gen, dtype=torch.float64) * 7
    stored = kv_fp8.quantize_keys(keys)
    assert stored.shape == (50, 132)
    back = kv_fp8.dequantize_keys(stored, torch.float64)
    scale = (keys.float().abs().amax(dim=1, keepdim=True) / kv_fp8.E4M3_MAX).double()
    bound = torch.maximum(keys.abs() * E4M3_HALF_ULP, scale * E4M3_SUBNORMAL_HALF_STEP)
    assert bool(((back - keys).abs() <= bound * (1 + 1e-6)).all())


def test_the_same_bytes_always_read_back_the_same():
    x = rows_of(8, 32, 16, seed=5)
    a, b = kv_fp8.quantize_rows(x, 32), kv_fp8.quantize_rows(x.float(), 32)
    assert torch.equal(a, b)
    read = [kv_fp8.dequantize_rows(stored, 32, torch.float32) for stored in (a, b)]
    assert torch.equal(*read)


def test_a_pool_that_does_not_match_its_format_is_refused():
    fmt = kv_fp8.KVCacheFormat(latent=32, rope=16, index_dim=16, dtype=torch.float32, kind="fp8_e4m3")
    where = torch.tensor([1])
    with pytest.raises(TypeError):
        kv_fp8.store_rows(fmt, torch.zeros(4, 48), where, torch.ones(1, 48))
    with pytest.raises(TypeError):
        kv_fp8.store_rows(None, torch.zeros(4, fmt.row_width, dtype=torch.uint8), where, torch.ones(1, 48))
    pool = torch.zeros(4, fmt.row_width, dtype=torch.uint8)
    kv_fp8.store_rows(fmt, pool, where, torch.ones(1, 48))
    assert torch.equal(pool[1], kv_fp8.quantize_rows(torch.ones(1, 48), 32)[0])
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_fp8.KVCacheFormat(latent=32, rope=16, index_dim=16, dtype=torch.float32, kind="int8")


def test_sparse_mla_reads_fp8_rows_as_their_dequantized_values():
    gen = torch.Generator().manual_seed(7)
    t, h, c, r, k, n = 5, 4, 160, 16, 12, 40
    rows = rows_of(n, c, r, seed=2).float()
    stored = kv_fp8.quantize_rows(rows, c)
    q_latent = torch.randn(t, h, c, generator=gen)
    q_rope = torch.randn(t, h, r, generator=gen)
    slots = torch.randint(0, n, (t, k), generator=gen)
    slots[0, 3:] = -1
    slots[1] = -1
    got = sparse_mla(q_latent, q_rope, stored, slots, 0.1)
    rows_read = kv_fp8.dequantize_rows(stored, c, torch.float32)
    want = sparse_mla_reference(q_latent, q_rope, rows_read, slots, 0.1)
    assert torch.equal(got, want)
    assert bool((got[1] == 0).all())
    with pytest.raises(ValueError, match="kv"):
        sparse_mla(q_latent, q_rope, stored[:, :-1].contiguous(), slots, 0.1)


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_indexer_reads_fp8_keys_as_their_dequantized_values(impl):
    gen = torch.Generator().manual_seed(11)
    heads, dim, locs, top_k = 4, 32, 64, 6
    keys = torch.randn(locs, dim, generator=gen)
    stored = kv_fp8.quantize_keys(keys)
    table = torch.randperm(locs, generator=gen)[:48].view(3, 16)
    rows = torch.tensor([0, 0, 2, 1, 2])
    lens = torch.tensor([5, 16, 9, 1, 16])
    q = torch.randn(5, heads, dim, generator=gen)
    w = torch.randn(5, heads, generator=gen)
    got = indexer_topk(q, w, stored, table, rows, lens, top_k, 0.3, impl=impl)
    plain = kv_fp8.dequantize_keys(stored, torch.float32)
    assert torch.equal(got, indexer_topk(q, w, plain, table, rows, lens, top_k, 0.3, impl=impl))


def test_an_fp8_indexer_call_without_queries_selects_nothing():
    stored = kv_fp8.quantize_keys(torch.randn(8, 16))
    table = torch.arange(8).view(1, 8)
    none = torch.empty(0, dtype=torch.int64)
    got = indexer_topk(torch.empty(0, 2, 16), torch.empty(0, 2), stored, table, none, none, 4, 0.5)
    assert got.shape == (0, 4) and got.dtype == torch.int32


def test_the_plan_counts_the_stored_bytes():
    model = build_tiny_model(dtype=torch.float64, seed=2)
    cfg = model.cfg
    plain = ModelDims.of(cfg, "bfloat16", speculative=False)
    fp8 = ModelDims.of(cfg, "bfloat16", speculative=False, kv_cache_dtype="fp8_e4m3")
    assert plain.row_bytes == cfg.kv_row_dim * 2
    assert fp8.row_bytes == kv_fp8.row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    assert fp8.key_bytes == cfg.index_head_dim + 4
    fmt = kv_format(cfg, torch.bfloat16, "fp8_e4m3")
    assert (fmt.row_bytes, fmt.key_bytes) == (fp8.row_bytes, fp8.key_bytes)


def test_kv_cache_dtype_is_checked_at_the_call():
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        small_config(kv_cache_dtype="fp4")


# --- engines over FP8 pools ---------------------------------------------------------------------

PARAMS = SamplingParams(max_new_tokens=16, ignore_eos=True)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, HOT + 3, 3 * HOT + 1)]


def run(model, cfg, batch):
    executor = Executor(cfg, model=model)
    assert executor.memory.free_counts() == Executor(cfg, model=model).memory.free_counts()
    driver = SyncDriver(executor, check=True)
    reqs = driver.generate(batch, PARAMS)
    assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
    again = driver.generate(batch, PARAMS)  # the prefix cache's pages, read back
    assert [r.output_ids for r in again] == [r.output_ids for r in reqs]
    assert executor.pool_counts() == Executor(cfg, model=model).pool_counts()
    executor.close()
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("num_steps", [None, 3], ids=["plain", "speculative"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hisparse_equals_resident_over_fp8_pools(dtype, num_steps):
    model = build_tiny_model(dtype=getattr(torch, dtype), seed=2)
    batch = prompts()
    fp8 = {"dtype": dtype, "kv_cache_dtype": "fp8_e4m3"}
    resident = run(model, small_config(hisparse=False, num_steps=num_steps, **fp8), batch)
    hisparse = run(model, small_config(hisparse=True, num_steps=num_steps, **fp8), batch)
    assert hisparse == resident


@pytest.mark.parametrize("policy", ["lru", "near-adaptive"])
def test_fp8_chunked_prefill_draft_rows_on_the_host_and_policies_read_the_same_rows(policy):
    model = build_tiny_model(dtype=torch.float32, seed=2)
    batch = prompts()
    fp8 = {"dtype": "float32", "kv_cache_dtype": "fp8_e4m3", "chunked_prefill_tokens": 16}
    resident = run(model, small_config(hisparse=False, **fp8), batch)
    hs = HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2, policy=policy,
                        draft_rows_on_host=True, draft_keys_on_host=True)
    assert run(model, attrs.evolve(small_config(**fp8), hisparse=hs), batch) == resident


def test_fp8_pools_hold_bytes_and_count_them():
    model = build_tiny_model(dtype=torch.float32, seed=2)
    cfg = model.cfg
    executor = Executor(small_config(dtype="float32", kv_cache_dtype="fp8_e4m3", num_steps=3), model=model)
    memory = executor.memory
    width = kv_fp8.row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    assert memory.device_kv.dtype == torch.uint8 and memory.device_kv.shape[-1] == width
    assert memory.host.kv.shape[-1] == width and memory.index_k.shape[-1] == cfg.index_head_dim + 4
    assert memory.draft is not None and memory.draft.store.kv.shape[-1] == width
    assert executor.plan.device.structures[0].unit_bytes == cfg.num_hidden_layers * width
    kv = executor.stats()["kv_cache"]  # what /metrics reports
    assert (kv["dtype"], kv["row_bytes"], kv["key_bytes"]) == ("fp8_e4m3", width, cfg.index_head_dim + 4)
    assert kv["host_bytes"] == memory.host.kv.numel()
    assert kv["device_bytes"] == executor.plan.device.total_bytes
    executor.close()


def test_the_kv_cache_benchmark_reports_agreement(tmp_path, capsys):
    from pipeline.benchmarks import kv_cache

    out = tmp_path / "kv.json"
    argv = ["--prompts", "2", "--prompt-len", "48", "--new-tokens", "4", "--out", str(out)]
    assert kv_cache.main(argv) == 0
    assert "top1_agreement" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    forced, gen = payload["teacher_forced"], payload["generated"]
    assert forced["positions"] == 96 and 0 <= forced["top1_agreement"] <= 1
    assert forced["logit_abs_error_max"] >= forced["logit_abs_error_mean"] > 0  # FP8 does change them
    assert forced["kl_bf16_to_fp8_mean"] >= 0 and gen["continuations"] == 2
    assert 0 <= gen["tokens_before_first_difference"] <= 1
