"""``hispec generate`` and ``hispec chat`` on the user checkpoint with default options."""

from __future__ import annotations

import io
import re

import anyio
import pytest

from pipeline import Engine, EngineConfig, SamplingParams
from pipeline.cli import main as cli

PROMPT = "the quick brown fox"


def generate(checkpoint, *args):
    return cli(
        ["generate", "--model", str(checkpoint.path), "--dtype", "float64", "--max-new-tokens", "8", *args]
    )


def chat(checkpoint, *args):
    return cli(
        ["chat", "--model", str(checkpoint.path), "--dtype", "float64", "--max-new-tokens", "8", *args]
    )


def streamed(out: str, i: int = 0) -> tuple[str, str]:
    """(text between the header and the footer, the footer's finish reason) of request ``i``."""
    m = re.search(rf"--- req-{i} ---\n(.*)\n--- req-{i} \((\w+), \d+ tokens\) ---", out, re.S)
    assert m, out
    return m.group(1), m.group(2)


@pytest.fixture(scope="module")
def expected(checkpoint):
    async def main():
        async with Engine(EngineConfig(model=str(checkpoint.path), dtype="float64")) as engine:
            plain = await engine.generate_text(PROMPT, SamplingParams(max_new_tokens=8))
            ignore = await engine.generate_text(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True))
            hello = [{"role": "user", "content": "hello"}]
            answer = await engine.chat_text(hello, SamplingParams(max_new_tokens=8))
            return plain, ignore, answer

    return anyio.run(main)


def test_generate_streams_the_text_by_default(checkpoint, expected, capsys):
    assert generate(checkpoint, PROMPT) == 0
    text, reason = streamed(capsys.readouterr().out)
    assert text == PROMPT + expected[0].text and reason == expected[0].finish_reason == "stop"


def test_generate_no_stream_stop_ignore_eos_and_stdin(checkpoint, expected, capsys, monkeypatch):
    assert generate(checkpoint, PROMPT, "--no-stream", "--ignore-eos") == 0
    out = capsys.readouterr().out
    assert f"--- req-0 (length, 8 tokens) ---\n{PROMPT}{expected[1].text}\n" in out
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
    stop = expected[1].text[1:3]
    assert generate(checkpoint, "-", "--ignore-eos", "--stop", stop) == 0
    text, reason = streamed(capsys.readouterr().out)
    assert reason == "stop" and text == PROMPT + expected[1].text[: expected[1].text.index(stop)]


def test_generate_chat_applies_the_template(checkpoint, expected, capsys):
    assert generate(checkpoint, "hello", "--chat") == 0
    text, _ = streamed(capsys.readouterr().out)
    assert text == expected[2].text


def test_chat_one_message(checkpoint, expected, capsys):
    assert chat(checkpoint, "--message", "hello") == 0
    assert capsys.readouterr().out == expected[2].text + "\n"


def test_chat_interactive_streams_each_answer(checkpoint, expected, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/reset\n\nhello\n/exit\nnever read\n"))
    assert chat(checkpoint) == 0
    # after /reset the same message gets the same (greedy) answer
    assert capsys.readouterr().out == (expected[2].text + "\n") * 2


def test_user_errors_are_one_line_with_exit_2(checkpoint, tiny_model, capsys):
    assert chat(checkpoint, "--message", "hi", "--model", "tiny", "--dtype", "float32") == 2
    assert "has no chat template" in capsys.readouterr().err
    assert generate(checkpoint, PROMPT, "--num-steps", "2") == 2
    err = capsys.readouterr().err
    assert err.startswith("hispec generate: speculative=") and "--no-spec" in err


def test_version(capsys):
    assert cli(["--version"]) == 0 and capsys.readouterr().out.startswith("hispec ")
