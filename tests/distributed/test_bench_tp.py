"""``hispec bench tp`` plumbing: TP 1 and TP 2 run the same batch, give the same tokens (float64),
only TP 2 spends time in collectives (no timing is asserted), and TP 2's ranks hold the host KV of
TP 1 once between them (each its own with ``--no-shared-host-pool``)."""

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
    printed = capsys.readouterr().out
    assert "| TP |" in printed
    one, two = json.loads(out.read_text())["rows"]
    assert (one["tp"], two["tp"]) == (1, 2)
    assert two["outputs_equal_tp1"] is True
    assert one["collective_share"] == 0 and 0 < two["collective_share"] < 1
    assert one["tokens_per_s"] > 0 and two["tokens_per_s"] > 0
    assert "host KV MiB" in printed
    assert (one["processes"], two["processes"]) == (1, 2)
    assert two["host_kv_bytes"] == one["host_kv_bytes"] > 0  # one shared pool on the node
    assert two["pss_bytes"] > 0 and two["rss_bytes"] >= two["pss_bytes"]


@pytest.mark.slow
def test_bench_tp_without_a_shared_pool_counts_one_a_rank(tmp_path):
    out = tmp_path / "tp.json"
    args = ["--concurrency", "1", "--prompt-len", "8", "--new-tokens", "2", "--repeats", "1", "--no-spec"]
    assert main(["bench", "tp", *args, "--no-shared-host-pool", "--out", str(out)]) == 0
    one, two = json.loads(out.read_text())["rows"]
    assert two["host_kv_bytes"] == 2 * one["host_kv_bytes"] > 0
