"""Start-up resolves the configuration once into a frozen plan, and leaves the configuration as given."""

from __future__ import annotations

import anyio
import attrs
import pytest

from pipeline import Engine, EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.executor import Executor
from pipeline.preflight import read_model_config
from pipeline.startup import plan_engine, preflight


def test_the_engine_keeps_the_users_config_and_reads_the_plan(tiny_model):
    """``Engine.config`` is the very object given, unchanged after start-up; what start-up derived
    ("auto" speculation, the context limit, the pools, HOT) is ``Engine.plan``, frozen, and the same
    plan ``preflight`` makes without allocating."""
    config = EngineConfig(dtype="float64")
    given = attrs.evolve(config)  # an equal copy, made before start-up

    async def main():
        async with Engine(config, model=tiny_model) as engine:
            return engine.config, engine.executor.config, engine.plan

    engine_config, executor_config, plan = anyio.run(main)
    assert engine_config is config and executor_config is config and config == given
    assert (config.speculative, config.max_context_len, config.device_pool_tokens) == ("auto", None, None)
    assert config.max_running_requests is None and config.hisparse == HiSparseConfig()
    assert plan.speculative == SpeculativeConfig()
    assert plan.max_context_len == tiny_model.cfg.max_position_embeddings
    assert (plan.device_pool_tokens, plan.max_running_requests, plan.host_to_device_ratio) == (16384, 16, 4)
    assert plan.memory.max_context_len == plan.max_context_len and plan.device.plan is plan.memory
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.max_context_len = 1  # type: ignore[misc]
    assert preflight(config, model=tiny_model) == plan


def test_preflight_hispec_plan_and_the_engine_make_one_plan(capsys):
    """For one config and model, ``hispec plan`` prints the sizes the engine starts with."""
    from pipeline.plan import build_parser, default_hot, device_plan, main, plan_config

    argv = ["--context", "512", "--device-memory", "64MB", "--dtype", "float64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    args = build_parser().parse_args(argv)
    model_cfg = read_model_config("tiny")
    args.hot = default_hot(model_cfg, args.page_size)  # what ``main`` takes when --hot is left out
    config = plan_config(args, hisparse=True, context=512)
    executor = Executor(config)  # the bundled model's weights, loaded
    try:
        plan = executor.plan
        assert preflight(config) == plan_engine(config, model_cfg) == plan
        assert device_plan(config, model_cfg) == plan.device
        printed = (f"device pool {plan.device_pool_tokens} slots, {plan.memory.logical_tokens} logical "
                   f"locations, {plan.max_running_requests} request rows")
        assert printed in out
        assert plan.device_memory_bytes == 64 * 10**6 and executor.config is config
    finally:
        executor.close()


def test_a_rank_that_its_group_checked_skips_the_machine_check(tiny_model, monkeypatch):
    """A tensor-parallel rank starts with ``check_machine=False``: its group checked every rank's
    memory before spawning one, and the ranks that allocated first would make a later check refuse
    a plan that fits. Every other start checks the plan against the machine."""
    import pipeline.startup

    checked: list[int] = []
    real = pipeline.startup.check_memory
    monkeypatch.setattr(pipeline.startup, "check_memory", lambda *a, **k: checked.append(1) or real(*a, **k))
    config = EngineConfig(dtype="float64", speculative=None)
    for check_machine, calls in ((True, 1), (False, 0)):
        checked.clear()
        Executor(config, model=tiny_model, check_machine=check_machine).close()
        assert len(checked) == calls
