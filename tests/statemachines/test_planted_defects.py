"""Known defects, planted one at a time into the real code: the state machine alone must catch each.

Each test patches one defect in (``monkeypatch``, undone after the test), runs only the state machine
that guards that code (``derandomize``, no example database, no shrinking: the first failing run is
enough), and asserts that the run fails. A defect a machine stops catching shows here as a passing
run, however the machine changed. Each machine finds its defect within a few dozen runs; the runs
allowed are several times that, since even a derandomized run's choices change with the modules
loaded (hypothesis also draws constants found in them).

* (a) the stale alias: finalize leaves the rejected verify locations mapped to their verify slots
  (SGLang's "rejected verify locations left mapped after finalize");
* (b) a prompt's mappings not cleared when staging is collected (the coordinator's
  ``collect_ready``, and the allocator's ``alloc_device_buffer``);
* (c) verify binding writes no position into the verify tokens' columns;
* (d) the allocator's logical-to-physical map not zeroed when a row's locations are freed;
* (e) an edge removed from the request lifecycle's table;
* (f) the host copy of a newest column not kept (what decode and finalize read instead of the device).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from test_lifecycle_machine import LifecycleMachine

from pipeline.hisparse.coordinator import HiSparseCoordinator
from pipeline.hisparse.verify import VerifyBuffers
from pipeline.memory import HiSparseAllocator
from statemachines import request as lifecycle

pytestmark = pytest.mark.proptest


def run_until_it_fails(machine, *, examples: int, steps: int) -> BaseException:
    """Run ``machine`` deterministically; returns what made it fail (fails the test if nothing did)."""
    fixed = settings(
        max_examples=examples,
        stateful_step_count=steps,
        derandomize=True,
        database=None,
        deadline=None,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    with pytest.raises(Exception) as info:  # any failure of the machine's checks
        run_state_machine_as_test(machine, settings=fixed)
    return info.value


def spec_machine():
    from speculative.test_spec_machine import SpecMachine

    return SpecMachine


def executor_machine():
    from hisparse.test_executor_machine import ExecutorMachine

    return ExecutorMachine


def test_stale_alias_after_finalize_is_caught(monkeypatch):
    """(a): the rejected verify tokens' locations keep pointing at their draft-zone slots."""
    original = VerifyBuffers.finalize

    def finalize(self, rows, accepted, layout):
        d = layout.draft_tokens
        locs = layout.targets.locs.cpu().reshape(len(rows), d)
        slots = layout.targets.slots.cpu().reshape(len(rows), d)
        failed = original(self, rows, accepted, layout)
        for i, (row, count) in enumerate(zip(rows, accepted)):
            if row not in failed:
                self.coord.alloc.bind(locs[i, count:], slots[i, count:])
        return failed

    monkeypatch.setattr(VerifyBuffers, "finalize", finalize)
    error = run_until_it_fails(spec_machine(), examples=100, steps=40)
    assert "maps to slot" in str(error), error


def test_prefill_mappings_left_at_collect_are_caught(monkeypatch):
    """(b), the coordinator: a collected prompt's locations keep their prefill slots."""
    original = HiSparseCoordinator.collect_ready

    def collect_ready(self, rows=None, *, speculative=False):
        before = self.alloc.logical_to_physical.clone()
        ready = original(self, rows, speculative=speculative)
        for row in ready:
            locs = self.req_to_token[row, : self.length(row)]
            self.alloc.logical_to_physical[locs] = before[locs]
        return ready

    monkeypatch.setattr(HiSparseCoordinator, "collect_ready", collect_ready)
    run_until_it_fails(executor_machine(), examples=100, steps=30)


def test_prefill_mappings_left_by_the_device_buffer_are_caught(monkeypatch):
    """(b), the allocator: ``alloc_device_buffer`` keeps the prefill locations mapped."""
    from memory.test_memory_machine import MemoryMachine

    original = HiSparseAllocator.alloc_device_buffer

    def alloc_device_buffer(self, owner, prefill_pages, prefill_locs, need_tokens):
        before = self.logical_to_physical[prefill_locs].clone()
        pages = original(self, owner, prefill_pages, prefill_locs, need_tokens)
        self.logical_to_physical[prefill_locs] = before
        return pages

    monkeypatch.setattr(HiSparseAllocator, "alloc_device_buffer", alloc_device_buffer)
    run_until_it_fails(MemoryMachine, examples=100, steps=30)


def test_verify_columns_without_positions_are_caught(monkeypatch):
    """(c): verify binding maps the verify locations but records no position in the draft zone."""
    original = VerifyBuffers.prepare

    def prepare(self, rows, draft_tokens):
        layout = original(self, rows, draft_tokens)
        buffers = self.coord.buffers
        row_d = torch.tensor(rows, dtype=torch.int64, device=buffers.device)[:, None]
        buffers.tokens[:, row_d, buffers.newest + 1 :] = -1
        return layout

    monkeypatch.setattr(VerifyBuffers, "prepare", prepare)
    error = run_until_it_fails(spec_machine(), examples=100, steps=40)
    assert "verify column" in str(error), error


def test_a_stale_host_copy_of_the_newest_column_is_caught(monkeypatch):
    """(f): the newest columns are written, but their host copy (``DeviceBuffers.record_newest``)
    is not kept."""
    from pipeline.hisparse.buffers import DeviceBuffers

    monkeypatch.setattr(DeviceBuffers, "record_newest", lambda self, rows, positions: None)
    error = run_until_it_fails(executor_machine(), examples=100, steps=30)
    assert "host copy" in str(error), error


def test_map_not_zeroed_when_locations_are_freed_is_caught(monkeypatch):
    """(d): ``release_locations`` frees a row's locations but leaves their map entries."""
    from memory.test_memory_machine import MemoryMachine

    def release_locations(self, row, *, handed=0):
        self.req_to_token.release(row, handed=handed)

    monkeypatch.setattr(HiSparseAllocator, "release_locations", release_locations)
    run_until_it_fails(MemoryMachine, examples=100, steps=30)


EDGES = sorted(lifecycle.TRANSITIONS, key=str)


@pytest.mark.parametrize(("state", "event"), EDGES, ids=[f"{s.name}-{e.__name__}" for s, e in EDGES])
def test_a_lifecycle_edge_removed_is_caught(monkeypatch, state, event):
    """(e), every edge: the lifecycle's state machine walks each, so any one missing fails it."""
    monkeypatch.delitem(lifecycle.TRANSITIONS, (state, event))
    error = run_until_it_fails(LifecycleMachine, examples=200, steps=40)
    assert isinstance(error, lifecycle.IllegalTransition), error


# edges the scheduler's machine takes in its first few runs (it has no speculation and no faults, a
# request reaches STAGING only to leave it in the same step, and a retraction takes it longer to find)
DRIVEN = [
    (lifecycle.State.QUEUED, lifecycle.Admitted),
    (lifecycle.State.PREFILL, lifecycle.ChunkDone),
    (lifecycle.State.PREFILL, lifecycle.PrefillDone),
    (lifecycle.State.STAGING, lifecycle.StagingDone),
    (lifecycle.State.READY, lifecycle.JoinedBatch),
    (lifecycle.State.DECODE, lifecycle.StepDone),
    (lifecycle.State.DECODE, lifecycle.AbortRequested),
]


@pytest.mark.parametrize(("state", "event"), DRIVEN, ids=[f"{s.name}-{e.__name__}" for s, e in DRIVEN])
def test_a_lifecycle_edge_the_scheduler_takes_removed_is_caught(monkeypatch, state, event):
    """(e), through the real consumer: the scheduler's state machine fails without the edge."""
    from hisparse.test_chunked_machine import ChunkedSchedulerMachine

    monkeypatch.delitem(lifecycle.TRANSITIONS, (state, event))
    run_until_it_fails(ChunkedSchedulerMachine, examples=50, steps=30)
