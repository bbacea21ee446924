"""The short version of ``hispec bench soak --faults``: seeded workloads whose culprits meet the fault
points of ``pipeline.benchmarks.faults`` at random passages (admission, prefill forward, staging and
backup copies, swap-in, drafting, verify, finalize, sampling, release), with HiSparse and speculation
on and off and both ways a copy fails. No hang, only culprits fail, everyone else's tokens (and the
next request's, after every fault) equal the fault-free run's, every pool comes back, and the
lifecycle log replays legally."""

from __future__ import annotations

import pytest

from pipeline.benchmarks import faults, soak


@pytest.fixture(scope="module")
def soak_model():
    return soak.build_model()


@pytest.mark.parametrize("round_no", range(8))
def test_a_round_with_faults_at_every_point(soak_model, round_no):
    kind = soak.round_kind(round_no, True)
    items = soak.workload(100 + round_no, size=16, fault_rate=0.5, **soak.round_points(kind, faults.POINTS))
    report = soak.run_round(soak_model, items, **kind, watchdog_s=120)
    assert report.faults > 0, "the round injected nothing"
    assert report.failed == report.failed_culprits, "an innocent request failed"
    assert report.wrong == (), f"outputs differ from the fault-free run: {report.wrong}"
    assert not report.leaked and report.illegal == 0


def test_fault_points_are_drawn_with_their_passages():
    items = soak.workload(7, size=300, fault_rate=0.5, points=faults.POINTS)
    assert items == soak.workload(7, size=300, fault_rate=0.5, points=faults.POINTS)
    assert {it.fault for it in items} == set(faults.POINTS) | {None}
    assert all(it.sampled for it in items if it.fault == "sample")
    assert len({it.after for it in items if it.fault == "backup"}) > 3
    assert soak.workload(7, size=50, fault_rate=0.3) == soak.workload(7, size=50, fault_rate=0.3)
