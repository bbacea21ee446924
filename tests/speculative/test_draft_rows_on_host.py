"""``hisparse.draft_rows_on_host``: the draft layer's KV rows in host memory change where bytes live,
never what the draft layer computes: the same drafts (so the same accept lengths) and the same
output, fewer device bytes per request, more seats at one budget."""

from __future__ import annotations

import attrs
import pytest
import torch
from _spec_util import bundled_config, bundled_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import sparse_mla
from pipeline.capacity import device_structures
from pipeline.config import EngineConfig, HiSparseConfig, resolve_for_model
from pipeline.driver import SyncDriver
from pipeline.errors import ConfigError
from pipeline.executor import Executor
from pipeline.model import load_model
from pipeline.plan import device_plan
from pipeline.preflight import estimate_memory
from pipeline.sampling import SamplingParams
from pipeline.speculative.draft_pool import gather_rows


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", dtype=torch.float64)


def config(*, on_host: bool, num_steps: int | None = 3) -> EngineConfig:
    return bundled_config(True, num_steps, draft_rows_on_host=on_host)


def test_host_rows_draft_what_device_rows_draft(model):
    """The trained MTP head drafts from its rows; with them on the host every round accepts what it
    accepted with them on the device (the same drafts), the tokens are plain greedy's, and every
    pool returns to its initial count."""
    prompts = bundled_prompts()
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    runs = {}
    for name, cfg in {"plain": config(on_host=False, num_steps=None), "device": config(on_host=False),
                      "host": config(on_host=True)}.items():
        executor = Executor(cfg, model=model)
        reqs = SyncDriver(executor, check=True).generate(prompts, params)
        assert executor.pool_counts() == Executor(cfg, model=model).pool_counts()
        counters = executor.spec_counters if cfg.speculative else None
        runs[name] = ([r.output_ids for r in reqs], counters and dict(counters.accept_length_histogram))
        if name == "host":
            assert executor.memory.draft.rows_on_host
            assert "draft layer KV rows" not in executor.memory.device_tensors()
        executor.close()
    assert runs["host"][0] == runs["device"][0] == runs["plain"][0]
    assert runs["host"][1] == runs["device"][1]
    assert sum(k * v for k, v in runs["host"][1].items()) / sum(runs["host"][1].values()) > 1.5


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 9), top_k=st.integers(1, 12), rows=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_gathered_rows_attend_exactly_as_the_whole_pool(tokens, top_k, rows, seed):
    """Sparse MLA over the compact block of selected rows equals sparse MLA over the whole pool, bit
    for bit: repeated slots, -1 slots and queries with no slot at all included."""
    gen = torch.Generator().manual_seed(seed)
    c, r, heads = 8, 4, 2
    kv = torch.randn(rows, c + r, generator=gen, dtype=torch.float64)
    slots = torch.randint(-1, rows, (tokens, top_k), generator=gen)
    slots[0] = -1 if tokens > 1 else slots[0]
    q_latent = torch.randn(tokens, heads, c, generator=gen, dtype=torch.float64)
    q_rope = torch.randn(tokens, heads, r, generator=gen, dtype=torch.float64)
    block, local = gather_rows(kv, slots)
    assert block.shape == (tokens * top_k, c + r)
    assert torch.equal(local < 0, slots < 0)
    expected = sparse_mla(q_latent, q_rope, kv, slots, 0.3)
    assert torch.equal(sparse_mla(q_latent, q_rope, block, local, 0.3), expected)


def test_host_rows_leave_the_device_plan_and_seat_more(model):
    """At one budget: the draft layer's rows leave the device structures (its indexer keys and table
    stay), the host estimate lists them, and the plan seats more speculative requests."""
    base = attrs.evolve(config(on_host=False), device_memory_bytes=24_000_000, device_pool_tokens=None,
                        max_running_requests=None, max_context_len=2048)
    plans, estimates = {}, {}
    for on_host in (False, True):
        cfg = attrs.evolve(base, hisparse=attrs.evolve(base.hisparse, draft_rows_on_host=on_host))
        plans[on_host] = device_plan(cfg, model.cfg)
        resolved = resolve_for_model(cfg, model.cfg, log_choices=False)
        estimates[on_host] = {a.name for a in estimate_memory(resolved, model.cfg).allocations}
    names = {k: {s.name for s in device_structures(p.plan, p.dims)} for k, p in plans.items()}
    assert "draft layer KV rows" in names[False] and "draft layer KV rows" not in names[True]
    assert {"draft layer indexer keys", "draft token table"} <= names[True]
    assert "draft layer KV rows (host)" in estimates[True] and "draft layer KV rows (host)" not in estimates[False]
    assert plans[True].total_bytes <= 24_000_000 and plans[False].total_bytes <= 24_000_000
    assert plans[True].seats(2048).running > plans[False].seats(2048).running >= 1


def test_draft_rows_on_host_must_be_a_bool():
    with pytest.raises(ConfigError, match=r"hisparse\.draft_rows_on_host"):
        HiSparseConfig(draft_rows_on_host="yes")
