"""Finalize is transactional: when the host pool cannot take a request's accepted tokens, that
request's mappings roll back and it fails with a clear reason; nothing leaks, others continue."""

from __future__ import annotations

import torch

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.hisparse.coordinator import HiSparseCoordinator
from pipeline.memory import HostPool, OutOfMemory
from pipeline.sampling import SamplingParams
from statemachines.request import State

CONFIG = EngineConfig(
    dtype="float64",
    page_size=4,
    max_context_len=120,
    max_running_requests=3,
    device_pool_tokens=256,
    hisparse=HiSparseConfig(device_buffer_size=8, host_to_device_ratio=2),
    speculative=SpeculativeConfig(num_steps=2, max_batch_size=None, timed=False, min_accept_length=None,
                                   plain_tail=False, plain_while_prefilling=False),
)


def test_host_exhaustion_in_finalize_fails_only_that_request(tiny_model, monkeypatch):
    executor = Executor(CONFIG, model=tiny_model)
    initial = executor.pool_counts()
    driver = SyncDriver(executor, check=True)
    victim = driver.submit(list(range(20)), SamplingParams(max_new_tokens=30, ignore_eos=True))
    other = driver.submit(list(range(5, 30)), SamplingParams(max_new_tokens=30, ignore_eos=True))
    coord = executor.memory
    real_reserve = HostPool.reserve
    seen = {}

    finalizing = []

    def reserve(self, row, length):
        # the victim's 4th verify round finds the host pool full in finalize
        if (
            finalizing
            and executor.seqs.get(victim.request_id)
            and row == executor.seqs[victim.request_id].row
        ):
            seen[row] = seen.get(row, 0) + 1
            if seen[row] == 4:
                raise OutOfMemory("host", 1, 0)
        return real_reserve(self, row, length)

    mappings_before = {}
    real_finalize = HiSparseCoordinator.finalize_verify

    def finalize(self, rows, accepted, layout):
        mappings_before.update({r: coord.alloc.logical_to_physical.clone() for r in rows})
        finalizing.append(True)
        try:
            failed = real_finalize(self, rows, accepted, layout)
        finally:
            finalizing.pop()
        for row in failed:
            d = layout.draft_tokens
            n = coord.length(row)
            locs = coord.req_to_token[row, n : n + d]
            assert torch.equal(coord.alloc.lookup(locs), mappings_before[row][locs]), (
                "mapping not rolled back"
            )
            coord.check_integrity()
        return failed

    monkeypatch.setattr(HostPool, "reserve", reserve)
    monkeypatch.setattr(HiSparseCoordinator, "finalize_verify", finalize)
    driver.run()
    assert victim.state is State.FAILED
    assert "finalize rolled back" in victim.error and "host" in victim.error
    assert other.state is State.FINISHED and len(other.output_ids) == 30
    executor.check_integrity()
    assert executor.pool_counts() == initial
