"""Admission under each memory limit: the executor admits the longest prefix of the candidates that
fits *together*, each allocation counting against the next, and every admitted request holds, from
admission on, the device buffer it needs to leave staging (so staging never waits for memory).

Pools (pages of 8, HOT 16: a device buffer is 2 pages plain-short, 3 pages = HOT + P with
speculation or once longer than HOT)."""

from __future__ import annotations

import pytest

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import prefill_whole
from pipeline.executor import Executor
from pipeline.messages import NewSequence
from pipeline.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=4)


def executor(tiny_model, *, rows=8, device=256, ratio=2, spec=False, hisparse=True) -> Executor:
    cfg = EngineConfig(
        dtype="float64",
        page_size=8,
        max_context_len=64,
        max_running_requests=rows,
        device_pool_tokens=device,
        hisparse=HiSparseConfig(device_buffer_size=16, host_to_device_ratio=ratio) if hisparse else None,
        speculative=SpeculativeConfig(num_steps=2, max_batch_size=None, timed=False, plain_tail=False,
                                       plain_while_prefilling=False) if spec else None,
    )
    return Executor(cfg, model=tiny_model)


def candidates(*lengths: int) -> list[NewSequence]:
    return [NewSequence(f"c{i}", tuple(range(1, n + 1)), GREEDY) for i, n in enumerate(lengths)]


CASES = [
    # (what limits, pool settings, prompt lengths, admitted count)
    ("request rows", dict(rows=2), (4, 4, 4), 2),
    ("device pages: dense prompts", dict(device=64), (30, 30, 30), 2),  # 4 pages each, 8 in the pool
    ("device pages: short prompts hold their buffer", dict(device=64, spec=True), (7,) * 8, 2),  # 3 + 3
    ("device pages: plain short prompts", dict(device=64), (7,) * 8, 8),  # 1 page each
    ("logical and host pages", dict(device=64, ratio=1), (20, 20, 20), 2),  # 3 pages each, 8 logical
    ("the head does not fit: nobody overtakes", dict(device=64), (60, 8, 8), 1),  # 8 pages, then none
    ("resident pages", dict(device=72, hisparse=False), (40, 40, 8), 1),  # 5 + 5 > 9 pages
]


@pytest.mark.parametrize(("limit", "pools", "lengths", "count"), CASES, ids=[c[0] for c in CASES])
def test_admission_takes_the_prefix_that_fits_together(tiny_model, limit, pools, lengths, count):
    ex = executor(tiny_model, **pools)
    before = ex.pool_counts()
    result = ex.admit(candidates(*lengths))
    assert result.admitted == tuple(f"c{i}" for i in range(count)), limit
    ex.check_integrity(data=False)
    for rid in result.admitted:
        ex.release(rid)
    assert ex.pool_counts() == before
    ex.close()


def test_a_speculative_admission_holds_the_whole_device_buffer(tiny_model):
    """A 7-token prompt is one dense page, but with speculation its row holds HOT + P = 3 pages from
    admission on; leaving staging then allocates nothing."""
    ex = executor(tiny_model, device=64, spec=True)
    free = ex.pool_counts()["physical_pages"]
    prefill_whole(ex, candidates(7))
    assert free - ex.pool_counts()["physical_pages"] == 3
    ex.wait_staging()
    held = ex.pool_counts()["physical_pages"]
    assert ex.collect_ready(["c0"]) == ["c0"] and ex.pool_counts()["physical_pages"] == held
    ex.check_integrity()
    ex.close()
