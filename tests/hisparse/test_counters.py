"""The per-layer HiSparse counters add up: after a run, for every layer,

* ``h2d_bytes == misses * row_bytes`` (each miss copies one row host->device);
* ``d2h_bytes == committed tokens * row_bytes`` (the prompt's staging copy plus the backup of every
  token committed by a decode step or a verify's finalize);
* ``hits + misses`` equals the number of unique valid top-k positions of every swapped-in step,
  summed over the recorded top-k trace (decode and verify records, the fast-path steps of a short
  request included: swap-in counts their entries as hits, ``kernels/swap_in.py``), and no entry is
  unrecoverable;
* ``hit_rate == hits / (hits + misses)``; the stats dict carries the same per-layer lists;
* the same where the swap-in counts stay on the device until read (``LayerCounters.defer``, what a
  GPU does: one read per step, none inside the forward), forced here on the CPU.

The prompts are several times longer than HOT, so nearly every step takes the long path and misses.
"""

from __future__ import annotations

import attrs
import pytest

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import prefill_whole
from pipeline.executor import Executor, NewSequence
from pipeline.hisparse.trace import read_trace
from pipeline.sampling import SamplingParams

HOT = 8
GREEDY = SamplingParams(max_new_tokens=10_000, ignore_eos=True)
PROMPTS = {"long": tuple((i * 37 + 5) % 256 for i in range(4 * HOT)), "short": (3, 1, 4)}


def _config(speculative: SpeculativeConfig | None) -> EngineConfig:
    return EngineConfig(
        dtype="float64",
        page_size=4,
        max_context_len=128,
        max_running_requests=2,
        device_pool_tokens=128,  # no memory pressure: no retraction re-stages a prompt
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2),
        speculative=speculative,
    )


def _check_counters(executor: Executor, committed: dict[str, int], trace_path, *, phase: str) -> None:
    coord = executor.memory
    counters = coord.counters
    for rid, n in committed.items():
        assert coord.length(executor.seqs[rid].row) == n
    row_bytes = coord.row_dim * coord.device_kv.element_size()
    executor.trace.close()
    records = [r for r in read_trace(trace_path) if r["phase"] != "prefill"]  # prefill: no swap-in
    assert records and {r["phase"] for r in records} == {phase}
    total = sum(committed.values())
    stats = executor.stats()["hisparse"]
    for layer in range(coord.num_layers):
        hits, misses = counters.hits[layer], counters.misses[layer]
        assert misses > 0 and hits > 0, f"layer {layer}: the run should both hit and miss"
        assert counters.unrecoverable[layer] == 0
        assert counters.h2d_bytes[layer] == misses * row_bytes, f"layer {layer}"
        assert counters.d2h_bytes[layer] == total * row_bytes, f"layer {layer}"
        assert counters.hit_rate(layer) == hits / (hits + misses)
        picked = sum(
            len({t for t in r["top_k"] if 0 <= t <= r["position"]}) for r in records if r["layer"] == layer
        )
        assert hits + misses == picked, f"layer {layer}: counted entries differ from the traced top-k"
        assert stats["hit_rate"][layer] == round(hits / (hits + misses), 4)
    for key in ("hits", "misses", "unrecoverable", "h2d_bytes", "d2h_bytes"):
        assert stats[key] == list(getattr(counters, key)), key


def _start(executor: Executor) -> None:
    prefill_whole(executor, [NewSequence(rid, prompt, GREEDY) for rid, prompt in PROMPTS.items()])
    executor.wait_staging()
    assert executor.collect_ready() == list(PROMPTS)


def _defer(executor: Executor, monkeypatch) -> None:
    """Counts on the device until read: every swap-in hands over no Python totals (as the GPU's
    kernels do), and the counters keep them in a tensor until a figure is read."""
    from pipeline.hisparse import coordinator

    real = coordinator.swap_in
    monkeypatch.setattr(coordinator, "swap_in", lambda *a, **k: attrs.evolve(real(*a, **k), totals=None))
    executor.memory.counters.defer = True


@pytest.mark.parametrize("deferred", [False, True], ids=["read-per-call", "deferred"])
def test_decode_counters_add_up(tiny_model, tmp_path, monkeypatch, deferred):
    path = tmp_path / "topk.jsonl"
    executor = Executor(_config(None), model=tiny_model, trace_path=str(path))
    _start(executor)
    if deferred:
        _defer(executor, monkeypatch)
    steps = 24  # the short request outgrows HOT on the way
    for _ in range(steps):
        assert set(executor.decode(list(PROMPTS)).tokens) == set(PROMPTS)
        # the step's counts were not read inside it (deferred) or were (read per call)
        assert executor.memory.counters._dirty == deferred
    _check_counters(executor, {rid: len(p) + steps for rid, p in PROMPTS.items()}, path, phase="decode")
    executor.close()


def test_verify_counters_add_up(tiny_model, tmp_path):
    path = tmp_path / "topk.jsonl"
    executor = Executor(
        _config(SpeculativeConfig(num_steps=2, max_batch_size=8)), model=tiny_model, trace_path=str(path)
    )
    _start(executor)
    committed = {rid: len(p) for rid, p in PROMPTS.items()}
    for _ in range(10):
        ids = list(PROMPTS)
        runnable, refused = executor.reserve(ids, new_tokens=executor.draft_tokens, speculative=True)
        assert not refused
        assert not executor.draft(runnable).failed
        result = executor.verify(ids)
        assert not result.failed
        for rid in ids:
            committed[rid] += len(result.tokens[rid])  # accepted drafts and the bonus token
    _check_counters(executor, committed, path, phase="verify")
    executor.close()


def test_deferred_counts_settle_once_and_check_only_lossy_layers():
    """``LayerCounters`` with ``defer``: nothing is added until a figure is read; the read adds every
    layer's sums at once and runs the unrecoverable check of the calls of a layer that left any."""
    import torch

    from kernels.swap_in_result import SwapInResult
    from pipeline.hisparse.counters import LayerCounters

    def result(hits: int, misses: int, lost: int) -> SwapInResult:
        counts = torch.tensor([[1, hits, misses, lost], [1, 1, 0, 0]], dtype=torch.int32)
        return SwapInResult(slots=torch.zeros(2, 1, 1, dtype=torch.int32), counts=counts, row_bytes=10)

    counters = LayerCounters(3, defer=True)
    checked: list[str] = []
    counters.add_swap_in(0, result(2, 3, 0), lambda: checked.append("clean"))
    counters.add_swap_in(2, result(0, 1, 1), lambda: checked.append("lossy"))
    counters.add_swap_in(2, result(1, 0, 0), lambda: checked.append("same layer"))
    assert checked == [] and counters._dirty  # nothing read yet
    assert counters.hits == [3, 0, 3]  # (the first read settles; each result has a second request, 1 hit)
    assert checked == ["lossy", "same layer"]  # a lossy layer's calls look again; a clean one's do not
    assert counters.misses == [3, 0, 1] and counters.unrecoverable == [0, 0, 1]
    assert counters.h2d_bytes == [30, 0, 10] and not counters._dirty
    assert counters.hits == [3, 0, 3] and checked == ["lossy", "same layer"]  # read once, added once
    immediate = LayerCounters(3, defer=False)
    immediate.add_swap_in(2, result(0, 1, 1), lambda: checked.append("at once"))
    assert checked[-1] == "at once" and immediate.unrecoverable == [0, 0, 1]


def test_a_graph_step_is_counted_once_and_each_replay_again():
    """What ``DecodeGraphs`` does around a capture: the warm-up runs of the step and the recording
    are taken back (``snapshot`` / ``restore``: the counts written in place, into the tensor a graph
    adds into), the recording's checks kept; each replay's device sums are then read with them."""
    import torch

    from kernels.swap_in_result import SwapInResult
    from pipeline.hisparse.counters import LayerCounters

    def result(hits: int, misses: int, lost: int) -> SwapInResult:
        counts = torch.tensor([[1, hits, misses, lost]], dtype=torch.int32)
        return SwapInResult(slots=torch.zeros(1, 1, 1, dtype=torch.int32), counts=counts, row_bytes=10)

    counters = LayerCounters(2, defer=True)
    checked: list[str] = []
    counters.add_swap_in(0, result(2, 3, 0))  # the step itself
    counted = counters.snapshot()
    pending = counters._pending
    counters.add_swap_in(0, result(5, 0, 0))  # a warm-up run of it
    assert counters.restore(counted) == [] and counters._pending is pending  # (in place)
    recording = counters.snapshot()
    counters.add_swap_in(1, result(0, 0, 1), lambda: checked.append("recorded"))  # the recording
    checks = counters.restore(recording)
    assert [layer for layer, _ in checks] == [1] and checked == []
    assert counters.hits == [2, 0] and counters.misses == [3, 0] and counters.unrecoverable == [0, 0]
    with torch.inference_mode():
        pending[1] += torch.tensor([1, 0, 1, 0])  # what a replay adds on the device
    counters.replayed(checks)
    assert counters.hits == [2, 1] and counters.unrecoverable == [0, 1] and checked == ["recorded"]
    fresh = LayerCounters(2, defer=True)
    fresh.replayed(checks)  # nothing deferred yet: nothing to read
    assert fresh.hits == [0, 0] and checked == ["recorded"]
