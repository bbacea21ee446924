"""Host pages are taken when a decode step reserves its room, not when it commits.

Two requests cross a page boundary in the same step while the host pool has one free page: the
first takes it and decodes, the second is refused (retracted, to come back later), and nobody fails.
Counting the pages only at commit let both pass the check and then failed the whole step.
"""

from __future__ import annotations

import io

import structlog

from pipeline.config import EngineConfig, HiSparseConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.logs import configure_logging
from pipeline.request import State
from pipeline.sampling import SamplingParams

PAGE = 8


def test_two_rows_crossing_a_page_with_one_host_page_free(tiny_model):
    sink = configure_logging(level="warning", stream=io.StringIO())
    try:
        cfg = EngineConfig(
            dtype="float64",
            page_size=PAGE,
            max_context_len=64,
            max_running_requests=4,
            device_pool_tokens=256,
            hisparse=HiSparseConfig(device_buffer_size=16, host_to_device_ratio=2),
            speculative=None,
            prefix_cache=False,
        )
        executor = Executor(cfg, model=tiny_model)
        initial = executor.pool_counts()
        driver = SyncDriver(executor)
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        reqs = [driver.submit(list(range(1 + i, 2 * PAGE + i)), params) for i in range(2)]  # 15 tokens each
        while not all(r.state is State.DECODE for r in reqs):
            driver.step()
        host = executor.memory.host.allocator
        lengths = [executor.memory.length(executor.seqs[r.request_id].row) for r in reqs]
        assert lengths == [2 * PAGE, 2 * PAGE]  # the next step writes position 16: a third page each
        stolen = host.allocate(host.num_free_pages - 1, owner=99)  # one host page left
        driver.step()  # position 16 of both: one page for two rows
        states = sorted(r.state.name for r in reqs)
        assert "FAILED" not in states, [r.error for r in reqs]
        lengths = sorted(
            executor.memory.length(executor.seqs[r.request_id].row)
            for r in reqs
            if r.request_id in executor.seqs
        )
        assert lengths[-1] == 2 * PAGE + 1  # one of them decoded past the boundary
        host.free(stolen, owner=99)
        driver.run()
        assert [r.state for r in reqs] == [State.FINISHED, State.FINISHED]
        assert all(len(r.output_ids) == 12 for r in reqs)
        executor.check_integrity()
        assert executor.pool_counts() == initial
    finally:
        sink.close()
        structlog.reset_defaults()
