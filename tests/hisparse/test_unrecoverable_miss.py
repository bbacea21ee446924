"""A committed position with no copy anywhere (an invariant violation, planted here) is reported:
the swap-in gives it no slot, the layer's ``unrecoverable`` counter counts it, and a warning names
its row, layer and position; the other positions asked for in the same call are swapped in. Where
the counts stay on the device until read (a GPU's way, forced here), the warning comes with that read."""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
import pytest
import structlog
import torch
from hypothesis import given, settings

from pipeline.config import EngineConfig, HiSparseConfig
from pipeline.driver import prefill_whole
from pipeline.executor import Executor, NewSequence
from pipeline.sampling import SamplingParams

from tiny_models import build_tiny_model

HOT = 8
MODEL = build_tiny_model()
CONFIG = EngineConfig(
    dtype="float64",
    page_size=4,
    max_context_len=64,
    max_running_requests=2,
    device_pool_tokens=64,
    hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2),
    speculative=None,
)


@pytest.mark.proptest
@settings(max_examples=6, deadline=None)
@given(prompt=st.integers(HOT + 2, 30), data=st.data(), deferred=st.booleans())
def test_a_position_with_no_copy_is_reported(prompt, data, deferred):
    executor = Executor(CONFIG, model=MODEL)
    patch = pytest.MonkeyPatch()
    try:
        if deferred:  # the swap-in hands over no totals, the counters keep the sums until read
            from pipeline.hisparse import coordinator

            real = coordinator.swap_in
            patch.setattr(coordinator, "swap_in", lambda *a, **k: attrs.evolve(real(*a, **k), totals=None))
            executor.memory.counters.defer = True
        request = NewSequence("r", tuple(range(3, 3 + prompt)), SamplingParams(ignore_eos=True))
        prefill_whole(executor, [request])
        executor.wait_staging()
        assert executor.collect_ready() == ["r"]
        executor.decode(["r"])
        coord, row = executor.memory, executor.seqs["r"].row
        coord.wait_backups()
        length = coord.length(row)
        layer = data.draw(st.integers(0, coord.num_layers - 1))
        held = set(coord.buffers.tokens[layer, row].tolist())  # at most HOT + 1 positions
        evicted = [p for p in range(length) if p not in held]  # read from host when asked for
        lost, kept = data.draw(st.permutations(evicted))[:2]
        coord.host.req_to_host[row, lost] = -1  # the planted violation: no copy anywhere
        top = torch.full((1, 1, MODEL.cfg.index_topk), -1, dtype=torch.int32)
        top[0, 0, :2] = torch.tensor([lost, kept], dtype=torch.int32)
        before = list(coord.counters.unrecoverable)
        with structlog.testing.capture_logs() as logs:
            result = coord.swap_in(layer, top, torch.tensor([[length]]), torch.tensor([row]))
            early = [e for e in logs if e["log_level"] == "warning"]
            assert not (deferred and early), "a deferred count was read inside the swap-in"
            after = coord.counters.unrecoverable  # (deferred: the read that reports)
        assert int(result.slots[0, 0, 0]) < 0, "a position with no copy got a slot"
        assert int(result.slots[0, 0, 1]) > 0, "the other position was not swapped in"
        assert [a - b for a, b in zip(after, before)] == [int(i == layer) for i in range(len(after))]
        warned = [
            (e["event"], e["row"], e["layer"], e["position"]) for e in logs if e["log_level"] == "warning"
        ]
        assert warned == [("hisparse.unrecoverable_miss", row, layer, lost)], warned
    finally:
        patch.undo()
        executor.close()
