"""``hispec bench policy`` plumbing on a tiny run: traces of both modes replayed side by side, and
the end-to-end runs give identical tokens (no timing is asserted)."""

from __future__ import annotations

import json

from kernels.swap_in_policy import POLICIES
from pipeline.cli import main
from pipeline.hisparse.trace import read_trace


def test_bench_policy_replays_both_modes_and_runs_the_engine(tmp_path, capsys):
    out = tmp_path / "policy.json"
    args = ["--contexts", "100", "--hots", "64", "--requests", "2", "--new-tokens", "6", "--engine-hot", "64"]
    args += ["--repeats", "1", "--threads", "1", "--num-steps", "2", "--out", str(out)]
    args += ["--trace-dir", str(tmp_path / "traces")]
    assert main(["bench", "policy", *args]) == 0
    assert "tokens identical: True" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [(r["mode"], r["hot"]) for r in report["replays"]] == [("plain", 64), ("speculative", 64)]
    for rep in report["replays"]:
        floor = rep["policies"]["min"]["misses"]
        assert floor > 0 and all(p["misses"] >= floor for p in rep["policies"].values())
    assert report["best_online"] in POLICIES
    e2e = report["end_to_end"]
    assert e2e["tokens_identical"] and "lru" in e2e["policies"]
    assert e2e["default"] == "adaptive" and "adaptive" in e2e["policies"]  # the CPU default runs beside LRU
    assert report["best_online"] in e2e["policies"]
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        "topk-100-plain.jsonl", "topk-100-speculative.jsonl"
    ]
    phases = {r["phase"] for r in read_trace(tmp_path / "traces" / "topk-100-speculative.jsonl")}
    assert "verify" in phases  # the speculative trace records verify steps (rounds over 2 requests)
