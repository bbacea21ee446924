"""Configuration rules: each accepted at its boundary and rejected just past it, naming the field."""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis import given

from pipeline import ConfigError, EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.config import check_against_model

HS = HiSparseConfig
SP = SpeculativeConfig

# (field named by the error, config accepted at the boundary, config rejected just past it);
# lazy, because the nested configs check their own rules when built
RULES = [
    ("device", lambda: dict(device="cuda", dtype="bfloat16"), lambda: dict(device="tpu")),
    ("dtype", lambda: dict(dtype="float64"), lambda: dict(dtype="float8")),
    ("dtype", lambda: dict(device="cpu", dtype="float64"), lambda: dict(device="cuda", dtype="float64")),
    (
        "page_size",
        lambda: dict(page_size=1, speculative=None, hisparse=HS(device_buffer_size=64)),
        lambda: dict(page_size=0, speculative=None),
    ),
    ("max_context_len", lambda: dict(max_context_len=1), lambda: dict(max_context_len=0)),
    ("max_running_requests", lambda: dict(max_running_requests=1), lambda: dict(max_running_requests=0)),
    (
        "device_pool_tokens",
        lambda: dict(device_pool_tokens=16384 + 16),
        lambda: dict(device_pool_tokens=16384 + 8),
    ),
    ("seed", lambda: dict(seed=-3), lambda: dict(seed=1.5)),
    (
        "hisparse.device_buffer_size",
        lambda: dict(hisparse=HS(device_buffer_size=16)),
        lambda: dict(hisparse=HS(device_buffer_size=24)),
    ),
    (
        "hisparse.device_buffer_size",
        lambda: dict(hisparse=HS(device_buffer_size=64, top_k=64)),
        lambda: dict(hisparse=HS(device_buffer_size=48, top_k=64)),
    ),
    (
        "hisparse.host_to_device_ratio",
        lambda: dict(hisparse=HS(host_to_device_ratio=1), max_context_len=4096),
        lambda: dict(hisparse=HS(host_to_device_ratio=0)),
    ),
    ("hisparse.top_k", lambda: dict(hisparse=HS(top_k=1)), lambda: dict(hisparse=HS(top_k=0))),
    (
        "speculative.num_steps",
        lambda: dict(speculative=SP(num_steps=1)),
        lambda: dict(speculative=SP(num_steps=0)),
    ),
    (
        "speculative.num_draft_tokens",
        lambda: dict(speculative=SP(num_steps=3, num_draft_tokens=4)),
        lambda: dict(speculative=SP(num_steps=3, num_draft_tokens=5)),
    ),
    (
        "speculative.eagle_topk",
        lambda: dict(speculative=SP(eagle_topk=1), page_size=16),
        lambda: dict(speculative=SP(eagle_topk=2), page_size=16),
    ),
    (
        "speculative.eagle_topk",
        lambda: dict(speculative=SP(eagle_topk=1), page_size=1, hisparse=None, device_pool_tokens=4100),
        lambda: dict(speculative=SP(eagle_topk=2), page_size=1, hisparse=None, device_pool_tokens=4100),
    ),
    # verify tokens live in the draft zone: D <= page_size - 1
    (
        "speculative.num_draft_tokens",
        lambda: dict(page_size=8, speculative=SP(num_steps=6)),
        lambda: dict(page_size=8, speculative=SP(num_steps=7)),
    ),
    # one device buffer fits: S >= HOT + P
    (
        "device_pool_tokens",
        lambda: dict(max_context_len=64, device_pool_tokens=144, hisparse=HS(host_to_device_ratio=1)),
        lambda: dict(max_context_len=64, device_pool_tokens=128, hisparse=HS(host_to_device_ratio=1)),
    ),
    # a prefill is dense in the device pool: S >= roundup(max_context_len, P)
    (
        "device_pool_tokens",
        lambda: dict(max_context_len=1024, device_pool_tokens=1024),
        lambda: dict(max_context_len=1025, device_pool_tokens=1024),
    ),
    # logical / host pools hold one request of max_context_len plus the draft tokens
    (
        "hisparse.host_to_device_ratio",
        lambda: dict(max_context_len=2044, device_pool_tokens=2048, hisparse=HS(host_to_device_ratio=1)),
        lambda: dict(max_context_len=2045, device_pool_tokens=2048, hisparse=HS(host_to_device_ratio=1)),
    ),
    # without HiSparse every token is resident
    (
        "device_pool_tokens",
        lambda: dict(hisparse=None, max_context_len=4092, device_pool_tokens=4096),
        lambda: dict(hisparse=None, max_context_len=4093, device_pool_tokens=4096),
    ),
]


@pytest.mark.parametrize(("field", "good", "bad"), RULES, ids=[f"{i}-{r[0]}" for i, r in enumerate(RULES)])
def test_rule_boundary(field, good, bad):
    EngineConfig(**good())
    with pytest.raises(ConfigError) as info:
        EngineConfig(**bad())
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}=")
    assert isinstance(info.value, ValueError)


MODEL_RULES = [
    # (field, kwargs for check_against_model that pass, that fail, config)
    ("hisparse", dict(index_topk=64), dict(index_topk=None), EngineConfig()),
    ("hisparse.top_k", dict(index_topk=64), dict(index_topk=32), EngineConfig(hisparse=HS(top_k=64))),
    ("hisparse.device_buffer_size", dict(index_topk=128), dict(index_topk=129), EngineConfig()),
    ("speculative", dict(has_mtp=True), dict(has_mtp=False), EngineConfig()),
    ("max_context_len", dict(max_positions=4096), dict(max_positions=4095), EngineConfig()),
]


@pytest.mark.parametrize(("field", "good", "bad", "config"), MODEL_RULES, ids=[r[0] for r in MODEL_RULES])
def test_model_rule_boundary(field, good, bad, config):
    base = dict(index_topk=64, has_mtp=True, max_positions=None)
    check_against_model(config, **{**base, **good})
    with pytest.raises(ConfigError) as info:
        check_against_model(config, **{**base, **bad})
    assert info.value.field == field


def test_config_is_frozen():
    config = EngineConfig()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.page_size = 8  # type: ignore[misc]


def test_no_speculation_and_no_hisparse_are_allowed():
    config = EngineConfig(hisparse=None, speculative=None)
    plan = config.memory_plan(64)
    assert plan.hot == 0 and plan.draft_tokens == 0 and not plan.hisparse


pages = st.sampled_from([1, 2, 4, 8, 16, 32])
configs = st.builds(
    EngineConfig,
    page_size=pages,
    max_context_len=st.integers(1, 5000),
    max_running_requests=st.integers(1, 64),
    device_pool_tokens=st.integers(1, 40).map(lambda n: n * 256),
    hisparse=st.none()
    | st.builds(
        HS,
        device_buffer_size=st.integers(1, 16).map(lambda n: n * 32),
        host_to_device_ratio=st.integers(1, 8),
    ),
    speculative=st.none() | st.builds(SP, num_steps=st.integers(1, 8)),
)


@given(data=st.data(), top_k=st.sampled_from([8, 32, 64, 128, 256]))
def test_every_accepted_config_satisfies_the_memory_layers_assumptions(data, top_k):
    try:
        config = data.draw(configs)
        check_against_model(config, index_topk=top_k, has_mtp=True, max_positions=None)
    except ConfigError:
        return
    plan = config.memory_plan(top_k)
    p = plan.page_size
    need = -(-plan.max_request_len // p) * p
    assert plan.device_tokens % p == 0 and plan.logical_tokens % p == 0
    assert plan.logical_tokens >= need, "one request's locations fit"
    if plan.hisparse:
        assert plan.hot % p == 0 and plan.hot >= plan.top_k, "swap-in always has evictable columns"
        assert plan.buffer_columns == plan.hot + p
        assert plan.device_tokens >= plan.buffer_columns, "one device buffer fits"
        assert plan.device_tokens >= -(-plan.max_context_len // p) * p, "one prefill fits"
        assert plan.host_tokens >= need, "one request's host copy fits"
        assert plan.draft_tokens <= p - 1, "verify tokens fit the draft zone"
    else:
        assert plan.device_tokens >= need, "one request fits, resident"
    if config.speculative is not None:
        assert plan.draft_tokens == config.speculative.num_steps + 1


def test_an_injected_model_must_match_the_configured_dtype(tiny_model):
    from pipeline.executor import Executor

    with pytest.raises(ConfigError) as info:
        Executor(EngineConfig(dtype="float32", max_context_len=512, device_pool_tokens=1024), model=tiny_model)
    assert info.value.field == "dtype"
