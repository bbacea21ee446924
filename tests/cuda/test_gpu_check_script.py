"""The device check's script on a CPU, in pieces small enough for the suite (these tests are not
marked ``cuda``: ``hispec bench gpu-check`` must work before any device runs it)."""

from __future__ import annotations

import json

import attrs
import torch

from pipeline.benchmarks import gpu_check
from pipeline.benchmarks.gpu_check import Budget

TINY = attrs.evolve(gpu_check.CPU, context=192, new_tokens=4, top_k=16, hot=32, repeats=2, swap_calls=3,
                    seat_cap=2, seat_new_tokens=4)


def test_a_part_that_would_not_fit_is_skipped_and_one_that_raises_fails():
    budget = Budget(10.0)
    called = []
    assert budget.run("big", 60, lambda: called.append(1) or {}) is None
    assert called == [] and budget.outcomes["big"] == "skipped"

    def broken() -> dict:
        raise RuntimeError("no such kernel")

    assert budget.run("broken", 0, broken) is None
    assert budget.outcomes["broken"] == "failed" and "no such kernel" in budget.errors["broken"]
    ran = budget.run("fine", 0, lambda: {"x": 1})
    assert ran is not None and ran["x"] == 1 and budget.outcomes["fine"] == "ran"


def test_the_benchmark_at_tiny_sizes(capsys):
    """Every part runs; every swap-in position misses; the budget seats two resident requests or
    more (a tiny context's fixed costs take a share) and more with HiSparse; the report has a row
    per figure."""
    device = torch.device("cpu")
    budget = Budget(600.0)
    parts = gpu_check.benchmark(TINY, device, budget, seed=0)
    assert budget.outcomes == {"model": "ran", "swap-in": "ran", "decode": "ran", "budget": "ran"}
    swap, decode, seats = parts["swap_in"], parts["decode"], parts["budget"]
    assert swap is not None and decode is not None and seats is not None
    assert swap["all_missed"]
    assert swap["host_copies"] == gpu_check.host_copies(False, None)  # (no pinned memory on a CPU)
    assert swap["bytes_per_call"] == TINY.swap_requests * TINY.top_k * swap["row_bytes"]
    assert decode["repeats"] == TINY.repeats and decode["misses_per_token"] > 0
    assert seats["seats"]["hisparse"] > seats["seats"]["resident"] >= 2
    for run in seats["runs"].values():
        assert run["output_tokens"] == seats["requests"] * TINY.seat_new_tokens
    rows = gpu_check.report_rows(None, swap, decode, seats)
    assert len(rows) == 5


def test_the_command_writes_its_json(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--skip-tests", "--skip-bench", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "no CUDA device: running at CPU sizes" in printed or "CUDA device:" in printed
    assert "result: PASS" in printed
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["tests"] is None
