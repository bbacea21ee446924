"""One request's fault fails that request only: injected faults in a batched forward, in one
request's sampling, in swap-in and in a staging copy fail the culprit; every other request gets
exactly the tokens of a fault-free run, the engine keeps serving, and every pool comes back.

Plus: seeded sampling is reproducible across a retraction (the generator travels with the request).
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest
from _reliability_util import small_config

from kernels import hisparse_attend_numba
from pipeline import Engine, RequestFailed, SamplingParams
from pipeline.driver import SyncDriver
from pipeline.executor import Executor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from _engine_util import driver_outputs, make_prompts

POISON = 251  # a token id whose presence in a forward's input makes the injected forward raise


def clean_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    return [[t if t != POISON else POISON - 1 for t in p] for p in make_prompts(lengths, seed=seed)]


async def serve(cfg, model, prompts, params, ids, setup=None) -> dict[str, object]:
    """Every request at once through the engine; each result is a GenerateResult or the exception.
    ``setup(engine)`` runs once the engine has started, before the requests (a fault to install)."""
    outcomes: dict[str, object] = {}
    async with Engine(cfg, model=model, max_prefill_tokens=10_000) as engine:
        if setup is not None:
            setup(engine)

        async def one(rid, prompt, sp):
            try:
                outcomes[rid] = await engine.generate_text(prompt, sp, request_id=rid)
            except RequestFailed as exc:
                outcomes[rid] = exc

        with anyio.fail_after(120):  # hang guard
            async with anyio.create_task_group() as tg:
                for rid, prompt, sp in zip(ids, prompts, params):
                    tg.start_soon(one, rid, prompt, sp)
            after = await engine.generate_text(prompts[0], params[0])  # still serving
        outcomes["after"] = after
        assert engine.executor.pool_counts() == engine.initial_pool_counts
    assert engine.final_pool_counts == engine.initial_pool_counts
    return outcomes


def check_only_culprit_failed(outcomes, expected, culprit: str, reason: str) -> None:
    assert isinstance(outcomes[culprit], RequestFailed) and reason in outcomes[culprit].reason
    for rid, tokens in expected.items():
        if rid != culprit:
            assert not isinstance(outcomes[rid], RequestFailed), f"{rid} failed too: {outcomes[rid].reason}"
            assert list(outcomes[rid].token_ids) == tokens, f"{rid} changed by {culprit}'s fault"
    assert outcomes["after"].finish_reason == "length"


@pytest.mark.asyncio
@pytest.mark.parametrize("num_steps", [None, 2])
async def test_a_forward_that_raises_for_one_request_fails_that_request_only(
    tiny_model, monkeypatch, num_steps
):
    """The culprit's prompt holds the poison token, so every batched forward it is in raises: the
    executor bisects the batch, the culprit fails, the others' tokens are the fault-free ones."""
    cfg = small_config(num_steps=num_steps)
    prompts = clean_prompts([12, 30, 7, 19, 25, 9], seed=3)
    ids = [f"g{i}" for i in range(len(prompts))]
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True)] * len(ids)
    expected = driver_outputs(tiny_model, cfg, prompts, params, ids)
    prompts[2] = [*prompts[2][:3], POISON, *prompts[2][4:]]
    real = type(tiny_model).forward

    def forward(self, input_ids, positions, backend):
        if bool((input_ids == POISON).any()):
            raise RuntimeError("injected forward fault")
        return real(self, input_ids, positions, backend)

    monkeypatch.setattr(type(tiny_model), "forward", forward)
    outcomes = await serve(cfg, tiny_model, prompts, params, ids)
    check_only_culprit_failed(outcomes, expected, "g2", "injected forward fault")


@pytest.mark.asyncio
async def test_one_requests_sampling_fault_fails_it_alone(tiny_model, monkeypatch):
    """Sampling raises for one request (its fourth token): in the middle of a batched decode step, the
    others sample on and keep their exact tokens (sampled ones too: no random number is redrawn)."""
    from pipeline import sampling as sampling_module

    cfg = small_config(num_steps=None)
    prompts = clean_prompts([10, 14, 8, 20], seed=4)
    ids = [f"s{i}" for i in range(len(prompts))]
    params = [
        SamplingParams(max_new_tokens=9, temperature=0.8, seed=10 + i, ignore_eos=True)
        for i in range(len(ids))
    ]
    expected = driver_outputs(tiny_model, cfg, prompts, params, ids)
    real = sampling_module.sample
    calls = {"n": 0}

    def sample(logits, sp, generator):
        if sp.seed == 11:
            calls["n"] += 1
            if calls["n"] == 4:
                raise FloatingPointError("injected sampling fault")
        return real(logits, sp, generator)

    monkeypatch.setattr(sampling_module, "sample", sample)
    outcomes = await serve(cfg, tiny_model, prompts, params, ids)
    check_only_culprit_failed(outcomes, expected, "s1", "injected sampling fault")
    assert len(outcomes["s1"].output_ids) == 3  # what it had before its fault


@pytest.mark.asyncio
async def test_a_swap_in_fault_fails_the_request_it_was_for(tiny_model, monkeypatch):
    """Swap-in raises whenever the culprit's row is in the call (past HOT, in decode): the forward is
    bisected down to the culprit."""
    from pipeline.hisparse.coordinator import HiSparseCoordinator

    cfg = small_config(num_steps=None)
    prompts = clean_prompts([40, 44, 38], seed=5)  # past HOT (16): decode steps swap in
    ids = ["w0", "w1", "w2"]
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True)] * 3
    expected = driver_outputs(tiny_model, cfg, prompts, params, ids)
    real = HiSparseCoordinator.swap_in
    culprit_rows: set[int] = set()

    def swap_in(self, layer, top_k_pos, seq_lens, rows, **kwargs):
        if culprit_rows & set(rows.tolist()) and int(seq_lens.max()) > 42:
            raise RuntimeError("injected swap-in fault")
        return real(self, layer, top_k_pos, seq_lens, rows, **kwargs)

    monkeypatch.setattr(HiSparseCoordinator, "swap_in", swap_in)
    real_one_call = hisparse_attend_numba.attend_views

    def one_call(pools, views, *rest):
        # a decode layer's swap-in runs inside the one-call CPU attention: the same fault there
        if culprit_rows & set(views.token_rows.tolist()) and int(views.seq_lens.max()) > 42:
            raise RuntimeError("injected swap-in fault")
        return real_one_call(pools, views, *rest)

    monkeypatch.setattr(hisparse_attend_numba, "attend_views", one_call)
    real_admit = Executor.admit

    def admit(self, sequences):
        result = real_admit(self, sequences)
        if "w1" in result.admitted:
            culprit_rows.add(self.seqs["w1"].row)
        return result

    monkeypatch.setattr(Executor, "admit", admit)
    outcomes = await serve(cfg, tiny_model, prompts, params, ids)
    check_only_culprit_failed(outcomes, expected, "w1", "injected swap-in fault")


@pytest.mark.asyncio
async def test_a_failed_staging_copy_fails_its_request_and_frees_its_memory(tiny_model):
    """The second request's prompt copy to host fails: it ends FAILED with the reason, its pages are
    freed (nothing leaks), and the others are served as if nothing happened."""
    from pipeline.hisparse import transfer

    cfg = small_config(num_steps=2)
    prompts = clean_prompts([12, 20, 9], seed=6)
    ids = ["c0", "c1", "c2"]
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True)] * 3
    expected = driver_outputs(tiny_model, cfg, prompts, params, ids)

    class Broken:
        def query(self) -> bool:
            raise OSError("injected copy fault")

        def wait(self) -> None:
            raise OSError("injected copy fault")

    outcomes: dict[str, object] = {}
    async with Engine(cfg, model=tiny_model) as engine:
        stream = engine.executor.memory._staging_stream
        real = stream.copy_rows
        calls = {"n": 0}

        def copy_rows(*args):
            calls["n"] += 1
            handle = real(*args)
            if calls["n"] == 2:
                handle.wait()  # the copy itself lands; the handle reports a failure
                return Broken()
            return handle

        stream.copy_rows = copy_rows
        assert isinstance(stream, transfer.ThreadTransferStream)

        async def one(rid, prompt, sp):
            try:
                outcomes[rid] = await engine.generate_text(prompt, sp, request_id=rid)
            except RequestFailed as exc:
                outcomes[rid] = exc

        with anyio.fail_after(60):
            for rid, prompt, sp in zip(ids, prompts, params):  # one after another: copy 2 is c1's
                await one(rid, prompt, sp)
        outcomes["after"] = await engine.generate_text(prompts[0], params[0])
        assert engine.executor.pool_counts() == engine.initial_pool_counts
    check_only_culprit_failed(outcomes, expected, "c1", "injected copy fault")


def test_seeded_sampling_is_reproducible_across_a_retraction(tiny_model):
    """A sampled request with its own seed gives the same tokens whether or not memory pressure
    retracts it on the way: its generator's state travels with it."""
    params = SamplingParams(max_new_tokens=50, temperature=1.0, seed=7, ignore_eos=True)
    prompts = make_prompts([6, 9, 4, 8], seed=6)
    roomy = small_config(num_steps=None, max_context_len=64)
    small = small_config(num_steps=None, device_pool_tokens=64, max_context_len=64)
    outputs = {}
    for name, cfg in (("roomy", roomy), ("small", small)):
        executor = Executor(cfg, model=tiny_model)
        driver = SyncDriver(executor, check=True)
        reqs = [driver.submit(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
        driver.run()
        outputs[name] = [list(r.output_ids) for r in reqs]
        if name == "small":
            assert sum(r.metrics.num_retractions for r in reqs) > 0
        executor.close()
    assert outputs["small"] == outputs["roomy"]


async def _one_by_one(engine, prompts, params, ids) -> dict[str, object]:
    outcomes: dict[str, object] = {}
    with anyio.fail_after(120):  # hang guard
        for rid, prompt, sp in zip(ids, prompts, params):
            try:
                outcomes[rid] = await engine.generate_text(prompt, sp, request_id=rid)
            except RequestFailed as exc:
                outcomes[rid] = exc
    return outcomes


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["worker", "issue"])
async def test_one_failed_staging_copy_leaves_nothing_behind(tiny_model, mode):
    """The first request's prompt copy to host fails once (reported by the transfer worker, or
    raised as it is issued): that request fails, and each of the ten short requests after it is
    served as if nothing had happened (no old error surfaces again)."""
    from pipeline.benchmarks.faults import FaultyStream

    cfg = small_config(num_steps=None)
    prompts = clean_prompts([12] * 11, seed=8)
    ids = [f"t{i}" for i in range(11)]
    params = [SamplingParams(max_new_tokens=4, ignore_eos=True)] * 11
    expected = driver_outputs(tiny_model, cfg, prompts, params, ids)
    async with Engine(cfg, model=tiny_model) as engine:
        memory = engine.executor.memory
        left = [1]

        def fails(dst_idx) -> bool:
            left[0] -= 1
            return left[0] == 0

        memory._staging_stream = FaultyStream(
            memory._staging_stream, fails, mode=mode, message="injected staging copy fault"
        )
        outcomes = await _one_by_one(engine, prompts, params, ids)
        assert engine.executor.pool_counts() == engine.initial_pool_counts
    assert (
        isinstance(outcomes["t0"], RequestFailed) and "injected staging copy fault" in outcomes["t0"].reason
    )
    for rid in ids[1:]:
        assert not isinstance(outcomes[rid], RequestFailed), f"{rid} failed: {outcomes[rid].reason}"
        assert list(outcomes[rid].token_ids) == expected[rid]
    assert engine.final_pool_counts == engine.initial_pool_counts


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["worker", "issue"])
@pytest.mark.parametrize("num_steps", [None, 2])
async def test_a_failed_backup_copy_fails_its_request_not_its_batch(tiny_model, mode, num_steps):
    """Six requests decode together past HOT (their early tokens are evicted and read back from their
    host copies); the copies of one request's decoded KV to host fail from its sixth position on.
    That request fails; the other five get exactly the tokens of a fault-free run."""
    from pipeline.benchmarks.faults import FaultyStream

    cfg = small_config(num_steps=num_steps)
    prompts = clean_prompts([9, 11, 10, 12, 8, 13], seed=9)
    ids = [f"b{i}" for i in range(6)]
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True)] * 6
    expected = driver_outputs(tiny_model, cfg, prompts, params, ids)
    installed: list[FaultyStream] = []

    def install(engine) -> None:
        ex = engine.executor
        memory = ex.memory

        def fails(dst_idx) -> bool:
            seq = ex.seqs.get("b2")
            if seq is None:
                return False
            start = len(prompts[2]) + 5
            culprit = set(memory.host.req_to_host[seq.row, start:].tolist()) - {-1}
            return bool(culprit & set(dst_idx.tolist()))

        memory._backup_stream = FaultyStream(
            memory._backup_stream, fails, mode=mode, message="injected backup copy fault"
        )
        installed.append(memory._backup_stream)

    outcomes = await serve(cfg, tiny_model, prompts, params, ids, setup=install)
    assert installed[0].fired > 0
    check_only_culprit_failed(outcomes, expected, "b2", "injected backup copy fault")
