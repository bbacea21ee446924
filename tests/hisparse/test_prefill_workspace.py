"""Free device rows lent to a chunked prefill forward as swap-in workspace.

A chunk past the first reads the prompt's earlier positions through swap-in, in groups whose union
fits the call's columns. With the pool free, the forward borrows rows enough for every earlier
position: one group per layer. With the pool nearly full it borrows what is free and takes more
groups. Either way the tokens are those of an unchunked prefill, the lent rows are back in the pool
when the forward ends (between forwards a request holds its buffer and one chunk), and every pool is
back at its initial count at the end.
"""

from __future__ import annotations

import pytest
from test_chunked_prefill import HOT, PAGE, config, prompts

import pipeline.hisparse.prefill_swap as prefill_swap
from pipeline.config import HiSparseConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.request import State
from pipeline.sampling import SamplingParams

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
LENGTH = 6 * HOT + 3
CHUNK = 2 * HOT


@pytest.mark.parametrize("crowded", [False, True], ids=["free-pool", "crowded-pool"])
def test_lent_workspace(tiny_model, monkeypatch, crowded):
    groups: list[int] = []
    real = prefill_swap.group_bounds

    def counting(past, hot, context):
        bounds = real(past, hot, context)
        groups.append(len(bounds))
        return bounds

    monkeypatch.setattr(prefill_swap, "group_bounds", counting)
    prompt = prompts(7, (LENGTH,))
    whole = Executor(config(hisparse=True, chunk=None, prefix_cache=False), model=tiny_model)
    want = SyncDriver(whole).generate(prompt, PARAMS)[0].output_ids
    groups.clear()

    cfg = config(hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2), chunk=CHUNK,
                 prefix_cache=False)
    executor = Executor(cfg, model=tiny_model)
    initial = executor.pool_counts()
    physical = executor.memory.alloc.physical
    stolen = []
    if crowded:  # leave the forward one page beyond what the request itself needs
        need = -(-(HOT + PAGE + CHUNK) // PAGE)
        stolen = physical.allocate(physical.num_free_pages - need - 1, owner=5)
    driver = SyncDriver(executor)
    req = driver.submit(prompt[0], PARAMS)
    free_between = []
    while req.state in (State.QUEUED, State.PREFILL):
        driver.step()
        free_between.append(physical.num_free_pages)
    held = physical.capacity_pages - len(stolen) - min(free_between)
    assert held * PAGE <= HOT + PAGE + CHUNK + PAGE  # buffer, chunk rows (rounded to pages): no lent row kept
    driver.run()
    assert req.output_ids == want
    layers = tiny_model.cfg.num_hidden_layers
    later_chunks = -(-LENGTH // CHUNK) - 1
    assert len(groups) == layers * later_chunks
    if crowded:
        assert max(groups) > 1  # little workspace: the groups took turns
    else:
        assert groups == [1] * len(groups)  # every earlier position fitted the lent rows at once
    if stolen:
        physical.free(stolen, owner=5)
    executor.check_integrity()
    assert executor.pool_counts() == initial
