"""``hispec generate`` with a tiny checkpoint saved to a temporary directory, and ``hispec trace``
on the JSON log it wrote."""

from __future__ import annotations

from pipeline.cli import main as cli
from pipeline.logs import read_json_lines, replay
from pipeline.model import save_model
from statemachines.request import TERMINAL


def test_generate_then_trace(tiny_model, tmp_path, capsys):
    model_dir = save_model(tiny_model, tmp_path / "tiny", dtype="float64")
    log = tmp_path / "run.jsonl"
    argv = ["generate", "def fibonacci(n):", "hello", "--model", str(model_dir), "--dtype", "float64"]
    argv += ["--max-new-tokens", "12", "--log-json", str(log), "--temperature", "0.7", "--seed", "3"]
    assert cli(argv) == 0
    out = capsys.readouterr().out
    assert "--- req-0 (" in out and "--- req-1 (" in out and "def fibonacci(n):" in out
    trace = [line for line in out.splitlines() if line.strip().startswith("req-")]
    assert len(trace) == 2 and all("queued +0.000s > prefill" in line for line in trace)
    assert "hisparse:" in out and "speculative:" in out and "tokens/s" in out
    final = replay(read_json_lines(log))
    assert len(final) == 2 and all(state in TERMINAL for state in final.values())

    png, html = tmp_path / "timeline.png", tmp_path / "timeline.html"
    assert cli(["trace", str(log), "--out-png", str(png), "--out-html", str(html)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    page = html.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "req-1" in page
    assert cli(["trace", str(log)]) == 0  # default outputs beside the log
    assert log.with_suffix(".png").exists() and log.with_suffix(".html").exists()


def test_generate_plain_resident_with_an_injected_model(tiny_model, capsys):
    from pipeline.generate import main as generate

    argv = ["abc", "--no-spec", "--no-hisparse", "--max-new-tokens", "5", "--dtype", "float64"]
    assert generate(argv, model=tiny_model) == 0
    out = capsys.readouterr().out
    assert "(length, 5 tokens)" in out and "decode +" in out and "hisparse:" not in out


def test_trace_of_a_log_without_requests(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"event": "something else"}\nnot json\n')
    assert cli(["trace", str(empty)]) == 1


def test_generate_records_a_topk_trace_that_replay_reproduces(tiny_model, tmp_path, capsys):
    import json
    import re

    from pipeline.generate import main as generate

    trace = tmp_path / "topk.jsonl"
    prompt = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 3
    argv = [prompt, "--max-new-tokens", "16", "--ignore-eos", "--dtype", "float64", "--policy", "slide"]
    assert generate([*argv, "--topk-trace", str(trace)], model=tiny_model) == 0
    engine_misses = int(re.search(r"hisparse: \d+ hits, (\d+) misses", capsys.readouterr().out).group(1))
    assert engine_misses > 0
    assert cli(["replay", str(trace), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["results"][0]
    assert result["hot"] == 128 and result["policies"]["slide"]["misses"] == engine_misses
    assert cli(["replay", str(trace)]) == 0
    assert "slide (engine)" in capsys.readouterr().out


def test_trace_writes_the_html_without_matplotlib(tiny_model, tmp_path, capsys, monkeypatch):
    """matplotlib is not a base dependency: without it the HTML is still written and the missing PNG
    is one line (a failure only when a PNG was asked for by name); it once crashed and wrote neither."""
    import sys

    from pipeline.generate import main as generate

    log = tmp_path / "run.jsonl"
    assert generate(["abc", "--max-new-tokens", "4", "--dtype", "float64", "--log-json", str(log)],
                    model=tiny_model) == 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    capsys.readouterr()
    assert cli(["trace", str(log)]) == 0
    assert log.with_suffix(".html").read_text().startswith("<!DOCTYPE html>")
    assert not log.with_suffix(".png").exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib is not installed" in err
    assert cli(["trace", str(log), "--out-png", str(tmp_path / "t.png")]) == 2
