"""DeepSeek-V3.2's attention shapes on a CPU: HiSparse gives all-resident's greedy tokens.

A random model with V3.2's attention widths (the compressed KV row of ``kv_lora_rank`` 512 plus a
64-wide rope part, an indexer of 128-wide keys selecting 2,048 positions) and a hot region of
4,096 rows, but few heads, two layers, a tiny MLP and a small vocabulary, so that it runs on a CPU.
The longer prompt runs past 6K tokens: the indexer selects fewer positions than the request sees,
and the request sees more than its hot region holds, so swap-ins miss and evict for real. Greedy,
float32, with and without speculation; every pool back at its initial count after each run.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.sampling import SamplingParams

from tiny_models import build_tiny_model

TOP_K, HOT, PAGE = 2048, 4096, 64
V32_SHAPES = dict(
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    index_head_dim=128,
    index_topk=TOP_K,
    index_n_heads=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    qk_nope_head_dim=16,
    v_head_dim=16,
    q_lora_rank=32,
    max_position_embeddings=8192,
)
PROMPT_LENS = (6_200, 300)
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)


def config(hisparse: bool, num_steps: int | None) -> EngineConfig:
    return EngineConfig(
        dtype="float32",
        page_size=PAGE,
        max_context_len=6_400,
        max_running_requests=2,
        device_pool_tokens=2 * 6_400,
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2) if hisparse else None,
        speculative=(
            SpeculativeConfig(
                num_steps=num_steps,
                max_batch_size=None,
                timed=False,
                min_accept_length=None,
                plain_tail=False,
                plain_while_prefilling=False,
            )
            if num_steps
            else None
        ),
    )


def run(model, cfg: EngineConfig, batch: list[list[int]]):
    executor = Executor(cfg, model=model)
    pools = executor.pool_counts()
    driver = SyncDriver(executor, check=True)
    reqs = driver.generate(batch, PARAMS)
    assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
    assert executor.pool_counts() == pools
    stats = executor.stats()["hisparse"]
    executor.close()
    return [r.output_ids for r in reqs], stats


@pytest.mark.slow  # a 6K-token prefill attends 2,048 rows of 576 floats per query
@pytest.mark.parametrize("num_steps", [None, 2], ids=["plain", "speculative"])
def test_v32_shapes_hisparse_equals_resident(num_steps):
    model = build_tiny_model(dtype=torch.float32, seed=3, **V32_SHAPES)
    gen = torch.Generator().manual_seed(5)
    batch = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    resident, _ = run(model, config(False, num_steps), batch)
    hisparse, stats = run(model, config(True, num_steps), batch)
    assert hisparse == resident
    assert stats is not None
    # every layer's decode swap-ins both hit and missed (so evicted: the hot region was full)
    assert all(h > 0 and m > 0 for h, m in zip(stats["hits"], stats["misses"])), stats
    assert all(u == 0 for u in stats["unrecoverable"]), stats
