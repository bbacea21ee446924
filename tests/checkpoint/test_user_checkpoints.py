"""The checkpoints users bring, served as they are: DeepSeek-V3.2 and GLM-5 written by HF's
``save_pretrained`` (bfloat16, sharded), with an MTP layer, and re-saved with the MTP layer named in
``config.json`` but absent from the weights. ``serve`` takes ``speculative="auto"``; the sampling
defaults of ``generation_config.json``; ``--tokenizer``, ``--chat-template``, ``--max-model-len``;
the weights' progress bar."""

from __future__ import annotations

import io
import json
import re
import shutil
import sys

import anyio
import attrs
import pytest
import structlog
import torch

from pipeline import ConfigError, Engine, EngineConfig, SamplingParams, SpeculativeConfig
from pipeline.generate import build_parser as generate_parser
from pipeline.generate import main as generate_main
from pipeline.generate import sampling_params
from pipeline.model import CheckpointError, HFTokenizer, ModelConfig, load_model
from pipeline.model.config import tensor_names
from pipeline.model.generation_config import generation_defaults
from pipeline.model.weights import INDEX_FILE, read_header
from pipeline.server.serve import build_parser as serve_parser
from pipeline.server.serve import engine_config as serve_engine_config

PROMPT = "the quick brown fox"
OTHER_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
HELLO = [{"role": "user", "content": "hello"}]


def run(config: EngineConfig, body, **engine):
    async def main():
        async with Engine(config, **engine) as e:
            return await body(e)

    return anyio.run(main)


async def _plan(engine):
    return engine.plan


def serve_config(ck, *args: str) -> EngineConfig:
    """``hispec serve``'s engine configuration of these options on checkpoint ``ck`` (or a directory)."""
    path = getattr(ck, "path", ck)
    return serve_engine_config(serve_parser().parse_args(["--model", str(path), *args]))


# ----- serve: speculative="auto"; an MTP layer named but absent ---------------------------------------
def test_serve_without_num_steps_is_auto_and_a_model_without_mtp_starts_plain(deepseek_checkpoint):
    config = serve_config(deepseek_checkpoint)
    assert config.speculative == "auto"
    assert (config.max_context_len, config.max_running_requests) == (256, 32)  # serve's own defaults
    assert run(config, _plan).speculative is None


def test_serve_speculates_on_a_checkpoint_with_an_mtp_layer(deepseek_mtp_checkpoint):
    assert ModelConfig.from_dir(deepseek_mtp_checkpoint.path).num_nextn_predict_layers == 1
    assert run(serve_config(deepseek_mtp_checkpoint), _plan).speculative == SpeculativeConfig()
    assert run(serve_config(deepseek_mtp_checkpoint, "--num-steps", "2"), _plan).speculative.num_steps == 2


def test_an_mtp_layer_named_but_absent_is_no_mtp_layer(resaved_checkpoint):
    cfg = ModelConfig.from_dir(resaved_checkpoint.path)
    assert (cfg.num_nextn_predict_layers, cfg.absent_mtp_layers) == (0, 1)
    assert "absent_mtp_layers" not in cfg.to_hf_dict()
    model = load_model(resaved_checkpoint.path, dtype=torch.float32)
    assert model.cfg.num_nextn_predict_layers == 0 and not model.mtp


def test_serve_on_a_resaved_checkpoint_turns_speculation_off_with_one_warning(resaved_checkpoint):
    with structlog.testing.capture_logs() as logs:
        plan = run(serve_config(resaved_checkpoint), _plan)
    assert plan.speculative is None
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"] for e in warnings] == ["model.mtp_missing"]
    assert warnings[0]["layer"] == 2 and warnings[0]["speculative"] == "off"


def test_no_spec_on_a_resaved_checkpoint_loads_and_generates(resaved_checkpoint):
    async def body(engine):
        return engine.config, await engine.generate_text(
            PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True)
        )

    with structlog.testing.capture_logs() as logs:
        config, result = run(serve_config(resaved_checkpoint, "--no-spec"), body)
    assert config.speculative is None and len(result.token_ids) == 4
    assert not [e for e in logs if e["log_level"] == "warning"]


def test_num_steps_on_a_resaved_checkpoint_is_a_config_error(resaved_checkpoint):
    with pytest.raises(ConfigError) as info:
        run(serve_config(resaved_checkpoint, "--num-steps", "2"), _plan)
    assert info.value.field == "speculative"
    assert "holds none of its tensors" in info.value.rule and "--no-spec" in info.value.rule


def test_a_partial_mtp_layer_is_a_checkpoint_error_naming_the_missing_tensors(
    deepseek_mtp_checkpoint, tmp_path
):
    from safetensors.torch import load_file, save_file

    ck = tmp_path / "partial"
    shutil.copytree(deepseek_mtp_checkpoint.path, ck)
    shard = ck / "model-00003-of-00003.safetensors"
    tensors = load_file(str(shard))
    dropped = "model.layers.2.eh_proj.weight"
    del tensors[dropped]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((ck / INDEX_FILE).read_text())
    del index["weight_map"][dropped]
    (ck / INDEX_FILE).write_text(json.dumps(index))
    assert ModelConfig.from_dir(ck).num_nextn_predict_layers == 1  # present in part: still there
    with pytest.raises(CheckpointError, match=r"tensors 1 missing \(model\.layers\.2\.eh_proj\.weight\)"):
        load_model(ck)


def test_tensor_names_come_from_the_index_or_the_headers(deepseek_checkpoint, tmp_path):
    path = deepseek_checkpoint.path
    shards = sorted(path.glob("*.safetensors"))
    in_headers = sorted(name for shard in shards for name in read_header(shard, path))
    assert sorted(tensor_names(path)) == in_headers
    for shard in shards:  # no index: every file's header
        shutil.copy(shard, tmp_path / shard.name)
    assert sorted(tensor_names(tmp_path)) == in_headers
    assert tensor_names(tmp_path / "nothing-here") is None


def test_a_glm_checkpoint_serves_with_its_defaults(glm_checkpoint):
    async def body(engine):
        return engine.plan, engine.generation_defaults, await engine.generate_text(PROMPT)

    plan, defaults, result = run(serve_config(glm_checkpoint, "--dtype", "float64"), body)
    assert plan.speculative is None and defaults == {
        k: v for k, v in glm_checkpoint.sampling.items() if k != "do_sample"
    }
    assert len(result.token_ids) <= 12  # its generation_config.json's max_new_tokens


# ----- generation_config.json: the sampling defaults ------------------------------------------------
def test_generation_defaults_and_default_sampling_params(deepseek_checkpoint):
    async def body(engine):
        return (
            engine.generation_defaults,
            engine.default_sampling_params(),
            engine.default_sampling_params(top_k=3),
        )

    defaults, params, overridden = run(EngineConfig(model=str(deepseek_checkpoint.path)), body)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert (params.temperature, params.top_p, params.top_k, params.max_new_tokens) == (0.6, 0.95, 20, 64)
    assert overridden.top_k == 3 and overridden.temperature == 0.6


def test_a_request_without_params_samples_with_the_checkpoints_defaults(deepseek_checkpoint):
    explicit = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=16)

    async def body(engine):
        implicit = await engine.generate_text(
            PROMPT, engine.default_sampling_params(max_new_tokens=16), request_id="r"
        )
        none = [d async for d in engine.generate(PROMPT, request_id="r")]
        given = await engine.generate_text(PROMPT, explicit, request_id="r")
        given_64 = await engine.generate_text(
            PROMPT, attrs.evolve(explicit, max_new_tokens=64), request_id="r"
        )
        return implicit, none, given, given_64

    config = EngineConfig(model=str(deepseek_checkpoint.path), dtype="float64", prefix_cache=False)
    implicit, none, given, given_64 = run(config, body)
    assert implicit.token_ids == given.token_ids  # the seed comes from the engine's and the request id
    assert tuple(t for d in none for t in d.token_ids) == given_64.token_ids


def test_no_generation_defaults_for_the_bundled_or_an_injected_model(tiny_model):
    assert run(EngineConfig(), lambda e: _value(e.generation_defaults)) == {}
    engine = Engine(EngineConfig(dtype="float64"), model=tiny_model)
    assert engine.generation_defaults == {} and engine.default_sampling_params() == SamplingParams()


async def _value(value):
    return value


def test_generation_config_rules(tmp_path):
    def defaults(**fields):
        (tmp_path / "generation_config.json").write_text(json.dumps(fields))
        return generation_defaults(tmp_path)

    assert generation_defaults(tmp_path) == {}  # no file
    assert defaults(eos_token_id=2, do_sample=True, temperature=0.7, top_p=None) == {"temperature": 0.7}
    assert defaults(do_sample=False, temperature=0.7, top_k=5) == {"temperature": 0.0, "top_k": 5}  # greedy
    assert defaults(temperature=1, top_p=1, repetition_penalty=1.1, max_new_tokens=9) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "repetition_penalty": 1.1,
        "max_new_tokens": 9,
    }
    for bad in (
        dict(top_p=1.5),
        dict(temperature=-1),
        dict(top_k=2.5),
        dict(max_new_tokens=0),
        dict(repetition_penalty=0),
        dict(do_sample="yes"),
        dict(temperature="hot"),
    ):
        with pytest.raises(ConfigError) as info:
            defaults(**bad)
        name = next(iter(bad))
        assert info.value.field == "model" and f"generation_config.json: {name}=" in info.value.rule


def test_a_bad_generation_config_stops_the_engine_at_start(deepseek_checkpoint, tmp_path):
    ck = tmp_path / "bad"
    shutil.copytree(deepseek_checkpoint.path, ck)
    (ck / "generation_config.json").write_text(json.dumps({"top_p": 2}))
    with pytest.raises(ConfigError, match=r"generation_config.json: top_p=2 must be a number in \(0, 1\]"):
        run(EngineConfig(model=str(ck)), _plan)


def test_cli_sampling_flags_fall_back_to_the_checkpoint_then_the_builtin_defaults():
    checkpoint = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    args = generate_parser().parse_args(["x"])
    assert (args.temperature, args.top_p, args.top_k, args.max_new_tokens) == (None, None, None, None)
    builtin = sampling_params(args)
    assert (builtin.temperature, builtin.top_p, builtin.top_k, builtin.max_new_tokens) == (0.0, 1.0, 0, 64)
    params = sampling_params(args, defaults=checkpoint)
    assert (params.temperature, params.top_p, params.top_k, params.max_new_tokens) == (0.6, 0.95, 20, 64)
    given = generate_parser().parse_args(["x", "--temperature", "0", "--top-k", "3", "--max-new-tokens", "5"])
    params = sampling_params(given, defaults={**checkpoint, "max_new_tokens": 12})
    assert (params.temperature, params.top_p, params.top_k, params.max_new_tokens) == (0.0, 0.95, 3, 5)
    from pipeline.chat import build_parser as chat_parser

    assert sampling_params(chat_parser().parse_args([])).max_new_tokens == 256


# ----- --tokenizer, --chat-template, --max-model-len --------------------------------------------------
@pytest.fixture
def template_file(tmp_path):
    path = tmp_path / "other.jinja"
    path.write_text(OTHER_TEMPLATE)
    return path


def test_chat_template_replaces_the_checkpoints(deepseek_checkpoint, template_file):
    async def body(engine):
        return engine.chat_prompt(HELLO), engine.tokenizer

    default, _ = run(EngineConfig(model=str(deepseek_checkpoint.path)), body)
    ids, tok = run(EngineConfig(model=str(deepseek_checkpoint.path), chat_template=str(template_file)), body)
    assert ids != default and tok.chat_template == OTHER_TEMPLATE
    assert ids == tok.encode("[user] hello\n[assistant] ", add_special_tokens=False)


def test_a_chat_template_gives_the_byte_level_model_a_chat(template_file):
    ids = run(EngineConfig(chat_template=str(template_file)), lambda e: _value(e.chat_prompt(HELLO)))
    assert ids == list(b"[user] hello\n[assistant] ")


def test_tokenizer_reads_the_tokenizer_files_from_another_directory(deepseek_checkpoint, tmp_path):
    bare, tokenizer_dir = tmp_path / "bare", tmp_path / "tokenizer"
    shutil.copytree(deepseek_checkpoint.path, bare)
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).rename(tokenizer_dir / name)

    async def body(engine):
        return (
            engine.tokenizer,
            engine.chat_prompt(HELLO),
            list((await engine.generate_text(PROMPT)).token_ids),
        )

    expected = run(EngineConfig(model=str(deepseek_checkpoint.path)), body)
    tok, ids, out = run(serve_config(bare, "--tokenizer", str(tokenizer_dir)), body)
    assert isinstance(tok, HFTokenizer) and tok.eos_token_ids == expected[0].eos_token_ids
    assert (ids, tok.vocab_size, out) == (expected[1], expected[0].vocab_size, expected[2])


def test_tokenizer_and_chat_template_are_checked(deepseek_checkpoint, tmp_path):
    with pytest.raises(ConfigError) as info:
        EngineConfig(tokenizer=str(tmp_path / "none"))
    assert info.value.field == "tokenizer"
    with pytest.raises(ConfigError) as info:
        EngineConfig(chat_template=str(tmp_path / "none.jinja"))
    assert info.value.field == "chat_template"
    with pytest.raises(ConfigError) as info:  # a directory without tokenizer files
        run(EngineConfig(model=str(deepseek_checkpoint.path), tokenizer=str(tmp_path)), _plan)
    assert info.value.field == "tokenizer" and "no tokenizer files" in info.value.rule
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError) as info:
        run(EngineConfig(model=str(deepseek_checkpoint.path), chat_template=str(broken)), _plan)
    assert info.value.field == "chat_template" and "not a valid Jinja template" in info.value.rule


@pytest.mark.parametrize("parser", [generate_parser, serve_parser])
def test_max_model_len_is_max_context_len(parser):
    prompts = ["x"] if parser is generate_parser else []
    given = parser().parse_args(
        [*prompts, "--max-model-len", "100", "--tokenizer", "t", "--chat-template", "c.j"]
    )
    same = parser().parse_args([*prompts, "--max-context-len", "100"])
    assert given.max_context_len == same.max_context_len == 100
    assert (given.tokenizer, given.chat_template) == ("t", "c.j")


# ----- the weights' progress bar --------------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_is_drawn_only_on_a_terminal(deepseek_checkpoint, capsys, monkeypatch):
    load_model(deepseek_checkpoint.path)
    assert capsys.readouterr().err == ""  # stderr is not a terminal
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    load_model(deepseek_checkpoint.path)
    assert "loading weights" in terminal.getvalue()
    load_model(deepseek_checkpoint.path, progress=False)
    monkeypatch.undo()
    load_model(deepseek_checkpoint.path, progress=True)
    assert "loading weights" in capsys.readouterr().err


# ----- hispec generate on the saved checkpoints: the same greedy text either way --------------------
def _generated(capsys, ck, *args: str) -> tuple[str, str]:
    """(the texts ``hispec generate --no-stream`` prints, the figures after them)."""
    argv = [
        "--model",
        str(ck.path),
        "--dtype",
        "float64",
        "--temperature",
        "0",
        "--max-new-tokens",
        "8",
        "--no-stream",
        *args,
        PROMPT,
    ]
    assert generate_main(argv) == 0
    texts, figures = re.split(r"\nlifecycle", capsys.readouterr().out)
    assert texts.startswith("--- req-0 (")
    return texts, figures


def test_generate_greedy_is_the_same_with_and_without_hisparse(deepseek_checkpoint, capsys):
    texts, figures = _generated(capsys, deepseek_checkpoint)
    assert "hisparse:" in figures and "speculative:" not in figures
    assert texts == _generated(capsys, deepseek_checkpoint, "--no-hisparse")[0]


def test_generate_greedy_is_the_same_with_and_without_speculation(deepseek_mtp_checkpoint, capsys):
    texts, figures = _generated(capsys, deepseek_mtp_checkpoint)
    assert "speculative:" in figures  # "auto": on, the checkpoint has an MTP layer
    plain, figures = _generated(capsys, deepseek_mtp_checkpoint, "--no-spec")
    assert plain == texts and "speculative:" not in figures
