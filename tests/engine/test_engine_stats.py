"""What the engine reports: ``Engine.stats()`` (pools, HiSparse counters, speculative acceptance,
request counts and throughput) and the metrics each finished request carries."""

from __future__ import annotations

import itertools

import anyio
import pytest
from _engine_util import HOT, PAGE, Gate, Hold, config, make_prompts, until

from pipeline import Engine, SamplingParams
from pipeline.messages import Decode, Draft

NUM_STEPS = 3


def check_spec_counters(spec: dict, num_steps: int) -> None:
    """The counters' own identities (``pipeline.speculative.metrics``)."""
    rounds, accepted = spec["verify_rounds"], spec["accepted_drafts"]
    assert rounds >= 1 and 0 <= accepted <= rounds * num_steps
    assert spec["proposed_drafts"] == rounds * num_steps
    assert spec["accept_length"] == (accepted + rounds) / rounds >= 1
    assert spec["accept_rate"] == accepted / spec["proposed_drafts"]
    per_pos = spec["accepted_per_pos"]
    assert len(per_pos) == num_steps and sum(per_pos) == accepted
    assert all(a >= b for a, b in itertools.pairwise(per_pos))  # position i+1 is taken only after i
    histogram = spec["accept_length_histogram"]
    assert set(histogram) <= set(range(1, num_steps + 2))
    assert sum(histogram.values()) == rounds
    assert sum(length * n for length, n in histogram.items()) == accepted + rounds


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["hisparse+spec", "resident"])
async def test_stats_report_pools_counters_acceptance_and_throughput(tiny_model, mode):
    """Short requests first (every position fits the HOT buffer: no miss), then prompts longer than
    HOT (misses in every layer); at idle every pool is full again and the counters add up."""
    tiered = mode == "hisparse+spec"
    cfg = config(hisparse=tiered, num_steps=NUM_STEPS if tiered else None)
    short = make_prompts([4, 6], seed=11)
    long = make_prompts([40, 25, 5], seed=2)
    assert max(map(len, long)) > HOT
    params = SamplingParams(max_new_tokens=9, ignore_eos=True)
    results = []
    async with Engine(cfg, model=tiny_model) as engine:
        initial = engine.stats()
        assert initial["throughput"]["tokens_generated"] == 0 and initial["requests"]["ended"] == {}

        async def run(prompts):
            async def one(prompt):
                results.append(await engine.generate_text(prompt, params))

            async with anyio.create_task_group() as tg:
                for prompt in prompts:
                    tg.start_soon(one, prompt)
            await engine.wait_idle()

        # mid-run: the decode stage's first step held (the executor stays free), one request decoding
        hold = Hold(Draft if tiered else Decode).install(engine._pipe.decode)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, short[:1])
                await hold.wait_entered()
                busy = engine.stats()
                assert busy["requests"] == {"live": 1, "queued": 0, "staging": 0, "decoding": 1, "ended": {}}
                pools = busy["pools"]
                assert pools["request_rows"]["free"] == pools["request_rows"]["capacity"] - 1
                assert pools["device"]["free"] < pools["device"]["capacity"]
                hold.open()
        finally:
            hold.open()
        await run(short[1:])
        after_short = engine.stats()
        await run(long)
        stats = engine.stats()
        row_bytes = engine.executor.memory.host.row_bytes if tiered else None  # idle: nothing runs

    # pools: all free at idle, the same figures as pool_counts() (pages there, tokens here)
    pools = stats["pools"]
    assert all(p["free"] == p["capacity"] > 0 for p in pools.values())
    counts = engine.initial_pool_counts
    assert pools["request_rows"]["capacity"] == counts["rows"] == cfg.max_running_requests
    assert pools["device"]["capacity"] == cfg.device_pool_tokens
    if tiered:
        assert set(pools) == {"request_rows", "device", "logical", "host"}
        assert pools["device"]["free"] == counts["physical_pages"] * PAGE
        assert pools["logical"]["free"] == counts["logical_pages"] * PAGE
        assert pools["host"]["free"] == counts["host_pages"] * PAGE
    else:
        assert set(pools) == {"request_rows", "device"}
        assert pools["device"]["free"] == counts["kv_pages"] * PAGE
    assert stats["live_requests"] == 0 and stats["staging_requests"] == 0

    # request counts and throughput
    assert stats["requests"] == {"live": 0, "queued": 0, "staging": 0, "decoding": 0, "ended": {"length": 5}}
    throughput = stats["throughput"]
    assert throughput["tokens_generated"] == sum(len(r.token_ids) for r in results) == 5 * 9
    assert throughput["requests_finished"] == len(results) == 5
    assert throughput["uptime_s"] > 0
    assert throughput["tokens_per_s"] == pytest.approx(
        throughput["tokens_generated"] / throughput["uptime_s"]
    )
    assert after_short["throughput"]["tokens_generated"] == 2 * 9
    assert stats["executor_commands"] > after_short["executor_commands"] > 0
    # time inside device commands grows with them, and never exceeds the engine's lifetime
    assert 0 < after_short["executor_busy_s"] < stats["executor_busy_s"] < throughput["uptime_s"]

    if not tiered:
        assert stats["hisparse"] is None and stats["speculative"] is None
        return

    # HiSparse: per layer, non-negative; no miss while every position fits HOT; h2d = misses x row
    hs, early = stats["hisparse"], after_short["hisparse"]
    num_layers = len(hs["hits"])
    assert num_layers == tiny_model.cfg.num_hidden_layers
    for key in ("hits", "misses", "unrecoverable", "h2d_bytes", "d2h_bytes", "hit_rate"):
        assert len(hs[key]) == num_layers and all(v >= 0 for v in hs[key])
    assert early["misses"] == [0] * num_layers and early["h2d_bytes"] == [0] * num_layers
    assert all(h > 0 for h in early["hits"])
    assert all(m > 0 for m in hs["misses"])
    assert hs["unrecoverable"] == [0] * num_layers
    for layer in range(num_layers):
        assert hs["h2d_bytes"][layer] == hs["misses"][layer] * row_bytes
        total = hs["hits"][layer] + hs["misses"][layer]
        assert hs["hit_rate"][layer] == round(hs["hits"][layer] / total, 4)
    # device -> host: the prompt at staging, then each committed position once (the same in every
    # layer); at least every position whose KV was computed (all known tokens but the last)
    assert len(set(hs["d2h_bytes"])) == 1 and hs["d2h_bytes"][0] % row_bytes == 0
    computed = sum(r.metrics.num_prompt_tokens + len(r.token_ids) - 1 for r in results)
    assert hs["d2h_bytes"][0] >= computed * row_bytes

    # speculative acceptance: its own identities, and the sum of the requests' own counters
    spec = stats["speculative"]
    check_spec_counters(spec, NUM_STEPS)
    per_request = [r.metrics.spec for r in results]
    assert spec["verify_rounds"] == sum(s.verify_rounds for s in per_request)
    assert spec["accepted_drafts"] == sum(s.accepted_drafts for s in per_request)
    assert spec["accepted_per_pos"] == [
        sum(s.accepted_per_pos[i] for s in per_request) for i in range(NUM_STEPS)
    ]


@pytest.mark.asyncio
@pytest.mark.parametrize("num_steps", [None, NUM_STEPS])
async def test_a_finished_request_carries_its_metrics(tiny_model, num_steps):
    """``first`` is held in prefill while ``second`` waits in the queue; ``one`` ends at prefill
    (``max_new_tokens=1``); ``streamed`` gets its metrics on its last delta only."""
    cfg = config(num_steps=num_steps)
    prompts = make_prompts([21, 9, 7, 30], seed=3)
    params = SamplingParams(max_new_tokens=11, ignore_eos=True)
    results = {}
    deltas = []
    async with Engine(cfg, model=tiny_model) as engine:
        gate = Gate().install(engine, "prefill_chunks")

        async def text(rid, prompt, sp=params):
            results[rid] = await engine.generate_text(prompt, sp, request_id=rid)

        async def stream(rid, prompt):
            async for delta in engine.generate(prompt, params, request_id=rid):
                deltas.append(delta)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(text, "first", prompts[0])
                await gate.wait_entered()
                tg.start_soon(text, "second", prompts[1])
                await until(lambda: any(r.request_id == "second" for r in engine._pipe.core.admission.queue))
                gate.open()
                tg.start_soon(text, "one", prompts[2], SamplingParams(max_new_tokens=1))
                tg.start_soon(stream, "streamed", prompts[3])
        finally:
            gate.open()

    assert all(d.metrics is None for d in deltas[:-1]) and deltas[-1].finished
    streamed = deltas[-1].metrics
    assert streamed is not None
    assert streamed.num_generation_tokens == sum(len(d.token_ids) for d in deltas) == 11
    metrics = {rid: r.metrics for rid, r in results.items()} | {"streamed": streamed}
    tokens = {rid: len(r.token_ids) for rid, r in results.items()} | {"streamed": 11}
    prompt_of = dict(zip(["first", "second", "one", "streamed"], prompts))

    for rid, m in metrics.items():
        n = tokens[rid]
        assert m.num_prompt_tokens == len(prompt_of[rid])
        assert m.num_generation_tokens == n == (1 if rid == "one" else 11)
        assert m.num_retractions == 0
        # the timestamps in causal order, and the figures derived from them (all from arrival)
        assert (
            m.arrival_time <= m.scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        )
        assert m.queue_time == m.scheduled_time - m.arrival_time >= 0
        assert m.time_to_first_token == m.first_token_time - m.arrival_time >= m.queue_time
        assert m.e2e_latency == m.finished_time - m.arrival_time >= m.time_to_first_token
        if n == 1:
            assert m.inter_token_latency is None and m.first_token_time == m.last_token_time
        else:
            # mean gap between the output tokens after the first: the time from the first token
            # to the last, over n - 1; that time lies within e2e - ttft (the end comes after it)
            itl = m.inter_token_latency
            assert itl == (m.last_token_time - m.first_token_time) / (n - 1) >= 0
            assert itl * (n - 1) <= m.e2e_latency - m.time_to_first_token
        data = m.as_dict()
        for name in ("queue_time", "time_to_first_token", "inter_token_latency", "e2e_latency"):
            assert data[name] == getattr(m, name)
        if num_steps is None or rid == "one":  # no verify round: no speculative counters
            assert m.spec is None and data["spec"] is None
            assert m.spec_accept_length is None and m.spec_accept_rate is None
            continue
        spec = data["spec"]
        check_spec_counters(spec, num_steps)
        assert m.spec_accept_length == spec["accept_length"] and m.spec_accept_rate == spec["accept_rate"]
        # the first token comes from prefill; each verify round commits its accepted drafts and one
        # token more, but the last round is cut at max_new_tokens (at least one of its tokens stays)
        committed = 1 + spec["accepted_drafts"] + spec["verify_rounds"]
        assert committed - num_steps <= n <= committed

    # the second request waited in the queue until the first one's prefill was done
    assert (
        metrics["second"].arrival_time
        <= metrics["first"].first_token_time
        <= metrics["second"].scheduled_time
    )
