"""``hispec bench peer`` plumbing: HF's left-padded batches, the report, the missing-transformers path
(no timing is asserted anywhere)."""

from __future__ import annotations

import argparse
import builtins
import collections
import itertools
import json

import pytest

from pipeline.benchmarks import peer


def test_left_padding_puts_every_prompt_against_the_right_edge():
    ids, mask = peer.left_padded([[5, 6, 7], [8]], pad_id=256)
    assert ids.tolist() == [[5, 6, 7], [256, 256, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_paired_ratio_median_and_range():
    got = peer._paired([2.0, 3.0, 8.0], [1.0, 1.0, 2.0])
    assert got == {"median": 3.0, "min_max": [2.0, 4.0]}


def test_report_table(capsys):
    ratio = {"median": 1.5, "min_max": [1.25, 2.0]}
    row = dict(
        batch=8,
        prompt_len=64,
        hf_tokens_per_s=100.0,
        plain_tokens_per_s=150.0,
        spec_tokens_per_s=200.0,
        hf_ttft_s=0.5,
        plain_speed_vs_hf=ratio,
        spec_speed_vs_hf=ratio,
        plain_ttft_vs_hf=ratio,
        spec_ttft_vs_hf=ratio,
        plain_same_tokens_as_hf=True,
        spec_same_tokens_as_hf=False,
    )
    args = dict(dtype="float32", hot=64, spec_steps=3, new_tokens=64, repeats=3)
    peer.print_report(dict(model="tiny", machine=dict(threads=1), args=args, rows=[row]))
    out = capsys.readouterr().out
    assert "| 8 | 64 | 100 | 150 | 200 | 1.50x (1.25-2.00) |" in out
    assert out.rstrip().endswith("| yes, no |")


def test_without_transformers_it_says_how_to_install(monkeypatch, capsys):
    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    assert peer.main(["--repeats", "1"]) == 2
    assert "pip install 'hispec[bench]'" in capsys.readouterr().out


@pytest.mark.slow
def test_smoke_run_writes_a_report(tmp_path):
    out = tmp_path / "peer.json"
    args = [
        "--repeats",
        "1",
        "--new-tokens",
        "2",
        "--concurrency",
        "1",
        "--long-prompt-len",
        "0",
        "--out",
        str(out),
    ]
    assert peer.main(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert {name: len(row["runs"]["tokens_per_s"][name]) for name in peer.CONFIGS} == {
        "hf": 1,
        "plain": 1,
        "spec": 1,
    }


def test_warmup_runs_every_configuration_untimed_first(monkeypatch):
    """``--warmup`` runs each configuration before the repeats and keeps none of their figures."""
    calls = []

    def fake(name):
        def run(*args, **kwargs):
            calls.append(name if name == "hf" else ("spec" if kwargs.get("spec") else "plain"))
            return {"seconds": 1.0 if len(calls) > 3 else 100.0, "outputs": [[1, 2]], "ttft": 0.1}

        return run

    monkeypatch.setattr(peer, "run_hf", fake("hf"))
    monkeypatch.setattr(peer, "run_engine", fake("engine"))
    args = argparse.Namespace(seed=0, new_tokens=2, repeats=2, warmup=1)
    row = peer.measure(args, None, None, 0, batch=1, prompt_len=8)
    assert calls[:3] == ["hf", "plain", "spec"] and sorted(calls[3:]) == [
        "hf",
        "hf",
        "plain",
        "plain",
        "spec",
        "spec",
    ]
    assert row["runs"]["tokens_per_s"] == {
        name: [2.0, 2.0] for name in peer.CONFIGS
    }  # the slow warm-up left out


def test_over_six_repeats_each_configuration_runs_right_after_each_other_equally_often(monkeypatch):
    """The repeats go through every order of the three configurations: each runs first, second and
    third twice, and right after each other configuration (within a repeat) twice."""
    calls = []

    def fake(name):
        def run(*args, **kwargs):
            calls.append(name if name == "hf" else ("spec" if kwargs.get("spec") else "plain"))
            return {"seconds": 1.0, "outputs": [[1, 2]], "ttft": 0.1}

        return run

    monkeypatch.setattr(peer, "run_hf", fake("hf"))
    monkeypatch.setattr(peer, "run_engine", fake("engine"))
    peer.measure(
        argparse.Namespace(seed=0, new_tokens=2, repeats=6, warmup=0), None, None, 0, batch=1, prompt_len=8
    )
    repeats = [tuple(calls[i : i + 3]) for i in range(0, 18, 3)]
    assert sorted(repeats) == sorted(itertools.permutations(peer.CONFIGS))
    after = collections.Counter((r[i], r[i + 1]) for r in repeats for i in range(2))
    assert set(after.values()) == {2} and len(after) == 6
