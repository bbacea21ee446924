"""Every bad input and configuration gets an error of hispec's own naming the field: a request's
mistakes a ``RequestError`` (the engine keeps serving), a configuration's a ``ConfigError`` raised
before anything is allocated."""

from __future__ import annotations

import json
import math
import shutil
import types

import anyio
import attrs
import pytest
import torch
from _reliability_util import small_config

import pipeline.preflight as preflight
import pipeline.startup as startup
from pipeline.config import EngineConfig, check_engine_options
from pipeline.engine import Engine
from pipeline.errors import ConfigError, RequestError
from pipeline.executor import Executor
from pipeline.model.config import BUNDLED_MODELS
from pipeline.model.tokenizer import ByteTokenizer
from pipeline.sampling import MIN_TEMPERATURE, SamplingParams, probabilities, sample
from pipeline.startup import plan_engine
from pipeline.validation import encode_prompt, validate_request

GIB = 1 << 30

# --- SamplingParams -------------------------------------------------------------------------------

BAD_PARAMS = [
    # (field, value)
    ("max_new_tokens", True),
    ("max_new_tokens", 0),
    ("max_new_tokens", -3),
    ("max_new_tokens", 2.0),
    ("max_new_tokens", "8"),
    ("temperature", True),
    ("temperature", math.inf),
    ("temperature", -math.inf),
    ("temperature", math.nan),
    ("temperature", -1.0),
    ("temperature", "0.7"),
    ("temperature", None),
    ("temperature", 10**400),  # an int beyond the float range
    ("top_p", True),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("top_p", math.inf),
    ("top_p", "1"),
    ("top_k", True),
    ("top_k", -1),
    ("top_k", 4.0),
    ("stop", "END"),  # a string, not a tuple of them
    ("stop", ("",)),
    ("stop", ("ok", 3)),
    ("stop", ["ok", ""]),
    ("stop", None),
    ("seed", True),
    ("seed", 1.5),
    ("seed", "7"),
    ("ignore_eos", "no"),
    ("ignore_eos", 1),
    ("ignore_eos", None),
]


@pytest.mark.parametrize(("field", "value"), BAD_PARAMS, ids=[f"{f}={v!r}"[:40] for f, v in BAD_PARAMS])
def test_a_bad_sampling_value_is_a_request_error_naming_its_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(RequestError) as info:
        params.validate()
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}=")


def test_good_sampling_values_pass_and_a_stop_list_becomes_a_tuple():
    for params in (
        SamplingParams(),
        SamplingParams(max_new_tokens=1, temperature=1, top_p=1, top_k=5, seed=-3, ignore_eos=True),
        SamplingParams(temperature=1e300, top_p=1e-9, seed=10**30),
        SamplingParams(stop=["a", "bc"]),
    ):
        params.validate()
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    hash(SamplingParams(stop=["a"]))  # frozen params stay hashable


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, MIN_TEMPERATURE / 2])
def test_a_temperature_below_the_minimum_is_greedy_and_never_breaks_sampling(temperature):
    params = SamplingParams(temperature=temperature)
    params.validate()
    assert params.greedy
    logits = torch.tensor([0.5, 3.0, 3.0, -1.0], dtype=torch.float64)
    assert sample(logits, params, None) == 1  # argmax, ties to the lowest id
    assert probabilities(logits, params).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert not torch.isfinite(logits / 1e-320).all()  # what dividing by such a temperature would give


def test_the_minimum_temperature_itself_samples():
    params = SamplingParams(temperature=MIN_TEMPERATURE)
    assert not params.greedy
    probs = probabilities(torch.tensor([0.0, 1e-6, 2.0]), params)
    assert torch.isfinite(probs).all() and probs.tolist() == [0.0, 0.0, 1.0]


# --- prompts and params of a request --------------------------------------------------------------

VOCAB, CONTEXT = 300, 32
BAD_REQUESTS = [
    # (what, prompt ids, params, field)
    ("bools", [True, False], SamplingParams(), "prompt"),
    ("one bool", [5, True], SamplingParams(), "prompt"),
    ("float ids", [1.0, 2.0], SamplingParams(), "prompt"),
    ("negative id", [3, -1], SamplingParams(), "prompt"),
    ("id = vocab", [3, VOCAB], SamplingParams(), "prompt"),
    ("string ids", ["a"], SamplingParams(), "prompt"),
    ("empty", [], SamplingParams(), "prompt"),
    ("too long", [1] * CONTEXT, SamplingParams(), "prompt"),
    ("not a list", "ab", SamplingParams(), "prompt"),
    ("params {}", [1, 2], {}, "params"),
    ("params None", [1, 2], None, "params"),
    ("params a dict of fields", [1, 2], {"temperature": 0.5}, "params"),
    ("bad params field", [1, 2], SamplingParams(temperature=True), "temperature"),
]


@pytest.mark.parametrize(
    ("prompt", "params", "field"), [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS]
)
def test_a_bad_request_is_a_request_error_naming_its_field(prompt, params, field):
    with pytest.raises(RequestError) as info:
        validate_request(prompt, params, vocab_size=VOCAB, max_context_len=CONTEXT)
    assert info.value.field == field


def test_a_good_request_passes():
    validate_request([0, VOCAB - 1] * 3, SamplingParams(), vocab_size=VOCAB, max_context_len=CONTEXT)
    validate_request((7,) * (CONTEXT - 1), SamplingParams(), vocab_size=VOCAB, max_context_len=CONTEXT)


@pytest.mark.parametrize("prompt", ["a\ud800b", "\udfff", b"ab", bytearray(b"ab"), 5, None, {"a": 1}, {1, 2}])
def test_a_prompt_that_is_neither_text_nor_ids_is_a_request_error(prompt):
    with pytest.raises(RequestError) as info:
        encode_prompt(prompt, ByteTokenizer())
    assert info.value.field == "prompt"


def test_a_lone_surrogate_is_reported_with_its_place():
    with pytest.raises(RequestError, match=r"not valid Unicode text.*at character 3"):
        encode_prompt("abc\ud800", ByteTokenizer())
    assert encode_prompt("é", ByteTokenizer()) == [0xC3, 0xA9]
    assert encode_prompt((1, 2), ByteTokenizer()) == [1, 2]


@pytest.mark.asyncio
async def test_the_engine_refuses_bad_requests_at_the_call_and_keeps_serving(tiny_model):
    """The cases of the issue through the public API: each fails at ``generate`` with the field
    named, nothing is recorded, and a good request afterwards is served; a temperature of 1e-320
    is greedy and produces exactly the greedy tokens."""
    bad = [
        ([True, False], SamplingParams(max_new_tokens=2), "prompt"),
        ("ab", {}, "params"),
        ("a\ud800", None, "prompt"),
        ("", None, "prompt"),
        ("x" * 320, None, "prompt"),
        (b"ab", None, "prompt"),
        ("ab", SamplingParams(ignore_eos="no"), "ignore_eos"),
        ("ab", SamplingParams(temperature=math.inf), "temperature"),
        ("ab", SamplingParams(temperature=True), "temperature"),
        ("ab", SamplingParams(top_p=True), "top_p"),
        ("ab", SamplingParams(max_new_tokens=True), "max_new_tokens"),
    ]
    async with Engine(small_config(), model=tiny_model) as engine:
        for prompt, params, field in bad:
            with pytest.raises(RequestError) as info:
                engine.generate(prompt, params)
            assert info.value.field == field, (prompt, params)
        assert not engine._registry.live
        greedy = await engine.generate_text("def f(x):", SamplingParams(max_new_tokens=6, ignore_eos=True))
        tiny = await engine.generate_text(
            "def f(x):", SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1e-320)
        )
    assert len(greedy.token_ids) == 6 and tiny.token_ids == greedy.token_ids
    assert engine.final_pool_counts == engine.initial_pool_counts


# --- engine keyword arguments ---------------------------------------------------------------------

GOOD_OPTIONS = dict(
    max_prefill_tokens=8192, max_undelivered_tokens=None, on_exit="abort", trace_path=None, queue_size=64
)
BAD_OPTIONS = [
    ("max_prefill_tokens", 0),
    ("max_prefill_tokens", -5),
    ("max_prefill_tokens", True),
    ("max_prefill_tokens", 100.0),
    ("max_undelivered_tokens", 0),
    ("max_undelivered_tokens", True),
    ("max_undelivered_tokens", "8"),
    ("on_exit", "wait"),
    ("on_exit", None),
    ("on_exit", ["abort"]),
    ("trace_path", 5),
    ("trace_path", ""),
    ("trace_path", "{missing}/topk.jsonl"),
    ("trace_path", "{dir}"),
    ("queue_size", 0),
    ("queue_size", -1),
    ("queue_size", math.inf),
    ("queue_size", True),
]


@pytest.mark.parametrize(("field", "value"), BAD_OPTIONS, ids=[f"{f}={v!r}" for f, v in BAD_OPTIONS])
def test_a_bad_engine_argument_is_a_config_error_naming_it(field, value, tmp_path):
    if isinstance(value, str):
        value = value.format(missing=tmp_path / "missing", dir=tmp_path)
    with pytest.raises(ConfigError) as info:
        Engine(EngineConfig(), **{**GOOD_OPTIONS, field: value})
    assert info.value.field == field


def test_good_engine_arguments_pass(tmp_path):
    check_engine_options(EngineConfig(), **GOOD_OPTIONS)
    options = dict(max_prefill_tokens=1, max_undelivered_tokens=1, on_exit="finish", queue_size=1)
    check_engine_options(EngineConfig(), **options, trace_path=tmp_path / "topk.jsonl")
    Engine(EngineConfig(), **options, trace_path=str(tmp_path / "topk.jsonl"))


def test_the_config_must_be_an_engine_config():
    with pytest.raises(ConfigError) as info:
        Engine("tiny")
    assert info.value.field == "config"


# --- configurations checked when the engine starts ------------------------------------------------


def enter(config: EngineConfig, **kwargs) -> None:
    async def main() -> None:
        async with Engine(config, **kwargs):
            pass

    anyio.run(main)


def start_error(config: EngineConfig, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        enter(config, **kwargs)
    return info.value


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_cuda_is_a_config_error_naming_device(tiny_model):
    assert start_error(EngineConfig(device="cuda")).field == "device"
    assert start_error(small_config(device="cuda", dtype="float32"), model=tiny_model).field == "device"


def test_a_model_that_is_not_a_model_is_a_config_error(tiny_model):
    assert start_error(small_config(), model="tiny").field == "model"
    elsewhere = types.SimpleNamespace(cfg=tiny_model.cfg, device=torch.device("meta"))
    err = start_error(small_config(), model=elsewhere)
    assert err.field == "model" and "configured device (cpu)" in str(err)


def test_model_paths_that_cannot_be_served_are_config_errors_naming_model(tmp_path):
    bundled = BUNDLED_MODELS["tiny"]
    assert start_error(EngineConfig(model=str(tmp_path / "missing"))).field == "model"
    (tmp_path / "empty").mkdir()
    assert start_error(EngineConfig(model=str(tmp_path / "empty"))).field == "model"
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"vocab_size": 3')  # a JSONDecodeError
    err = start_error(EngineConfig(model=str(tmp_path / "broken")))
    assert err.field == "model" and "not readable JSON" in str(err)
    (tmp_path / "yarn").mkdir()
    raw = json.loads((bundled / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "yarn" / "config.json").write_text(json.dumps(raw))
    err = start_error(EngineConfig(model=str(tmp_path / "yarn")))
    assert err.field == "model" and "yarn" in str(err)
    (tmp_path / "file").write_text("")
    assert start_error(EngineConfig(model=str(tmp_path / "file"))).field == "model"


def test_a_device_pool_beyond_any_memory_is_refused_before_allocating(tiny_model):
    """2**40 tokens: petabytes; refused with the machine's own figure, nothing allocated."""
    err = start_error(small_config(device_pool_tokens=2**40), model=tiny_model)
    assert err.field == "device_pool_tokens" and "PB" in str(err) and "available now" in str(err)
    err = start_error(EngineConfig(device_pool_tokens=2**40))  # the bundled model: read, not loaded
    assert err.field == "device_pool_tokens"


def test_too_many_request_rows_are_refused_naming_max_running_requests(tiny_model, monkeypatch):
    """10**7 rows of 4100 positions: the int64 tables alone are 328 GB each."""
    monkeypatch.setattr(preflight, "available_host_memory", lambda: 16 * GIB)
    err = start_error(EngineConfig(max_running_requests=10**7))
    assert err.field == "max_running_requests" and "token table 328.0 GB, host map 328.0 GB" in str(err)
    err = start_error(small_config(max_running_requests=10**7), model=tiny_model)
    assert err.field == "max_running_requests"


def test_the_memory_check_compares_device_and_host_separately_on_cuda(tiny_model):
    config = attrs.evolve(small_config(), device="cuda", dtype="bfloat16")
    device = plan_engine(config, tiny_model.cfg).device
    estimate = preflight.estimate_memory(config, device)
    fits = dict(host_available=estimate.host_bytes, device_available=estimate.device_bytes)
    assert preflight.check_memory(config, device, **fits) == estimate
    with pytest.raises(ConfigError, match="of cuda memory") as info:
        preflight.check_memory(
            config, device, **{**fits, "device_available": estimate.device_bytes - 1}
        )
    assert info.value.field == "device_pool_tokens"
    with pytest.raises(ConfigError, match="of host memory"):
        preflight.check_memory(config, device, **{**fits, "host_available": estimate.host_bytes - 1})
    # on a CPU machine the device pools are host memory: the sum must fit
    cpu = small_config()
    total = preflight.estimate_memory(cpu, plan_engine(cpu, tiny_model.cfg).device).total_bytes
    preflight.check_memory(cpu, plan_engine(cpu, tiny_model.cfg).device, host_available=total)
    with pytest.raises(ConfigError):
        preflight.check_memory(cpu, plan_engine(cpu, tiny_model.cfg).device, host_available=total - 1)


def _tensor_bytes(obj, seen: set[int], storages: dict[int, int], depth: int = 0) -> None:
    """Every tensor reachable from ``obj`` (storages counted once)."""
    if id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _tensor_bytes(item, seen, storages, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensor_bytes(item, seen, storages, depth + 1)
    elif attrs.has(type(obj)):
        for name in attrs.fields_dict(type(obj)):
            _tensor_bytes(getattr(obj, name, None), seen, storages, depth + 1)


@pytest.mark.parametrize(("hisparse", "num_steps"), [(True, 3), (True, None), (False, 3), (False, None)])
def test_the_estimate_is_what_the_memory_layer_allocates(tiny_model, hisparse, num_steps):
    config = small_config(hisparse=hisparse, num_steps=num_steps)
    estimate = preflight.estimate_memory(config, plan_engine(config, tiny_model.cfg).device)
    executor = Executor(config, model=tiny_model)
    storages: dict[int, int] = {}
    _tensor_bytes(executor.memory, set(), storages)
    executor.close()
    tensors = sum(a.num_bytes for a in estimate.allocations if a.name != "page lists")
    assert tensors == sum(storages.values())


def test_the_bundled_model_config_is_read_without_weights(tmp_path):
    shutil.copy(BUNDLED_MODELS["tiny"] / "config.json", tmp_path / "config.json")
    assert preflight.read_model_config(str(tmp_path)) == preflight.read_model_config("tiny")
    startup.preflight(EngineConfig(model=str(tmp_path)))  # config.json alone passes the preflight
