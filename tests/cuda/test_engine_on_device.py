"""The engine on the device: HiSparse == all-resident and speculation == plain decoding (greedy,
float32), bfloat16 serving, the FP8 KV cache, the async engine; every pool back at its initial count
after each run.

Two models: the suite's random tiny model (HOT 16, contexts several times HOT), and one with the
attention shapes of ``sizes`` (on CUDA DeepSeek-V3.2's: MLA 512 + 64, an indexer of 64 heads of
128, top-k 2,048, HOT 4,096, prompts past 6K tokens; few heads, a tiny MLP and vocabulary), where
the swap-in must miss and evict.
"""

from __future__ import annotations

import anyio
import attrs
import pytest
import torch
from _device_sizes import Sizes

from pipeline import Engine
from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.sampling import SamplingParams

from tiny_models import build_tiny_model

pytestmark = pytest.mark.cuda

@attrs.frozen
class Case:
    """A model and the requests it serves."""

    overrides: dict
    hot: int
    page: int
    prompts: tuple[int, ...]
    new_tokens: int


TINY = Case(overrides={}, hot=16, page=8, prompts=(5, 19, 49, 90), new_tokens=20)


def shapes_case(sizes: Sizes) -> Case:
    return Case(overrides=sizes.model, hot=sizes.hot, page=sizes.page, prompts=sizes.prompts,
                new_tokens=sizes.new_tokens)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def config(case: Case, device: torch.device, *, hisparse: bool, num_steps: int | None,
           dtype: str = "float32", **extra) -> EngineConfig:
    """Pools for every request of ``case`` at once (each its whole context resident, or HOT and
    its pages with HiSparse), speculation without its adaptive rules (``num_steps`` every step)."""
    context = max(case.prompts) + case.new_tokens + 2 * case.page
    per_request = _round_up(context, case.page) + 2 * case.page
    pool = _round_up(max(per_request * len(case.prompts), len(case.prompts) * (case.hot + 4 * case.page)),
                     case.page)
    return EngineConfig(
        device=device.type,
        dtype=dtype,
        page_size=case.page,
        max_context_len=context,
        max_running_requests=len(case.prompts),
        device_pool_tokens=pool,
        hisparse=HiSparseConfig(device_buffer_size=case.hot, host_to_device_ratio=2) if hisparse else None,
        speculative=SpeculativeConfig(num_steps=num_steps, max_batch_size=None, max_context=None, timed=False,
                                      min_accept_length=None, plain_tail=False, plain_while_prefilling=False)
        if num_steps else None,
        **extra,
    )


def model_for(case: Case, dtype: torch.dtype, device: torch.device):
    return build_tiny_model(dtype=dtype, seed=2, **case.overrides).to(device)


def prompts_of(case: Case) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in case.prompts]


@attrs.frozen
class Served:
    outputs: list[list[int]]
    misses: int  # rows the swap-ins loaded (0 without HiSparse)


def serve(model, cfg: EngineConfig, batch: list[list[int]], new_tokens: int) -> Served:
    """Every request to its length through the synchronous driver; every pool restored."""
    executor = Executor(cfg, model=model)
    initial = executor.pool_counts()
    driver = SyncDriver(executor, check=True)
    reqs = driver.generate(batch, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
    counters = executor.memory.counters_dict()
    assert executor.pool_counts() == initial, "a pool is not back at its initial count"
    executor.close()
    misses = sum(counters["misses"]) if counters else 0
    return Served([list(r.output_ids) for r in reqs], misses)


@pytest.mark.parametrize("model_case", ["tiny", "shapes"])
def test_hisparse_and_speculation_equal_resident_plain_float32(device, sizes, model_case):
    case = TINY if model_case == "tiny" else shapes_case(sizes)
    model = model_for(case, torch.float32, device)
    batch = prompts_of(case)
    runs = {
        (hisparse, steps): serve(model, config(case, device, hisparse=hisparse, num_steps=steps), batch,
                                 case.new_tokens)
        for hisparse in (False, True)
        for steps in (None, 3)
    }
    resident = runs[(False, None)].outputs
    for (hisparse, steps), served in runs.items():
        label = f"{'hisparse' if hisparse else 'resident'}, {'speculative' if steps else 'plain'}"
        assert served.outputs == resident, label
        if hisparse:
            assert served.misses > 0, f"{label}: the contexts must outgrow HOT and miss"


@pytest.mark.parametrize("num_steps", [None, 3], ids=["plain", "speculative"])
def test_bfloat16_hisparse_equals_resident(device, num_steps):
    model = model_for(TINY, torch.bfloat16, device)
    batch = prompts_of(TINY)
    resident, hisparse = (
        serve(model, config(TINY, device, hisparse=h, num_steps=num_steps, dtype="bfloat16"), batch,
              TINY.new_tokens)
        for h in (False, True)
    )
    assert hisparse.outputs == resident.outputs
    assert hisparse.misses > 0


@pytest.mark.parametrize("model_case", ["tiny", "shapes"])
@pytest.mark.parametrize("num_steps", [None, 3], ids=["plain", "speculative"])
def test_fp8_kv_hisparse_equals_resident(device, sizes, model_case, num_steps):
    """bfloat16 weights, FP8 KV rows and indexer keys: every reader of a row sees the same stored
    bytes, so HiSparse still yields resident's tokens."""
    case = TINY if model_case == "tiny" else shapes_case(sizes)
    if model_case == "tiny":  # (the FP8 row layout scales the latent in tiles of 128 values)
        case = attrs.evolve(case, overrides=dict(kv_lora_rank=128, qk_rope_head_dim=16, index_head_dim=32))
    model = model_for(case, torch.bfloat16, device)
    batch = prompts_of(case)
    resident, hisparse = (
        serve(model, config(case, device, hisparse=h, num_steps=num_steps, dtype="bfloat16",
                            kv_cache_dtype="fp8_e4m3"), batch, case.new_tokens)
        for h in (False, True)
    )
    assert hisparse.outputs == resident.outputs
    assert hisparse.misses > 0


@pytest.mark.parametrize("num_steps", [None, 3], ids=["plain", "speculative"])
def test_shared_layers_prefetch_their_swap_ins_on_a_load_stream(device, num_steps):
    """GLM-5 shared indexer layers: each one's swap-in runs on the coordinator's load stream, issued
    when the full layer before it has its top-k (the default on CUDA), with resident's tokens."""
    case = attrs.evolve(TINY, overrides=dict(model_type="glm_moe_dsa", num_hidden_layers=4,
                                             indexer_types=["full", "shared", "shared", "full"]))
    model = model_for(case, torch.float32, device)
    assert model.cfg.indexer_types == ("full", "shared", "shared", "full")
    batch = prompts_of(case)
    resident = serve(model, config(case, device, hisparse=False, num_steps=num_steps), batch, case.new_tokens)
    executor = Executor(config(case, device, hisparse=True, num_steps=num_steps), model=model)
    assert executor.memory.shared_after(0) == (1, 2)
    reqs = SyncDriver(executor, check=True).generate(
        batch, SamplingParams(max_new_tokens=case.new_tokens, ignore_eos=True)
    )
    assert executor.memory._load_stream is not None  # (made at the first prefetch)
    executor.close()
    assert [list(r.output_ids) for r in reqs] == resident.outputs


@pytest.mark.parametrize("memory", ["resident", "hisparse", "dynamic"])
def test_decode_graphs_replay_the_eager_tokens(device, memory):
    """``cuda_graphs``: plain decode steps captured (all-resident: padded buckets; HiSparse: one graph
    per batch size, its swap-in inside; dynamic residency with room for all: the FULL rows' buckets,
    their slots through the page table's copy) and replayed give the eager tokens, and HiSparse
    counts each step's swap-ins once (the capture's warm-up runs are taken back)."""
    model = model_for(TINY, torch.float32, device)
    batch = prompts_of(TINY)

    def cfg(**extra) -> EngineConfig:
        base = config(TINY, device, hisparse=memory != "resident", num_steps=None, **extra)
        if memory != "dynamic":
            return base
        assert base.hisparse is not None
        return attrs.evolve(base, hisparse=attrs.evolve(base.hisparse, residency="dynamic"))

    eager = serve(model, cfg(), batch, TINY.new_tokens)
    executor = Executor(cfg(cuda_graphs=True), model=model)
    initial = executor.pool_counts()
    reqs = SyncDriver(executor, check=True).generate(
        batch, SamplingParams(max_new_tokens=TINY.new_tokens, ignore_eos=True)
    )
    graphs = executor.graphs
    bucket = f"{len(batch)} FULL" if memory == "dynamic" else str(len(batch))
    assert graphs is not None and graphs.refused == {} and graphs.captured() == [bucket]
    counters = executor.memory.counters_dict()
    assert executor.pool_counts() == initial
    executor.close()
    assert [list(r.output_ids) for r in reqs] == eager.outputs
    assert (sum(counters["misses"]) if counters else 0) == eager.misses


def test_async_engine_on_device_equals_driver(device):
    """The async engine (its executor in a thread of its own on CUDA) serves concurrent requests as
    the synchronous driver does, and gives every pool back."""
    model = model_for(TINY, torch.float32, device)
    cfg = config(TINY, device, hisparse=True, num_steps=3)
    batch = prompts_of(TINY)
    want = serve(model, cfg, batch, TINY.new_tokens).outputs
    got: dict[int, list[int]] = {}
    params = SamplingParams(max_new_tokens=TINY.new_tokens, ignore_eos=True)

    async def main() -> dict[str, int]:
        async with Engine(cfg, model=model) as engine:
            executor = engine.executor
            assert executor is not None
            initial = executor.pool_counts()

            async def one(i: int) -> None:
                result = await engine.generate_text(batch[i], params, request_id=f"r{i}")
                got[i] = list(result.token_ids)

            with anyio.fail_after(300):  # a hang guard only
                async with anyio.create_task_group() as tg:
                    for i in range(len(batch)):
                        tg.start_soon(one, i)
            assert executor.pool_counts() == initial
            return initial

    anyio.run(main)
    assert [got[i] for i in range(len(batch))] == want
