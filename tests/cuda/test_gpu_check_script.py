"""The device check's script on a CPU, in pieces small enough for the suite (these tests are not
marked ``cuda``: ``hispec bench gpu-check`` must work before any device runs it)."""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from pipeline.benchmarks import gpu_check
from pipeline.benchmarks.gpu_check import Budget, SweepCosts

# sweep_s=0: the least sweep (two loads, two repeats), whatever its runs cost here
TINY = attrs.evolve(gpu_check.CPU, context=192, new_tokens=4, top_k=16, hot=32, repeats=2, swap_calls=3,
                    seat_cap=2, seat_new_tokens=4, sweep_context=128, sweep_new_tokens=4, sweep_s=0)


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


@pytest.mark.slow  # a whole benchmark run: `make test-all`
def test_the_benchmark_at_tiny_sizes(capsys):
    """Every part runs; every swap-in position misses; the budget seats two resident requests or
    more (a tiny context's fixed costs take a share) and more with HiSparse; the dynamic residency
    sweep serves one request and a load only HiSparse seats, every variant alternating twice, with
    the paired ratios; the report has a row per figure and the sweep's table."""
    device = torch.device("cpu")
    budget = Budget(600.0)
    parts = gpu_check.benchmark(TINY, device, budget, seed=0)
    assert budget.outcomes == {"model": "ran", "swap-in": "ran", "decode": "ran", "budget": "ran",
                               "dynamic sweep": "ran"}
    swap, decode, seats, sweep = parts["swap_in"], parts["decode"], parts["budget"], parts["sweep"]
    assert swap is not None and decode is not None and seats is not None and sweep is not None
    assert swap["all_missed"]
    assert swap["host_copies"] == gpu_check.host_copies(False, None)  # (no pinned memory on a CPU)
    assert swap["bytes_per_call"] == TINY.swap_requests * TINY.top_k * swap["row_bytes"]
    assert decode["repeats"] == TINY.repeats and decode["misses_per_token"] > 0
    assert seats["seats"]["hisparse"] > seats["seats"]["resident"] >= 2
    for run in seats["runs"].values():
        assert run["output_tokens"] == seats["requests"] * TINY.seat_new_tokens
    assert sweep["repeats"] == 2 and sweep["note"] == ""
    assert sweep["seats"]["hisparse"] == sweep["seats"]["dynamic"] > sweep["seats"]["resident"]
    top = min(3 * sweep["seats"]["resident"], sweep["seats"]["hisparse"])
    assert sweep["counts"] == list(sweep["points"]) == [1, top]
    assert [point["seated_by"] for point in sweep["points"].values()] == ["resident", "hisparse"]
    for n, point in sweep["points"].items():
        assert set(point["results"]) == {"resident", "hisparse", "dynamic"}
        for run in point["results"].values():
            assert run["all_tokens"] and run["output_tokens"] == n * TINY.sweep_new_tokens
        assert set(point["ratios"]) == {"hisparse / resident", "dynamic / resident", "dynamic / hisparse",
                                        "dynamic / best of resident, hisparse"}
    assert [row[0] for row in sweep["table"]["rows"]] == [1, top]
    rows = gpu_check.report_rows(None, swap, decode, seats, sweep)
    assert len(rows) == 6 and rows[-1][0].startswith(f"dynamic sweep, 1-{top} requests")


def test_the_sweep_keeps_the_most_loads_then_repeats_that_fit():
    """Loads from one request to three times resident's seats (or HiSparse's seats where fewer);
    what fits the time wanted: points before repeats, never fewer than two of either."""
    seats = {"resident": 2, "hisparse": 6, "dynamic": 6}
    assert gpu_check.sweep_counts(seats, 4) == [1, 2, 4, 6]
    assert gpu_check.sweep_counts(seats, 3) == [1, 2, 6]
    assert gpu_check.sweep_counts(seats, 2) == [1, 6]
    assert gpu_check.sweep_counts({**seats, "hisparse": 4}, 4) == [1, 2, 3, 4]
    assert gpu_check.sweep_counts({**seats, "hisparse": 2}, 3) == [1, 2, 6]  # none only HiSparse holds
    one = {v: (3.0, 2.0) for v in seats}  # 1 s to start and stop, 2 s serving one request
    costs = SweepCosts.measured(one, step_s=0.25, new_tokens=4)  # 1 s of decode steps: 1 s of prefill
    assert costs.run_s("resident", 6, 2) == 1 + 6 * 1 + 3 * 1.5
    assert costs.sweep_s([1, 6], seats, 2) == 2 * (3 * 3.5 + costs.run_s("resident", 6, 2) + 2 * 8.5)
    full = gpu_check.CUDA
    assert gpu_check.fit_sweep(full, costs, seats, 1e9) == ([1, 2, 4, 6], full.sweep_repeats)
    four = costs.sweep_s([1, 2, 4, 6], seats, 2)
    assert gpu_check.fit_sweep(full, costs, seats, four) == ([1, 2, 4, 6], 2)
    assert gpu_check.fit_sweep(full, costs, seats, four - 1)[0] == [1, 2, 6]
    assert gpu_check.fit_sweep(full, costs, seats, 0) == ([1, 6], 2)


def test_the_command_writes_its_json(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--skip-tests", "--skip-bench", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "no CUDA device: running at CPU sizes" in printed or "CUDA device:" in printed
    assert "result: PASS" in printed
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["tests"] is None
