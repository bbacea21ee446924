"""The user checkpoint served through the Engine with the default configuration: greedy ids and text
as HF's, end tokens, stop strings, chat, and the defaults taken from the model."""

from __future__ import annotations

import io

import anyio
import pytest
import structlog
import torch
from _hf_oracle import hf_float64_patches

from pipeline import ConfigError, Engine, EngineConfig, SamplingParams, SpeculativeConfig
from pipeline.errors import RequestError
from pipeline.logs import configure_logging

NEW = 16


def serve(checkpoint, body, **config):
    async def main():
        async with Engine(EngineConfig(model=str(checkpoint.path), dtype="float64", **config)) as engine:
            return await body(engine)

    return anyio.run(main)


def hf_generate(hf_model, prompt, new_tokens, **kw) -> list[int]:
    with torch.no_grad(), hf_float64_patches():
        out = hf_model.generate(
            torch.tensor([list(prompt)]), max_new_tokens=new_tokens, do_sample=False, **kw
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def runs(checkpoint):
    """Every engine request of this module in one engine: (name -> GenerateResult), plus streams."""
    ck = checkpoint
    prompt = list(ck.prompt_ids)

    async def body(engine):
        out = {"config": engine.config, "tokenizer": engine.tokenizer}
        requests = {
            "default": (prompt, SamplingParams(max_new_tokens=NEW)),
            "ignore_eos": (prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True)),
            "only_eos": (
                prompt,
                SamplingParams(max_new_tokens=NEW, ignore_eos=True, stop_token_ids=(ck.eos_id,)),
            ),
            "text": ("the quick brown fox", SamplingParams(max_new_tokens=NEW)),
        }
        for name, (p, params) in requests.items():
            out[name] = await engine.generate_text(p, params)
        deltas = [
            d async for d in engine.generate(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        ]
        out["deltas"] = deltas
        return out

    return serve(checkpoint, body)


def test_greedy_ids_and_text_equal_hf(runs, checkpoint, hf_model, hf_tokenizer):
    prompt = list(checkpoint.prompt_ids)
    hf_default = hf_generate(hf_model, prompt, NEW)  # stops at generation_config's end ids
    hf_all = hf_generate(hf_model, prompt, NEW, eos_token_id=None)
    assert list(runs["default"].token_ids) == hf_default
    assert list(runs["ignore_eos"].token_ids) == hf_all and len(hf_all) == NEW
    assert list(runs["text"].token_ids) == hf_default  # the string prompt encodes as HF's (with <s>)
    for name, ids in (("default", hf_default), ("ignore_eos", hf_all)):
        assert runs[name].text == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_the_first_end_id_ends_the_request(runs, checkpoint):
    result = runs["default"]
    assert result.finish_reason == "stop"
    assert len(result.token_ids) == checkpoint.end_at + 1 and result.token_ids[-1] == checkpoint.end_id


def test_ignore_eos_ignores_the_models_end_ids_but_not_stop_token_ids(runs, checkpoint):
    assert runs["ignore_eos"].finish_reason == "length"
    assert (
        checkpoint.end_id in runs["ignore_eos"].token_ids
        and checkpoint.eos_id in runs["ignore_eos"].token_ids
    )
    only = runs["only_eos"]
    assert only.finish_reason == "stop"
    assert len(only.token_ids) == checkpoint.eos_at + 1 and only.token_ids[-1] == checkpoint.eos_id
    assert list(only.token_ids) == list(runs["ignore_eos"].token_ids[: checkpoint.eos_at + 1])


def test_streamed_deltas_add_up_to_the_text(runs, hf_tokenizer):
    deltas = runs["deltas"]
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == list(runs["ignore_eos"].token_ids)
    assert (
        "".join(d.text for d in deltas)
        == runs["ignore_eos"].text
        == hf_tokenizer.decode(ids, skip_special_tokens=True)
    )
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"


def test_stop_strings_across_two_tokens_and_stop_token_ids(checkpoint, runs):
    tok = runs["tokenizer"]
    ids = list(runs["ignore_eos"].token_ids)
    pieces = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]

    # a stop string made of the last character of token k and the first of token k + 1, new at k + 1
    def spanning(k: int) -> str | None:
        if not (
            len(pieces[k + 1]) > len(pieces[k]) > len(pieces[k - 1]) and pieces[k + 1].startswith(pieces[k])
        ):
            return None
        stop = pieces[k][-1] + pieces[k + 1][len(pieces[k])]
        return None if "\ufffd" in stop or stop in pieces[k] else stop

    k = next(k for k in range(1, len(ids) - 1) if spanning(k) is not None)
    stop = spanning(k)
    plain = [t for t in ids if t not in (checkpoint.eos_id, checkpoint.end_id)]
    stop_id = next(t for t in ids[2:] if t in plain and t != ids[0])

    async def body(engine):
        params = dict(max_new_tokens=NEW, ignore_eos=True)
        by_string = await engine.generate_text(
            list(checkpoint.prompt_ids), SamplingParams(stop=(stop,), **params)
        )
        by_id = await engine.generate_text(
            list(checkpoint.prompt_ids), SamplingParams(stop_token_ids=(stop_id,), **params)
        )
        return by_string, by_id

    by_string, by_id = serve(checkpoint, body)
    assert by_string.finish_reason == "stop" and list(by_string.token_ids) == ids[: k + 1]
    assert by_string.text == pieces[k + 1][: pieces[k + 1].index(stop)]
    at = ids.index(stop_id)
    assert by_id.finish_reason == "stop" and list(by_id.token_ids) == ids[: at + 1]
    assert by_id.text == tok.decode(ids[:at])  # the stop token is in token_ids, not in the text


def test_chat_prompt_is_the_chat_template_with_the_generation_prompt(checkpoint, hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the fox?"}]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]

    async def body(engine):
        assert engine.chat_prompt(messages) == expected
        chat = await engine.chat_text(messages, SamplingParams(max_new_tokens=6, ignore_eos=True))
        plain = await engine.generate_text(expected, SamplingParams(max_new_tokens=6, ignore_eos=True))
        streamed = [d async for d in engine.chat(messages, SamplingParams(max_new_tokens=6, ignore_eos=True))]
        return chat, plain, streamed

    chat, plain, streamed = serve(checkpoint, body)
    assert chat.metrics.num_prompt_tokens == len(expected)
    assert chat.token_ids == plain.token_ids and chat.text == plain.text
    assert "".join(d.text for d in streamed) == chat.text


def test_chat_without_a_template_is_a_request_error(tiny_model):
    async def main():
        async with Engine(EngineConfig(dtype="float64"), model=tiny_model) as engine:
            with pytest.raises(RequestError) as info:
                await engine.chat_text([{"role": "user", "content": "hi"}])
            return info.value

    assert anyio.run(main).field == "messages"


def test_defaults_from_a_model_without_mtp(checkpoint):
    with info_logs() as logs:
        plan = serve(checkpoint, lambda engine: _const(engine.plan))
    assert plan.speculative is None and plan.max_context_len == 256  # max_position_embeddings
    events = {e["event"]: e for e in logs}
    assert events["config.speculative"]["speculative"] == "off"
    assert "no MTP layer" in events["config.speculative"]["reason"]
    assert events["config.max_context_len"]["max_context_len"] == 256


def test_max_context_len_is_lowered_to_what_the_pools_hold(checkpoint):
    with info_logs() as logs:
        plan = serve(checkpoint, lambda engine: _const(engine.plan), hisparse=None, device_pool_tokens=128)
    assert plan.max_context_len == 128
    event = next(e for e in logs if e["event"] == "config.max_context_len")
    assert event["lowered_to_fit_the_pools"] and event["max_position_embeddings"] == 256


def test_explicit_speculation_on_a_model_without_mtp_is_refused(checkpoint):
    with pytest.raises(ConfigError) as info:
        serve(checkpoint, lambda engine: _const(None), speculative=SpeculativeConfig())
    assert info.value.field == "speculative"
    assert "speculative=None" in info.value.rule and "--no-spec" in info.value.rule


def test_a_model_with_mtp_speculates_by_default(tiny_model):
    async def main():
        async with Engine(EngineConfig(dtype="float64"), model=tiny_model) as engine:
            return engine.plan

    plan = anyio.run(main)
    assert plan.speculative == SpeculativeConfig()
    assert plan.max_context_len == tiny_model.cfg.max_position_embeddings


async def _const(value):
    return value


def info_logs():
    configure_logging(level="info", stream=io.StringIO())  # capture_logs keeps the level filter
    return structlog.testing.capture_logs()


def test_an_injected_model_with_the_checkpoints_tokenizer(checkpoint, runs, tokenizer):
    from pipeline.model import load_model

    model = load_model(checkpoint.path, dtype=torch.float64)

    async def main():
        async with Engine(EngineConfig(dtype="float64"), model=model, tokenizer=tokenizer) as engine:
            assert engine.tokenizer is tokenizer
            return await engine.generate_text("the quick brown fox", SamplingParams(max_new_tokens=NEW))

    result = anyio.run(main)
    assert result.token_ids == runs["text"].token_ids and result.text == runs["text"].text
