"""The short version of ``hispec bench soak``: seeded workloads with faults injected into culprit
requests (forward, sampling, swap-in, staging copy, release, host exhaustion, a whole command), with
speculation off and on. No hang (watchdog), only culprits fail, everyone else's tokens equal the
fault-free run's, every pool comes back, and the lifecycle log replays legally."""

from __future__ import annotations

import pytest

from pipeline.benchmarks import soak


@pytest.fixture(scope="module")
def soak_model():
    return soak.build_model()


@pytest.mark.parametrize(("seed", "speculative"), [(1, False), (2, True), (3, False), (4, True)])
def test_a_round_with_injected_faults(soak_model, seed, speculative):
    items = soak.workload(seed, size=16, fault_rate=0.4)
    report = soak.run_round(soak_model, items, speculative=speculative, watchdog_s=120)
    assert report.faults > 0, "the round injected nothing"
    assert report.failed == report.failed_culprits, "an innocent request failed"
    assert report.wrong == (), f"outputs differ from the fault-free run: {report.wrong}"
    assert not report.leaked and report.illegal == 0


def test_the_workload_is_seeded_and_mixes_every_kind():
    items = soak.workload(7, size=200, fault_rate=0.3)
    assert items == soak.workload(7, size=200, fault_rate=0.3)
    assert {it.fault for it in items} >= set(soak.FAULTS)
    assert {it.give_up for it in items} == set(soak.GIVE_UPS)
    assert any(it.sampled for it in items) and any(it.stop for it in items)
