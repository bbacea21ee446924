"""Prefix caching never changes the answer, holds memory only while it is free, and gives it back.

Float64, the tiny random model: with the cache on, every request gets the tokens it gets with the
cache off, for prompts sharing prefixes of every kind (shorter than a page, page-aligned, not
aligned, the whole prompt, a prompt that is a prefix of a cached one), HiSparse on and off,
speculation on and off, requests one after another and together; sampled requests with a seed
too. A four-turn chat hits the previous turns; distinct long prompts that need more than the pools
hold are all served once the cache has filled them; flushing returns every pool to its initial count.
"""

from __future__ import annotations

import attrs
import pytest
from _engine_util import PAGE, config, make_prompts

from pipeline import Engine, SamplingParams
from pipeline.driver import SyncDriver
from pipeline.executor import Executor

PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)


def cfg(*, cache: bool, hisparse: bool = True, spec: bool = False, **kw):
    base = config(hisparse=hisparse, num_steps=2 if spec else None, **kw)
    return attrs.evolve(base, prefix_cache=cache, chunked_prefill_tokens=24)


def family(seed: int = 0) -> list[list[int]]:
    """Prompts sharing a 70-token base in every way: shorter than a page, page-aligned, unaligned,
    the whole base, a prefix of it, and longer continuations."""
    (base,) = make_prompts([70], seed=seed)
    (tail,) = make_prompts([30], seed=seed + 100)
    return [
        base,  # first: fills the cache
        base[:2] + tail[:9],  # shares less than a page
        base[: 8 * PAGE] + tail[:5],  # page-aligned shared prefix
        base[:45] + tail[:7],  # unaligned
        list(base),  # the whole prompt again (its last token is still computed)
        base[:50],  # a prefix of a cached prompt
        base + tail,  # the base and more
        base + tail[:3],
    ]


def expected_hit(prompt: list[int], earlier: list[list[int]]) -> int:
    """Cached tokens a prompt finds after ``earlier`` requests (prompt + output each) ended: whole
    pages of the longest common prefix whose next token matches too, leaving the last token."""
    best = 0
    for seq in earlier:
        common = next((i for i, (a, b) in enumerate(zip(prompt, seq)) if a != b), min(len(prompt), len(seq)))
        best = max(best, min(common - 1, len(prompt) - 1, len(seq) - 1) // PAGE * PAGE)
    return best


def run_one_after_another(model, config_, prompts, params=PARAMS):
    executor = Executor(config_, model=model)
    driver = SyncDriver(executor, check=True)
    out, cached = [], []
    for p in prompts:
        (req,) = driver.generate([p], params)
        out.append(list(req.output_ids))
        cached.append(req.metrics.cached_tokens)
    stats = executor.stats()
    executor.flush_prefix_cache()
    executor.check_integrity()
    initial = Executor(config_, model=model).pool_counts()
    assert executor.pool_counts() == initial, "pools not back after a flush"
    assert stats["pools"]  # the figures are there
    executor.close()
    return out, cached, stats


@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "resident"])
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_one_after_another_the_cache_gives_the_uncached_tokens(tiny_model, hisparse, spec):
    prompts = family(0)
    want, _, _ = run_one_after_another(tiny_model, cfg(cache=False, hisparse=hisparse, spec=spec), prompts)
    got, cached, stats = run_one_after_another(
        tiny_model, cfg(cache=True, hisparse=hisparse, spec=spec), prompts
    )
    assert got == want
    earlier = [p + out for p, out in zip(prompts, want)]
    assert cached == [expected_hit(p, earlier[:i]) for i, p in enumerate(prompts)]
    assert cached[1] == 0 and all(c > 0 for c in cached[2:]), cached
    cache = stats["prefix_cache"]
    assert cache["hit_tokens"] == sum(cached) and cache["queried_tokens"] == sum(len(p) for p in prompts)


def test_requests_arriving_together_share_what_the_first_finished_prompt_left(tiny_model):
    """Admitted at once, nothing is cached yet: the cache changes nothing; a second wave hits."""
    prompts = family(1)
    for wave in (1, 2):
        results = {}
        for cache in (False, True):
            executor = Executor(cfg(cache=cache), model=tiny_model)
            driver = SyncDriver(executor, check=True)
            reqs = driver.generate(prompts, PARAMS)
            if wave == 2:
                reqs = driver.generate(prompts, PARAMS)
            results[cache] = ([list(r.output_ids) for r in reqs], [r.metrics.cached_tokens for r in reqs])
            executor.close()
        assert results[True][0] == results[False][0]
        assert (sum(results[True][1]) > 0) == (wave == 2)


def test_sampled_requests_with_a_seed_get_the_same_tokens(tiny_model):
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    prompts = family(2)[:5]
    for spec in (False, True):
        off, _, _ = run_one_after_another(tiny_model, cfg(cache=False, spec=spec), prompts, params)
        on, cached, _ = run_one_after_another(tiny_model, cfg(cache=True, spec=spec), prompts, params)
        assert on == off and sum(cached) > 0


@pytest.mark.asyncio
async def test_a_four_turn_chat_hits_the_previous_turns(tiny_model):
    """Each turn resends the conversation: from turn 2 on the cached tokens cover the previous
    turn's prompt and answer (page-aligned, the last token recomputed); tokens equal cache off."""
    turns = make_prompts([20, 9, 13, 6], seed=5)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    runs = {}
    for cache in (False, True):
        async with Engine(cfg(cache=cache), model=tiny_model) as engine:
            history: list[int] = []
            answers, hits = [], []
            for user in turns:
                prompt = history + user
                result = await engine.generate_text(prompt, params)
                answers.append(list(result.token_ids))
                hits.append(result.metrics.cached_tokens)
                history = prompt + list(result.token_ids)
            await engine.wait_idle()
            assert await engine.flush_prefix_cache() >= (1 if cache else 0)
            assert engine.executor.pool_counts() == engine.initial_pool_counts
        runs[cache] = (answers, hits)
    assert runs[True][0] == runs[False][0]
    hits = runs[True][1]
    assert hits[0] == 0
    length = 0
    for i in range(1, 4):
        length += len(turns[i - 1]) + 12  # the previous prompt and answer
        assert hits[i] == (length - 1) // PAGE * PAGE, (i, hits)


def test_under_memory_pressure_the_cache_gives_way(tiny_model):
    """Small pools: once the cache holds the pages of earlier prompts, distinct long prompts that
    need more than the pools hold are still all served (the cache is evicted; nothing waits, nothing
    is lost), with the uncached tokens; flushing returns every pool."""
    small = dict(device_pool_tokens=256, max_running_requests=3, max_context_len=200, ratio=2)
    prompts = make_prompts([150, 140, 150, 130, 145, 150], seed=9)
    want, _, _ = run_one_after_another(tiny_model, cfg(cache=False, **small), prompts)
    got, _, stats = run_one_after_another(tiny_model, cfg(cache=True, **small), prompts)
    assert got == want
    assert stats["prefix_cache"]["evicted_pages"] > 0
    executor = Executor(cfg(cache=True, **small), model=tiny_model)
    driver = SyncDriver(executor, check=True)
    reqs = driver.generate(prompts, PARAMS)  # together, more than the pools hold at once
    assert [list(r.output_ids) for r in reqs] == want
    executor.flush_prefix_cache()
    assert executor.pool_counts() == Executor(cfg(cache=True, **small), model=tiny_model).pool_counts()
    executor.close()


def test_aborts_and_failures_of_sharing_requests_keep_the_counts_right(tiny_model, monkeypatch):
    """Requests sharing cached pages are aborted in every state, and one fails in its forward:
    reference counts stay equal to the live sharers (checked every step), and a flush returns every
    pool. A failed request leaves nothing to the cache."""
    executor = Executor(cfg(cache=True), model=tiny_model)
    driver = SyncDriver(executor, check=True)
    base = family(3)[0]
    driver.generate([base], PARAMS)
    sharers = [driver.submit([*base, i, i + 1, i + 2], PARAMS) for i in range(4)]
    real = executor._prefill_forward

    def broken(items):
        if any(seq.request_id == sharers[3].request_id for seq, _, _ in items):
            raise RuntimeError("injected")
        return real(items)

    monkeypatch.setattr(executor, "_prefill_forward", broken)
    for step, req in enumerate(sharers[:3]):
        for _ in range(step):
            driver.step()
        driver.abort(req.request_id)
    driver.run()
    held = executor.stats()["prefix_cache"]["pages_held"]
    assert sharers[3].finish_reason == "error"
    assert all(r.finish_reason == "abort" for r in sharers[:3])
    assert executor.flush_prefix_cache() == held
    assert executor.pool_counts() == Executor(cfg(cache=True), model=tiny_model).pool_counts()
    executor.close()


def test_no_prefix_cache_on_the_command_line(tiny_model):
    from pipeline.generate import build_parser, engine_config

    args = build_parser().parse_args(["--no-prefix-cache", "hi"])
    assert engine_config(args).prefix_cache is False
    assert engine_config(build_parser().parse_args(["hi"])).prefix_cache is True
