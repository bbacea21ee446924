"""``hisparse.draft_rows_on_host`` (and ``draft_keys_on_host``): the draft layer's KV rows (and its
indexer keys) in host memory change where bytes live, never what the draft layer computes: the same
drafts (so the same accept lengths) and the same output, fewer device bytes per request, more seats
at one budget."""

from __future__ import annotations

import attrs
import pytest
import torch
from _spec_util import BUNDLED_HOT, bundled_config, bundled_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import sparse_mla
from pipeline.capacity import device_structures
from pipeline.config import EngineConfig, HiSparseConfig
from pipeline.driver import SyncDriver
from pipeline.errors import ConfigError
from pipeline.executor import Executor
from pipeline.model import load_model
from pipeline.model.attention_api import AttentionInputs
from pipeline.model.resident import ForwardLayout, ResidentBackend, ResidentKV
from pipeline.plan import device_plan
from pipeline.preflight import estimate_memory
from pipeline.sampling import SamplingParams
from pipeline.speculative.draft_pool import HostKeysBackend, gather_rows


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", dtype=torch.float64)


def config(*, on_host: bool, num_steps: int | None = 3, keys: bool = False) -> EngineConfig:
    return bundled_config(True, num_steps, draft_rows_on_host=on_host, draft_keys_on_host=keys)


def test_host_rows_draft_what_device_rows_draft(model):
    """The trained MTP head drafts from its rows; with them (and its indexer keys) on the host every
    round accepts what it accepted with them on the device (the same drafts), the tokens are plain
    greedy's, and every pool returns to its initial count."""
    prompts = bundled_prompts()
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    runs = {}
    for name, cfg in {"plain": config(on_host=False, num_steps=None), "device": config(on_host=False),
                      "host": config(on_host=True), "keys": config(on_host=True, keys=True)}.items():
        executor = Executor(cfg, model=model)
        reqs = SyncDriver(executor, check=True).generate(prompts, params)
        assert executor.pool_counts() == Executor(cfg, model=model).pool_counts()
        counters = executor.spec_counters if cfg.speculative else None
        runs[name] = ([r.output_ids for r in reqs], counters and dict(counters.accept_length_histogram))
        if name == "host":
            assert executor.memory.draft.rows_on_host
            assert "draft layer KV rows" not in executor.memory.device_tensors()
        if name == "keys":
            assert executor.memory.draft.keys_on_host
            draft = {"draft layer KV rows", "draft layer indexer keys"}
            assert not draft & set(executor.memory.device_tensors())
        executor.close()
    assert runs["keys"][0] == runs["host"][0] == runs["device"][0] == runs["plain"][0]
    assert runs["keys"][1] == runs["host"][1] == runs["device"][1]
    assert sum(k * v for k, v in runs["host"][1].items()) / sum(runs["host"][1].values()) > 1.5


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 9), top_k=st.integers(1, 12), rows=st.integers(1, 40), seed=st.integers(0, 2**16)
)
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


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    queries=st.integers(1, 4),
    top_k=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_the_host_indexer_selects_what_the_device_indexer_selects(lens, queries, top_k, seed):
    """Over the same keys, the indexer run on the host (over the forward's rows of the token table,
    trimmed to its longest visible prefix) selects the same slots as the one over the whole table,
    for requests in any order with several queries each (a draft extend) or one (a draft step)."""
    gen = torch.Generator().manual_seed(seed)
    num_rows, max_len, locs, heads, dim = 6, 40, 300, 3, 8
    perm = torch.randperm(locs - 1, generator=gen) + 1
    table = perm[: num_rows * max_len].view(num_rows, max_len).clone()
    order = torch.randperm(num_rows, generator=gen)[: len(lens)]
    req_rows, positions = [], []
    for row, n in zip(order.tolist(), lens):
        for p in range(max(0, n - queries), n):
            req_rows.append(row)
            positions.append(p)
    req_rows, positions = torch.tensor(req_rows), torch.tensor(positions)
    t = req_rows.numel()
    keys = torch.randn(1, locs, dim, generator=gen, dtype=torch.float64).round(decimals=1)  # ties happen
    inputs = AttentionInputs(
        layer=0, q_latent=torch.zeros(t, 1, 1), q_rope=torch.zeros(t, 1, 1), kv_rows=torch.zeros(t, 2),
        index_q=torch.randn(t, heads, dim, generator=gen, dtype=torch.float64),
        index_w=torch.randn(t, heads, generator=gen, dtype=torch.float64), index_k=None,
        attn_scale=1.0, index_scale=0.5, top_k=top_k,
    )
    selected = []
    for kind in (ResidentBackend, HostKeysBackend):
        backend = kind(ResidentKV(kv=torch.zeros(1, locs, 2), index_k=keys, req_to_token=table.clone()))
        backend.begin(ForwardLayout(req_rows, positions, table[req_rows, positions]))
        selected.append(backend.select_slots(inputs, keys[0]))
    assert torch.equal(selected[0], selected[1])


def test_host_rows_leave_the_device_plan_and_seat_more(model):
    """At one budget: the draft layer's rows leave the device structures (its indexer keys stay;
    with ``draft_keys_on_host`` they leave too), the host estimate lists them, and the plan seats
    more speculative requests. The draft layer has no token table of its own (it reads the
    target's)."""
    base = attrs.evolve(config(on_host=False), device_memory_bytes=24_000_000, device_pool_tokens=None,
                        max_running_requests=None, max_context_len=2048)
    plans, estimates = {}, {}
    for where in ("device", "rows", "keys"):
        hs = attrs.evolve(
            base.hisparse, draft_rows_on_host=where != "device", draft_keys_on_host=where == "keys"
        )
        cfg = attrs.evolve(base, hisparse=hs)
        plans[where] = device_plan(cfg, model.cfg)
        estimates[where] = {a.name for a in estimate_memory(cfg, plans[where]).allocations}
    plain = device_plan(attrs.evolve(base, speculative=None), model.cfg)
    names = {k: {s.name for s in device_structures(p.plan, p.dims)} for k, p in plans.items()}
    assert "draft layer KV rows" in names["device"] and "draft layer KV rows" not in names["rows"]
    assert "draft layer indexer keys" in names["rows"] and "draft layer indexer keys" not in names["keys"]
    assert names["keys"] == {s.name for s in device_structures(plain.plan, plain.dims)}  # plain decoding's
    assert "draft layer KV rows (host)" in estimates["rows"]
    assert "draft layer KV rows (host)" not in estimates["device"]
    assert "draft layer indexer keys (host)" in estimates["keys"] - estimates["rows"]
    assert all(p.total_bytes <= 24_000_000 for p in plans.values())
    seats = {k: p.seats(2048).running for k, p in plans.items()}
    assert plain.seats(2048).running >= seats["keys"] > seats["rows"] > seats["device"] >= 1


def test_draft_rows_on_host_must_be_a_bool():
    with pytest.raises(ConfigError, match=r"hisparse\.draft_rows_on_host"):
        HiSparseConfig(draft_rows_on_host="yes")
    with pytest.raises(ConfigError, match=r"hisparse\.draft_keys_on_host"):
        HiSparseConfig(draft_rows_on_host=True, draft_keys_on_host=1)


def test_draft_keys_on_host_need_the_rows_there():
    with pytest.raises(ConfigError, match=r"hisparse\.draft_keys_on_host.*draft_rows_on_host"):
        HiSparseConfig(draft_keys_on_host=True)


@pytest.mark.parametrize("where", ["device", "rows", "keys"])
def test_a_prefix_cache_hit_drafts_from_the_cached_rows(model, where):
    """The draft layer reads the target's token table (it keeps none of its own): a request whose
    prompt the prefix cache holds, in another request row than the one that left it, drafts from
    the MTP rows found at the cached locations, so its rounds accept what they accept uncached."""
    cfg = attrs.evolve(config(on_host=where != "device", keys=where == "keys"), prefix_cache=True)
    other, prompt = bundled_prompts()[0], bundled_prompts()[2]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)

    def run(warm: bool):
        executor = Executor(cfg, model=model)
        driver = SyncDriver(executor, check=True)
        if warm:  # leaves the prompt's pages in the cache, from request row 0
            driver.generate([prompt], params)
        before = dict(executor.spec_counters.accept_length_histogram)
        reqs = driver.generate([other, prompt], params)  # the prompt now in row 1
        after = executor.spec_counters.accept_length_histogram
        assert executor.memory.draft.store.req_to_token is executor.memory.req_to_token_device
        executor.close()
        hist = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        return [r.output_ids for r in reqs], hist, reqs[1].metrics.cached_tokens

    cold, warm = run(False), run(True)
    assert cold[2] == 0 and warm[2] >= 3 * BUNDLED_HOT - 8  # its whole pages came from the cache
    assert warm[:2] == cold[:2]
    assert sum(k * v for k, v in cold[1].items()) > 40  # the head drafts: rounds accept
