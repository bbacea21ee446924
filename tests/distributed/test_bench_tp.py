"""``hispec bench tp`` plumbing: TP 1 and TP 2 run the same batch, give the same tokens (float64),
and only TP 2 spends time in collectives (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from pipeline.cli import main


@pytest.mark.slow  # two engines' start-up (spawned ranks): kept out of the default run's budget
def test_bench_tp_runs_tp1_and_tp2(tmp_path, capsys):
    out = tmp_path / "tp.json"
    args = ["--dtype", "float64", "--concurrency", "2", "--prompt-len", "8", "--new-tokens", "3"]
    args += ["--repeats", "1"]
    assert main(["bench", "tp", *args, "--out", str(out)]) == 0
    assert "| TP |" in capsys.readouterr().out
    one, two = json.loads(out.read_text())["rows"]
    assert (one["tp"], two["tp"]) == (1, 2)
    assert two["outputs_equal_tp1"] is True
    assert one["collective_share"] == 0 and 0 < two["collective_share"] < 1
    assert one["tokens_per_s"] > 0 and two["tokens_per_s"] > 0
