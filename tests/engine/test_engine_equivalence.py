"""Concurrent requests through the engine give exactly the synchronous driver's tokens.

Each request samples with its own generator (seeded from the engine seed and its request id, or
its own seed), so its tokens do not depend on which requests share its steps: the engine, whose
batches form differently (requests join between steps as they become ready), must reproduce the
driver token for token, greedy and sampled, plain and speculative, with prompts shorter and longer
than the HiSparse hot region.
"""

from __future__ import annotations

import anyio
import pytest
from _engine_util import HOT, config, driver_outputs, make_prompts

from pipeline import Engine, SamplingParams

LENGTHS = [3, HOT - 2, HOT, 2 * HOT + 5, 9 * HOT + 1, 7, 50, HOT + 1, 1, 23]


def params_for(i: int, sampled: bool, max_new: int) -> SamplingParams:
    if not sampled:
        return SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    seed = None if i % 2 else 1000 + i  # derived from the request id, or explicit
    return SamplingParams(
        max_new_tokens=max_new, temperature=0.8, top_p=0.9, top_k=40, seed=seed, ignore_eos=True
    )


async def run_engine(model, cfg, prompts, params, ids) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}

    async def consume(prompt, sp, rid):
        tokens: list[int] = []
        async for delta in engine.generate(prompt, sp, request_id=rid):
            tokens += delta.token_ids
        outputs[rid] = tokens

    async with Engine(cfg, model=model) as engine, anyio.create_task_group() as tg:
        for prompt, sp, rid in zip(prompts, params, ids):
            tg.start_soon(consume, prompt, sp, rid)
            await anyio.sleep(0)  # staggered arrivals: later requests join a running batch
    assert engine.final_pool_counts == engine.initial_pool_counts
    return outputs


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("num_steps", "sampled", "hisparse"),
    [(None, False, True), (None, True, True), (3, False, True), (3, True, True), (2, False, False)],
    ids=["plain-greedy", "plain-sampled", "spec-greedy", "spec-sampled", "spec-resident"],
)
async def test_engine_matches_sync_driver(tiny_model, num_steps, sampled, hisparse):
    cfg = config(num_steps=num_steps, hisparse=hisparse, max_running_requests=6)
    prompts = make_prompts(LENGTHS, seed=7)
    max_new = [20, 9, 24, 16, 12, 1, 20, 5, 18, 11]
    params = [params_for(i, sampled, n) for i, n in enumerate(max_new)]
    ids = [f"eq-{i}" for i in range(len(prompts))]
    expected = driver_outputs(tiny_model, cfg, prompts, params, ids)
    got = await run_engine(tiny_model, cfg, prompts, params, ids)
    assert got == expected
    assert [len(got[rid]) for rid in ids] == max_new


@pytest.mark.asyncio
async def test_text_deltas_concatenate_to_the_final_text(tiny_model):
    cfg = config(num_steps=3)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
    async with Engine(cfg, model=tiny_model) as engine:
        text, tokens, last = "", [], None
        async for delta in engine.generate("héllo wörld", params):
            text += delta.text
            tokens += delta.token_ids
            last = delta
        result = await engine.generate_text("héllo wörld", params)
    assert last.finished and last.finish_reason == "length" and last.metrics is not None
    assert tokens == list(result.token_ids)
    assert text == result.text
    assert result.metrics.spec is not None and result.metrics.spec.verify_rounds > 0
    assert result.metrics.time_to_first_token is not None and result.metrics.e2e_latency is not None
