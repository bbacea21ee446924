"""The command line's mistakes are one line and status 2: no command, ``hispec plan`` against a
DeepSeek-V3.2-like ``config.json``, ``hispec serve --port``, an empty ``hispec chat --message``; and a
closed stdout ends a command quietly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline
from pipeline.cli import CLOSED_STDOUT
from pipeline.cli import main as cli

ROOT = Path(pipeline.__file__).resolve().parents[1]
HANG = 120  # seconds: only against a hang, never a measure
PAST_POSITIONS = "must be <= the model's max_position_embeddings"

# DeepSeek-V3.2's config.json (the fields the loader reads): what plan reads, without any weights
V32_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


@pytest.fixture
def v32(tmp_path) -> str:
    path = tmp_path / "deepseek-v3.2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(V32_CONFIG))
    return str(path)


def one_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    return captured.err


def run(*args: str, stdout: int = subprocess.PIPE) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pipeline.cli", *args]
    return subprocess.run(command, cwd=ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=HANG)


def test_no_command_and_no_bench_target_print_the_choices_and_exit_2(capsys):
    for argv in ([], ["-v"]):
        assert cli(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith("usage: hispec") and "plan" in captured.err
    assert cli(["bench"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: hispec bench") and "capacity" in captured.err
    assert cli(["--help"]) == 0 and "usage: hispec" in capsys.readouterr().out  # asked for: no mistake


def test_plan_of_a_v32_config_takes_a_hot_that_holds_its_top_k(v32, tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    argv = ["plan", "--model", v32, "--dtype", "bfloat16", "--context", "8192", "--device-memory", "8GB"]
    assert cli([*argv, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "--hot unset: HOT 2048 holds the model's index_topk of 2048" in out
    assert "HiSparse (HOT 2048, page 16," in out
    payload = json.loads(out_json.read_text())
    assert payload["hot"] == 2048 and all(hot >= 2048 for hot in map(int, payload["trade_offs"]["hot"]))
    assert cli([*argv, "--hot", "4096"]) == 0
    out = capsys.readouterr().out
    assert "HiSparse (HOT 4096, page 16," in out and "--hot unset" not in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--context", "200000"], f"--context=200000: {PAST_POSITIONS} (163840)"),
        (["--context", "0"], "--context=0: must be >= 1"),
        (["--max-context-len", "163841"], f"--max-context-len=163841: {PAST_POSITIONS}"),
        (["--max-context-len", "4096"], "--max-context-len=4096: must be >= --context (8192)"),
        (["--hot", "128"], "--hot=128: must be >= the model's index_topk (2048)"),
        (["--hot", "2056"], "--hot=2056: must be a multiple of --page-size (16)"),
        (["--page-size", "0"], "--page-size=0: must be >= 1"),
        (["--ratio", "0"], "hisparse.host_to_device_ratio=0: must be >= 1"),
        (["--num-steps", "0"], "speculative.num_steps=0: must be >= 1"),
        (["--chunked-prefill-tokens", "-1"], "chunked_prefill_tokens=-1: must be >= 1"),
        (["--device-memory-fraction", "0.5"], "device_memory_fraction=0.5: give device_memory_bytes or"),
        (["--device-memory", "1MB"],
         "device_memory_bytes=1000000: holds no request of max_context_len (8192)"),
    ],
)
def test_plan_mistakes_are_one_line_naming_the_option(v32, capsys, flags, message):
    argv = ["plan", "--model", v32, "--dtype", "bfloat16", "--context", "8192", "--device-memory", "8GB"]
    assert cli([*argv, *flags]) == 2
    assert one_line(capsys).startswith(f"hispec plan: {message}")


def test_plan_of_the_bundled_model_refuses_a_context_past_its_positions(capsys):
    assert cli(["plan", "--context", "5000"]) == 2
    assert one_line(capsys) == f"hispec plan: --context=5000: {PAST_POSITIONS} (4096)\n"
    assert cli(["plan", "--context", "2048", "--hot", "32"]) == 2
    assert one_line(capsys).startswith("hispec plan: --hot=32: must be >= the model's index_topk (64)")


@pytest.mark.parametrize("port", ["99999", "-1", "65536", "http"])
def test_serve_refuses_a_port_out_of_range_in_one_line(capsys, port):
    pytest.importorskip("uvicorn")
    assert cli(["serve", "--port", port]) == 2
    err = one_line(capsys)
    assert err.startswith("hispec serve: --port=") and "from 0 to 65535" in err


def test_serve_on_a_port_in_use_is_one_line_naming_the_address(capsys):
    pytest.importorskip("uvicorn")
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = one_line(capsys)
    assert err.startswith(f"hispec serve: cannot listen on 127.0.0.1:{port}: "), err


@pytest.mark.parametrize(("option", "value", "rule"), [
    ("--router-cache-threshold", "2", "must be a number from 0 to 1"),
    ("--router-cache-threshold", "x", "must be a number from 0 to 1"),
    ("--router-balance-abs-threshold", "-1", "must be an integer of at least 0"),
    ("--router-balance-rel-threshold", "0.5", "must be a number of at least 1"),
])  # fmt: skip
def test_serve_refuses_a_router_threshold_out_of_range_in_one_line(capsys, option, value, rule):
    pytest.importorskip("uvicorn")
    assert cli(["serve", "--dp", "2", option, value]) == 2
    err = one_line(capsys)
    assert err.startswith(f"hispec serve: {option}=") and rule in err, err


def test_serve_takes_port_0_for_any_free_port():
    pytest.importorskip("uvicorn")
    from pipeline.server.serve import build_parser

    assert build_parser().parse_args(["--port", "0"]).port == 0
    assert build_parser().parse_args(["--port", "65535"]).port == 65535


@pytest.mark.parametrize("message", ["", "   "])
def test_chat_refuses_an_empty_message_before_loading_the_model(message):
    # it used to go round its loop for ever, one core busy; now it stops before the model loads
    done = run("chat", "--message", message)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"hispec chat: --message={message!r}: must hold some text\n"


def test_a_closed_stdout_ends_a_command_quietly():
    # the reader of the pipe has gone before the command writes (as `hispec plan | head` once head
    # has its lines): no "Broken pipe" line, the status a shell gives a program SIGPIPE ended
    read, write = os.pipe()
    os.close(read)
    try:
        done = run("plan", "--context", "2048", "--device-memory", "32MB", stdout=write)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (CLOSED_STDOUT, "")


def test_a_broken_pipe_in_a_command_is_no_error_line(monkeypatch, capsys):
    def closed(argv):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("pipeline.plan.main", closed)
    assert cli(["plan"]) == CLOSED_STDOUT
    assert capsys.readouterr().err == ""


def test_plan_of_a_v32_config_with_an_fp8_kv_cache_counts_656_and_132_bytes(v32, tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    argv = ["plan", "--model", v32, "--dtype", "bfloat16", "--context", "131072", "--device-memory", "40GB",
            "--hot", "4096"]
    assert cli([*argv, "--kv-cache-dtype", "fp8_e4m3", "--json", str(out_json)]) == 0
    assert "KV cache fp8_e4m3 (656 + 132 bytes a layer a position)" in capsys.readouterr().out
    fp8 = json.loads(out_json.read_text())["plans"]
    layers = V32_CONFIG["num_hidden_layers"] + V32_CONFIG["num_nextn_predict_layers"]  # (resident keeps MTP)
    unit = {s["name"]: s["unit_bytes"] for s in fp8["resident"]["structures"]}
    assert unit["KV rows (target and draft layers)"] == layers * 656
    assert unit["indexer keys"] == layers * 132
    unit = {s["name"]: s["unit_bytes"] for s in fp8["hisparse"]["structures"]}
    assert unit["device KV rows"] == 61 * 656 and unit["draft layer KV rows"] == 656
    assert cli([*argv, "--json", str(out_json)]) == 0  # the same budget, bfloat16 rows and keys
    assert "KV cache auto (1152 + 256 bytes a layer a position)" in capsys.readouterr().out
    plain = json.loads(out_json.read_text())["plans"]
    for name in ("resident", "hisparse"):
        assert fp8[name]["seats"] > plain[name]["seats"]
