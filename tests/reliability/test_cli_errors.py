"""The command line reports a user's mistake as one line on stderr with exit status 2 (a request or
engine failure: status 1), never a traceback unless ``-v`` asks for it; a bug still shows its
traceback. Every case runs ``pipeline.cli.main`` in-process."""

from __future__ import annotations

import json
import types

import pytest
import torch

import pipeline.cli as cli
from pipeline.errors import RequestError, RequestFailed
from pipeline.model.config import BUNDLED_MODELS


def run(capsys, argv: list[str]) -> tuple[int, list[str]]:
    status = cli.main(argv)
    return status, capsys.readouterr().err.splitlines()


def assert_one_line(capsys, argv: list[str], *fragments: str, status: int = 2) -> str:
    got, err = run(capsys, argv)
    assert got == status, err
    assert len(err) == 1 and "Traceback" not in err[0], err
    prog = "hispec " + (" ".join(argv[:2]) if argv[0] == "bench" else argv[0])
    assert err[0].startswith(f"{prog}: "), err
    for fragment in fragments:
        assert fragment in err[0], err
    return err[0]


@pytest.fixture()
def yarn_model(tmp_path):
    raw = json.loads((BUNDLED_MODELS["tiny"] / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "yarn").mkdir()
    (tmp_path / "yarn" / "config.json").write_text(json.dumps(raw))
    return str(tmp_path / "yarn")


# cases reported before any model is loaded
FAST_CASES = [
    (["generate", "abc", "--temperature", "-1"], "temperature=-1.0"),
    (["generate", "abc", "--temperature", "inf"], "temperature=inf"),
    (["generate", "abc", "--top-p", "2"], "top_p=2.0"),
    (["generate", "abc", "--top-k", "-1"], "top_k=-1"),
    (["generate", "abc", "--max-new-tokens", "0"], "max_new_tokens=0"),
    (["generate", "abc", "--num-steps", "16"], "speculative.num_steps=16"),
    (["generate", "abc", "--num-steps", "0"], "speculative.num_steps=0"),
    (["generate", "abc", "--max-context-len", "0"], "max_context_len=0"),
    (["generate", "abc", "--prefill-batch-tokens", "100"], "prefill_batch_tokens=100"),
    (
        ["generate", "abc", "--chunked-prefill-tokens", "0", "--prefill-batch-tokens", "600"],
        "with whole prompts",
    ),
    (["generate", "abc", "--model", "{tmp}/missing"], "model="),
    (["generate", "abc", "--model", "{tmp}"], "has no config.json"),
    (["generate", "abc", "--model", "{yarn}"], "yarn"),
    (["generate", "abc", "--log-json", "{tmp}/missing/run.jsonl"], "No such file or directory"),
    (["replay", "{tmp}/missing.jsonl", "--hot", "8"], "No such file or directory"),
    (["replay", "{trace}", "--hot", "8"], "more than hot=8"),
    (["replay", "{trace}", "--hot", "0"], "hot=0: must be >= 1"),
    (["replay", "{log}", "--hot", "8"], "not a top-k trace record"),
    (["replay", "{garbage}", "--hot", "8"], "Expecting value"),
    (["trace", "{tmp}/missing.jsonl"], "No such file or directory"),
    (["bench", "hisparse", "--hot", "3"], "hisparse.device_buffer_size=3"),
]


@pytest.mark.parametrize(("argv", "fragment"), FAST_CASES, ids=[" ".join(a)[:50] for a, _ in FAST_CASES])
def test_a_user_error_is_one_line_and_status_2(argv, fragment, capsys, tmp_path, yarn_model):
    trace = tmp_path / "topk.jsonl"
    record = {"request": "r", "layer": 0, "phase": "decode", "position": 40, "top_k": list(range(20))}
    trace.write_text(json.dumps(record) + "\n")
    (tmp_path / "log.jsonl").write_text('{"event": "Finished", "request_id": "r"}\n')
    (tmp_path / "garbage.jsonl").write_text("not json\n")
    names = dict(tmp=tmp_path, yarn=yarn_model, trace=trace, log=tmp_path / "log.jsonl")
    argv = [a.format(**names, garbage=tmp_path / "garbage.jsonl") for a in argv]
    assert_one_line(capsys, argv, fragment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_on_a_cpu_build_is_one_line(capsys):
    assert_one_line(capsys, ["generate", "abc", "--device", "cuda"], "device='cuda'", "CUDA is not available")


def test_request_errors_from_the_engine_are_unwrapped_from_their_task_group(capsys):
    """An empty and an over-long prompt fail inside the engine's task group: one line, both counted."""
    argv = ["generate", "", "x" * 40, "--max-context-len", "32", "--max-new-tokens", "2", "--no-spec"]
    line = assert_one_line(capsys, argv, "prompt=", "(and 1 more error)")
    assert "must not be empty" in line or "leaves no room" in line


def test_a_checkpoint_without_weights_is_one_line(capsys, tmp_path):
    (tmp_path / "config.json").write_text((BUNDLED_MODELS["tiny"] / "config.json").read_text())
    assert_one_line(capsys, ["generate", "abc", "--model", str(tmp_path)], str(tmp_path))


def test_verbose_adds_the_traceback_and_keeps_the_status(capsys, tmp_path):
    for argv in (
        ["-v", "replay", str(tmp_path / "x.jsonl"), "--hot", "8"],
        ["replay", str(tmp_path / "x.jsonl"), "--hot", "8", "-v"],
    ):
        status, err = run(capsys, argv)
        assert status == 2 and err[0].startswith("Traceback") and "FileNotFoundError" in "\n".join(err)
        assert err[-1].startswith("hispec replay: No such file or directory")


def test_argparse_errors_keep_their_usage_and_status_2(capsys):
    status, err = run(capsys, ["replay"])
    assert status == 2 and err[0].startswith("usage: hispec replay") and "required" in err[-1]
    status, err = run(capsys, ["generate", "abc", "--device", "tpu"])
    assert status == 2 and "invalid choice" in err[-1]
    assert cli.main(["--help"]) == 0


def fake_command(monkeypatch, error: BaseException) -> None:
    def main(argv):
        raise error

    monkeypatch.setitem(cli.COMMANDS, "fake", ("fake_cli_command", "raises"))
    monkeypatch.setitem(__import__("sys").modules, "fake_cli_command", types.SimpleNamespace(main=main))


def test_a_request_failure_is_one_line_and_status_1(monkeypatch, capsys):
    fake_command(monkeypatch, ExceptionGroup("tg", [RequestFailed("req-0", "RuntimeError: boom", ())]))
    assert_one_line(capsys, ["fake"], "request 'req-0' failed: RuntimeError: boom", status=1)


def test_a_bug_keeps_its_traceback(monkeypatch):
    fake_command(monkeypatch, RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["fake"])
    mixed = ExceptionGroup("tg", [RequestError("prompt", [], "must not be empty"), KeyError("bug")])
    fake_command(monkeypatch, mixed)
    with pytest.raises(ExceptionGroup):
        cli.main(["fake"])


def test_interrupt_is_one_line_and_status_130(monkeypatch, capsys):
    fake_command(monkeypatch, KeyboardInterrupt())
    assert run(capsys, ["fake"]) == (130, ["hispec fake: interrupted"])
