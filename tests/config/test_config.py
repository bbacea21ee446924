"""Configuration rules: each accepted at its boundary and rejected just past it, naming the field."""

from __future__ import annotations

import random
from types import SimpleNamespace

import attrs
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, event, given, reject, settings

from pipeline import ConfigError, EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.config import check_against_model
from pipeline.memory import round_up
from pipeline.startup import plan_engine

HS = HiSparseConfig
SP = SpeculativeConfig

# (field named by the error, config accepted at the boundary, config rejected just past it, a
# fragment of the rule that must fire); lazy, because the nested configs check their own rules when
# built. Every rule of pipeline/config.py has a row here (or in MODEL_RULES): several rules share a
# field, so the fragment pins which one rejected the config.
RULES = [
    # model: a non-empty string ("tiny" or a path; the path is only opened when the engine loads it)
    ("model", lambda: dict(model="m"), lambda: dict(model=""), "must be 'tiny' or a path"),
    ("model", lambda: dict(model="tiny"), lambda: dict(model=None), "must be 'tiny' or a path"),
    ("device", lambda: dict(device="cuda", dtype="bfloat16"), lambda: dict(device="tpu"), "must be one of"),
    ("dtype", lambda: dict(dtype="float64"), lambda: dict(dtype="float8"), "must be one of"),
    ("kv_cache_dtype", lambda: dict(kv_cache_dtype="fp8"), lambda: dict(kv_cache_dtype="i8"), "one of"),
    ("freeze_gc", lambda: dict(freeze_gc=False), lambda: dict(freeze_gc=1), "must be True or False"),
    (
        "dtype",
        lambda: dict(device="cpu", dtype="float64"),
        lambda: dict(device="cuda", dtype="float64"),
        "float64 is for exactness checks",
    ),
    (
        "page_size",
        lambda: dict(page_size=1, speculative=None, hisparse=HS(device_buffer_size=64)),
        lambda: dict(page_size=0, speculative=None),
        "must be >= 1",
    ),
    ("page_size", lambda: dict(page_size=16), lambda: dict(page_size=16.0), "must be an integer"),
    ("max_context_len", lambda: dict(max_context_len=1), lambda: dict(max_context_len=0), "must be >= 1"),
    (
        "max_running_requests",
        lambda: dict(max_running_requests=1),
        lambda: dict(max_running_requests=0),
        "must be >= 1",
    ),
    # a bool is not an integer here, though it is an int subclass
    (
        "max_running_requests",
        lambda: dict(max_running_requests=1),
        lambda: dict(max_running_requests=True),
        "must be an integer",
    ),
    # device_pool_tokens >= 1, at the smallest config that is otherwise valid
    (
        "device_pool_tokens",
        lambda: dict(page_size=1, max_context_len=1, device_pool_tokens=1, hisparse=None, speculative=None),
        lambda: dict(page_size=1, max_context_len=1, device_pool_tokens=0, hisparse=None, speculative=None),
        "must be >= 1",
    ),
    (
        "device_pool_tokens",
        lambda: dict(device_pool_tokens=16384 + 16),
        lambda: dict(device_pool_tokens=16384 + 8),
        "must be a multiple of page_size (16)",
    ),
    ("seed", lambda: dict(seed=-3), lambda: dict(seed=1.5), "must be an integer"),
    # hisparse.device_buffer_size >= 1 (page_size 1, no speculation: the draft zone is empty)
    (
        "hisparse.device_buffer_size",
        lambda: dict(page_size=1, speculative=None, hisparse=HS(device_buffer_size=1)),
        lambda: dict(page_size=1, speculative=None, hisparse=HS(device_buffer_size=0)),
        "must be >= 1",
    ),
    (
        "hisparse.device_buffer_size",
        lambda: dict(hisparse=HS(device_buffer_size=16)),
        lambda: dict(hisparse=HS(device_buffer_size=24)),
        "must be a multiple of page_size (16)",
    ),
    (
        "hisparse.device_buffer_size",
        lambda: dict(hisparse=HS(device_buffer_size=64, top_k=64)),
        lambda: dict(hisparse=HS(device_buffer_size=48, top_k=64)),
        "must be >= top_k (64)",
    ),
    (
        "hisparse.host_to_device_ratio",
        lambda: dict(hisparse=HS(host_to_device_ratio=1), max_context_len=4096),
        lambda: dict(hisparse=HS(host_to_device_ratio=0)),
        "must be >= 1",
    ),
    (
        "hisparse.host_to_device_ratio",
        lambda: dict(hisparse=HS(host_to_device_ratio=2)),
        lambda: dict(hisparse=HS(host_to_device_ratio=2.0)),
        "must be an integer",
    ),
    (
        "hisparse.policy",
        lambda: dict(hisparse=HS(policy="slide")),
        lambda: dict(hisparse=HS(policy="belady")),
        "must be one of",
    ),
    (
        "hisparse.near_margin",
        lambda: dict(hisparse=HS(policy="near-adaptive", near_margin=0)),
        lambda: dict(hisparse=HS(policy="near", near_margin=-1)),
        "must be >= 0",
    ),
    (
        "hisparse.top_k",
        lambda: dict(hisparse=HS(top_k=1)),
        lambda: dict(hisparse=HS(top_k=0)),
        "must be >= 1",
    ),
    (
        "speculative.num_steps",
        lambda: dict(speculative=SP(num_steps=1)),
        lambda: dict(speculative=SP(num_steps=0)),
        "must be >= 1",
    ),
    # num_draft_tokens >= 2 when given (checked before the chain rule D == num_steps + 1)
    (
        "speculative.num_draft_tokens",
        lambda: dict(speculative=SP(num_steps=1, num_draft_tokens=2)),
        lambda: dict(speculative=SP(num_steps=1, num_draft_tokens=1)),
        "must be >= 2",
    ),
    (
        "speculative.num_draft_tokens",
        lambda: dict(speculative=SP(num_steps=3, num_draft_tokens=4)),
        lambda: dict(speculative=SP(num_steps=3, num_draft_tokens=5)),
        "a chain verifies num_steps + 1 = 4 tokens",
    ),
    (
        "speculative.num_draft_tokens",
        lambda: dict(speculative=SP(num_steps=3, num_draft_tokens=4)),
        lambda: dict(speculative=SP(num_steps=3, num_draft_tokens=3)),
        "a chain verifies num_steps + 1 = 4 tokens",
    ),
    # eagle_topk >= 1
    (
        "speculative.eagle_topk",
        lambda: dict(speculative=SP(eagle_topk=1)),
        lambda: dict(speculative=SP(eagle_topk=0)),
        "must be >= 1",
    ),
    (
        "speculative.eagle_topk",
        lambda: dict(speculative=SP(eagle_topk=1), page_size=16),
        lambda: dict(speculative=SP(eagle_topk=2), page_size=16),
        "need page_size == 1",
    ),
    # page_size 1 with an explicit num_draft_tokens (a tree's D is free): trees are still refused
    (
        "speculative.eagle_topk",
        lambda: dict(speculative=SP(eagle_topk=1), page_size=1, hisparse=None, device_pool_tokens=4100),
        lambda: dict(
            speculative=SP(eagle_topk=2, num_draft_tokens=6),
            page_size=1,
            hisparse=None,
            device_pool_tokens=4102,
        ),
        "only chain drafting",
    ),
    # the adaptive rule's limits: an integer >= 1, None or "auto"
    (
        "speculative.max_batch_size",
        lambda: dict(speculative=SP(max_batch_size=1)),
        lambda: dict(speculative=SP(max_batch_size=0)),
        "must be >= 1",
    ),
    (
        "speculative.max_batch_size",
        lambda: dict(speculative=SP(max_batch_size="auto")),
        lambda: dict(speculative=SP(max_batch_size="big")),
        'must be an integer, None or "auto"',
    ),
    (
        "speculative.max_context",
        lambda: dict(speculative=SP(max_context=None)),
        lambda: dict(speculative=SP(max_context=True)),
        'must be an integer, None or "auto"',
    ),
    (
        "speculative.max_context",
        lambda: dict(speculative=SP(max_context=1)),
        lambda: dict(speculative=SP(max_context=-5)),
        "must be >= 1",
    ),
    # a prefill forward's budget: an integer >= the chunk, "auto" or None; none with whole prompts
    (
        "prefill_batch_tokens",
        lambda: dict(prefill_batch_tokens=512),
        lambda: dict(prefill_batch_tokens=511),
        "must be at least chunked_prefill_tokens (512)",
    ),
    (
        "prefill_batch_tokens",
        lambda: dict(prefill_batch_tokens="auto"),
        lambda: dict(prefill_batch_tokens="big"),
        "must be an integer, 'auto' or None",
    ),
    (
        "prefill_batch_tokens",
        lambda: dict(chunked_prefill_tokens=None, prefill_batch_tokens=None),
        lambda: dict(chunked_prefill_tokens=None, prefill_batch_tokens=4096),
        "with whole prompts",
    ),
    # verify tokens live in the draft zone: D <= page_size - 1
    (
        "speculative.num_steps",
        lambda: dict(page_size=8, speculative=SP(num_steps=6)),
        lambda: dict(page_size=8, speculative=SP(num_steps=7)),
        "draft zone of page_size - 1 = 7 columns",
    ),
    # one device buffer fits: S >= HOT + P
    (
        "device_pool_tokens",
        lambda: dict(max_context_len=64, device_pool_tokens=144, hisparse=HS(host_to_device_ratio=1)),
        lambda: dict(max_context_len=64, device_pool_tokens=128, hisparse=HS(host_to_device_ratio=1)),
        "must hold one device buffer",
    ),
    # a prompt prefilled whole: S >= roundup(max_context_len, P) (its positions past HOT use the
    # buffer's newest column and draft zone first)
    (
        "device_pool_tokens",
        lambda: dict(max_context_len=1024, device_pool_tokens=1024, chunked_prefill_tokens=None),
        lambda: dict(max_context_len=1025, device_pool_tokens=1024, chunked_prefill_tokens=None),
        "a prompt of max_context_len is prefilled whole",
    ),
    # chunked: S >= HOT + roundup(chunk, P), whatever the context length
    (
        "device_pool_tokens",
        lambda: dict(max_context_len=4096, device_pool_tokens=640, hisparse=HS(host_to_device_ratio=8)),
        lambda: dict(max_context_len=4096, device_pool_tokens=624, hisparse=HS(host_to_device_ratio=8)),
        "a prompt is prefilled in chunks of chunked_prefill_tokens (512)",
    ),
    # logical / host pools hold one request of max_context_len plus the draft tokens
    (
        "hisparse.host_to_device_ratio",
        lambda: dict(max_context_len=2044, device_pool_tokens=2048, hisparse=HS(host_to_device_ratio=1)),
        lambda: dict(max_context_len=2045, device_pool_tokens=2048, hisparse=HS(host_to_device_ratio=1)),
        "the logical and host pools",
    ),
    # without HiSparse every token is resident
    (
        "device_pool_tokens",
        lambda: dict(hisparse=None, max_context_len=4092, device_pool_tokens=4096),
        lambda: dict(hisparse=None, max_context_len=4093, device_pool_tokens=4096),
        "without HiSparse every token is resident",
    ),
]


# the defaults a model resolves (the bundled model's 4096 positions, its MTP layer): the rules on the
# context length and the draft tokens apply to a config that has them
RESOLVED = dict(max_context_len=4096, speculative=SP())


@pytest.mark.parametrize(
    ("field", "good", "bad", "rule"), RULES, ids=[f"{i}-{r[0]}" for i, r in enumerate(RULES)]
)
def test_rule_boundary(field, good, bad, rule):
    EngineConfig(**{**RESOLVED, **good()})
    with pytest.raises(ConfigError) as info:
        EngineConfig(**{**RESOLVED, **bad()})
    assert info.value.field == field
    assert rule in info.value.rule, info.value.rule
    assert str(info.value).startswith(f"{field}=")
    assert isinstance(info.value, ValueError)


MODEL_RULES = [
    # (field, kwargs for check_against_model that pass, that fail, config, rule fragment)
    (
        "hisparse",
        dict(index_topk=64),
        dict(index_topk=None),
        EngineConfig(),
        "needs a model with a DSA indexer",
    ),
    (
        "hisparse.top_k",
        dict(index_topk=64),
        dict(index_topk=32),
        EngineConfig(hisparse=HS(top_k=64)),
        "must equal the model's index_topk (32)",
    ),
    (
        "hisparse.device_buffer_size",
        dict(index_topk=128),
        dict(index_topk=129),
        EngineConfig(hisparse=HS(device_buffer_size=128)),
        "must be >= the model's index_topk (129)",
    ),
    (
        "speculative",
        dict(has_mtp=True),
        dict(has_mtp=False),
        EngineConfig(speculative=SP()),
        "needs a model with an MTP layer",
    ),
    (
        "max_context_len",
        dict(max_positions=4096),
        dict(max_positions=4095),
        EngineConfig(max_context_len=4096),
        "must be <= the model's max_position_embeddings (4095)",
    ),
]


@pytest.mark.parametrize(
    ("field", "good", "bad", "config", "rule"), MODEL_RULES, ids=[r[0] for r in MODEL_RULES]
)
def test_model_rule_boundary(field, good, bad, config, rule):
    base = dict(index_topk=64, has_mtp=True, max_positions=None)
    check_against_model(config, **{**base, **good})
    with pytest.raises(ConfigError) as info:
        check_against_model(config, **{**base, **bad})
    assert info.value.field == field
    assert rule in info.value.rule, info.value.rule


def test_the_model_free_rules_need_no_model():
    """Without HiSparse and speculation nothing but the context limit depends on the model."""
    config = EngineConfig(hisparse=None, speculative=None)
    check_against_model(config, index_topk=None, has_mtp=False, max_positions=None)


def test_config_is_frozen():
    config = EngineConfig()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.page_size = 8  # type: ignore[misc]


def test_no_speculation_and_no_hisparse_are_allowed():
    config = EngineConfig(hisparse=None, speculative=None)
    plan = plan_engine(config, _model(64), log_choices=False).memory
    assert plan.hot == 0 and plan.draft_tokens == 0 and not plan.hisparse


pages = st.sampled_from([1, 2, 4, 8, 16, 32])
configs = st.builds(
    EngineConfig,
    page_size=pages,
    max_context_len=st.integers(1, 5000),
    max_running_requests=st.integers(1, 64),
    device_pool_tokens=st.integers(1, 40).map(lambda n: n * 256),
    chunked_prefill_tokens=st.none() | st.integers(1, 3000),
    hisparse=st.none()
    | st.builds(
        HS,
        device_buffer_size=st.integers(1, 16).map(lambda n: n * 32),
        host_to_device_ratio=st.integers(1, 8),
    ),
    # trees (eagle_topk > 1) and explicit D are drawn too: whatever is accepted must still fit
    speculative=st.none()
    | st.builds(SP, num_steps=st.integers(1, 8))
    | st.builds(
        SP,
        num_steps=st.integers(1, 8),
        eagle_topk=st.integers(1, 3),
        num_draft_tokens=st.none() | st.integers(1, 10),
    ),
)


@given(data=st.data(), top_k=st.sampled_from([8, 32, 64, 128, 256]))
def test_every_accepted_config_satisfies_the_memory_layers_assumptions(data, top_k):
    try:
        config = data.draw(configs)
        check_against_model(config, index_topk=top_k, has_mtp=True, max_positions=None)
        plan = plan_engine(config, _model(top_k, positions=1 << 20), log_choices=False).memory
    except ConfigError:
        return
    p = plan.page_size
    need = -(-plan.max_request_len // p) * p
    assert plan.device_tokens % p == 0 and plan.logical_tokens % p == 0
    assert plan.logical_tokens >= need, "one request's locations fit"
    if plan.hisparse:
        assert plan.hot % p == 0 and plan.hot >= plan.top_k, "swap-in always has evictable columns"
        assert plan.buffer_columns == plan.hot + p
        assert plan.device_tokens >= plan.buffer_columns, "one device buffer fits"
        beyond = min(plan.prefill_chunk, plan.max_context_len - plan.hot)  # a chunk's rows past HOT
        assert plan.device_tokens >= plan.hot + -(-beyond // p) * p, "one prefill chunk fits"
        assert plan.host_tokens >= need, "one request's host copy fits"
        assert plan.draft_tokens <= p - 1, "verify tokens fit the draft zone"
    else:
        assert plan.device_tokens >= need, "one request fits, resident"
    if config.speculative is not None:
        assert config.speculative.eagle_topk == 1 or plan.page_size == 1, "trees need page_size 1"
        if config.speculative.eagle_topk == 1:
            assert plan.draft_tokens == config.speculative.num_steps + 1


# --- an accepted config's plan, built into the memory layer, serves one request of the limit -----

LAYERS = 2  # each layer has its own device rows, buffer tokens and LRU
ROW_DIM = 3


def _stub_model(top_k: int) -> SimpleNamespace:
    """Just what ``Executor.__init__`` reads of a model: it builds the memory layer from the config
    exactly as serving does, without loading (or running) a model."""
    cfg = SimpleNamespace(
        index_topk=top_k,
        num_nextn_predict_layers=1,
        max_position_embeddings=None,
        num_hidden_layers=LAYERS,
        kv_row_dim=ROW_DIM, kv_lora_rank=ROW_DIM - 2, qk_rope_head_dim=2,
        index_head_dim=2,
        index_n_heads=2,
        num_attention_heads=2,
        eos_token_id=None,
        vocab_size=257,
        indexer_types=(),
    )
    return SimpleNamespace(cfg=cfg, dtype=torch.float32)


@st.composite
def small_configs(draw):
    """(config, the model's top_k): small sizes, the device pool mostly at (or a page above) the
    smallest the rules allow, so that the accepted configs sit at the boundaries. Many draws are
    rejected: a pool below the boundary, trees, a D that is not num_steps + 1 or outgrows the
    draft zone, a short ratio."""
    hisparse = draw(st.booleans())
    steps = draw(st.integers(1, 6))
    spec = draw(
        st.none()
        | st.just(SP(num_steps=steps))
        | st.builds(
            SP,
            num_steps=st.just(steps),
            eagle_topk=st.sampled_from([1, 1, 2]),
            num_draft_tokens=st.sampled_from([steps + 1, steps + 2]),
        )
    )
    draft = 0 if spec is None else spec.draft_tokens
    # any page size is accepted, not only powers of two; HiSparse verify tokens need
    # D <= page_size - 1, so there the pages start at D (just past the boundary)
    if hisparse and draft:
        page = draw(st.sampled_from([draft, draft + 1, draft + 1, draft + 2, draft + 5]))
    else:
        page = draw(st.integers(1, 9))
    max_ctx = draw(st.integers(1, 48))
    chunk = draw(st.none() | st.integers(1, 20))
    if hisparse:
        hot = page * draw(st.integers(1, 4))
        top_k = draw(st.integers(1, hot))
        hs = HS(
            device_buffer_size=hot,
            host_to_device_ratio=draw(st.sampled_from([1, 1, 2, 3])),
            top_k=draw(st.sampled_from([None, top_k])),
        )
        beyond = min(chunk or max_ctx, max_ctx - hot)  # a chunk's rows past the hot region
        least = max(hot + page, hot + round_up(beyond, page))
    else:
        hs, top_k = None, draw(st.integers(1, 16))
        least = round_up(max_ctx + draft, page)
    # pool pages: at the boundary, a page above it, or anywhere up to there (where a rule that went
    # missing would let a config through)
    pages = least // page
    pool_pages = draw(st.sampled_from([pages, pages + 1]) | st.integers(1, pages + 1))
    config = EngineConfig(
        page_size=page,
        max_context_len=max_ctx,
        chunked_prefill_tokens=chunk,
        max_running_requests=draw(st.integers(1, 3)),
        device_pool_tokens=page * pool_pages,
        hisparse=hs,
        speculative=spec,
    )
    return config, top_k


class _Request:
    """One request driven through the memory layer's verbs, with a unique stamp per KV write."""

    def __init__(self, memory, plan, rng: random.Random) -> None:
        self.memory, self.plan, self.rng = memory, plan, rng
        self.hisparse = plan.hisparse
        self.committed: dict[int, torch.Tensor] = {}  # position -> [LAYERS, ROW_DIM] its KV
        self._next = 0
        self.row = -1

    def kv(self) -> torch.Tensor:
        return self.memory.device_kv if self.hisparse else self.memory.store.kv[:LAYERS]

    def write(self, slots: torch.Tensor, positions) -> dict[int, torch.Tensor]:
        """What the target's forward does: one new KV row per token, in every layer."""
        new = {}
        for pos in positions:
            self._next += 1
            new[pos] = (
                self._next + torch.arange(LAYERS * ROW_DIM, dtype=torch.float32).view(LAYERS, ROW_DIM) / 8
            )
        self.kv()[:, slots.long()] = torch.stack([new[p] for p in positions], dim=1)
        return new

    def check(self) -> None:
        self.memory.check_integrity(data=True)

    def swap_in(self, first: int, steps: int, visible: dict[int, torch.Tensor]) -> None:
        """Swap-in of one decode (steps=1) or verify (steps=D) for every layer, in rounds as the
        backend resolves it: every valid top-k entry gets a slot holding that position's KV."""
        k = self.plan.top_k
        tops = []
        for j in range(steps):
            n = first + j + 1
            picked = self.rng.sample(range(n), min(k, n))
            tops.append(picked + [-1] * (k - len(picked)))
        top = torch.tensor([tops], dtype=torch.int32)  # [1, S, K]
        lens = torch.arange(first + 1, first + steps + 1).view(1, steps)
        rows = torch.tensor([self.row])
        for layer in range(LAYERS):
            pending = [True] * steps
            result = self.memory.swap_in(layer, top, lens, rows)
            while True:
                done = int(result.steps_done[0])
                assert int(result.unrecoverable[0]) == 0, "a committed position had no copy"
                resolved = [j for j in range(steps) if pending[j] and j < done]
                assert resolved, "hot >= top_k must let every call resolve a step"
                for j in resolved:
                    pending[j] = False
                    for pos, slot in zip(tops[j], result.slots[0, j].tolist()):
                        if pos < 0:
                            assert slot == -1
                            continue
                        assert slot >= 1, f"position {pos} got no device slot"
                        want = visible[pos][layer]
                        assert torch.equal(self.memory.device_kv[layer, slot], want), f"slot {slot} != {pos}"
                if not any(pending):
                    break
                mask = torch.tensor([pending])
                result = self.memory.swap_in(layer, top, torch.where(mask, lens, 0), rows)

    def run(self, prompt: int, accepts) -> None:
        memory, plan = self.memory, self.plan
        speculative = plan.draft_tokens > 0
        assert memory.can_admit(prompt), "a prompt of max_context_len must be admitted into empty pools"
        self.row = memory.admit(prompt)
        chunk = plan.prefill_chunk
        for start in range(0, prompt, chunk):
            end = min(prompt, start + chunk)
            targets = memory.prefill_targets(self.row, start, end)
            self.committed.update(self.write(targets.slots, list(range(start, end))))
            memory.commit_prefill(self.row, start, end, final=end == prompt)
            self.check()
        memory.start_staging(self.row, prompt)
        self.check()
        memory.wait_staging()
        assert memory.collect_ready(speculative=speculative) == [self.row], "the device buffer must fit"
        self.check()
        limit = plan.max_request_len
        if not speculative:
            while memory.length(self.row) < limit:
                assert memory.can_decode(self.row), f"decode refused at {memory.length(self.row)} < {limit}"
                targets = memory.prepare_decode([self.row])
                pos = memory.length(self.row)
                new = self.write(targets.slots, [pos])
                if self.hisparse:
                    self.swap_in(pos, 1, {**self.committed, **new})
                memory.commit_decode([self.row], targets.slots)
                self.committed.update(new)
                self.check()
            assert not memory.can_decode(self.row), "a decode past the request limit must be refused"
        else:
            d = plan.draft_tokens
            while memory.length(self.row) + d <= limit:
                n = memory.length(self.row)
                assert memory.can_decode(self.row, new_tokens=d, speculative=True), f"verify refused at {n}"
                layout = memory.prepare_verify([self.row], d)
                new = self.write(layout.targets.slots, list(range(n, n + d)))
                if self.hisparse:
                    self.swap_in(n, d, {**self.committed, **new})
                accepted = accepts(d)
                assert memory.finalize_verify([self.row], [accepted], layout) == []
                assert memory.length(self.row) == n + accepted
                self.committed.update({p: new[p] for p in range(n, n + accepted)})
                self.check()
            assert not memory.can_decode(self.row, new_tokens=d, speculative=True)
        length = memory.length(self.row)
        assert sorted(self.committed) == list(range(length))
        if self.hisparse:  # every committed position's host copy is its KV
            memory.wait_backups()
            host = memory.host.req_to_host[self.row, :length]
            want = torch.stack([self.committed[p] for p in range(length)], dim=1)
            assert torch.equal(memory.host.kv[:, host], want)
        else:  # every committed position's KV sits at its location
            locs = memory.req_to_token[self.row, :length]
            want = torch.stack([self.committed[p] for p in range(length)], dim=1)
            assert torch.equal(self.kv()[:, locs], want)


def test_executor_start_up_warms_the_compiled_loops_its_run_calls(monkeypatch):
    """The first decode step must not pay for compiling the CPU loops: the executor asks for them
    when it starts, with its device, dtype, indexer and attention shapes, and for the swap-in only
    with HiSparse."""
    import kernels
    from pipeline.executor import Executor

    calls = []
    monkeypatch.setattr(
        kernels, "warm_up", lambda device, dtype, **kw: calls.append((device.type, dtype, kw))
    )
    for hisparse in (None, HiSparseConfig(device_buffer_size=8, host_to_device_ratio=2)):
        config = EngineConfig(dtype="float32", page_size=8, max_context_len=64, max_running_requests=2,
                              device_pool_tokens=256, hisparse=hisparse, speculative=None)
        Executor(config, model=_stub_model(4))
    shape = dict(index_heads=2, index_dim=2, attention=(2, ROW_DIM, 4))
    assert calls == [
        ("cpu", torch.float32, {**shape, "swap_in": False}),
        ("cpu", torch.float32, {**shape, "swap_in": True}),
    ]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_every_accepted_config_serves_one_request_of_max_context_len(data, seed):
    """The memory layer that serving builds from an accepted config (HiSparse coordinator or the
    resident pool) takes a prompt of up to max_context_len into empty pools, gets its device
    buffer, decodes (or verifies D tokens per round, each swap-in resolving every step) up to the
    plan's request limit without a refusal, passes every integrity check on the way, and once
    released every pool is back at its initial free count."""
    from pipeline.executor import Executor

    try:
        config, top_k = data.draw(small_configs(), label="config")
        executor = Executor(config, model=_stub_model(top_k))
    except ConfigError:
        reject()
    memory, plan = executor.memory, executor.plan.memory
    event("hisparse" if plan.hisparse else "resident")
    event(f"speculative D={plan.draft_tokens}" if plan.draft_tokens else "plain decode")
    if plan.hisparse:
        event("outgrows the hot region" if plan.max_request_len > plan.hot else "stays short")
    try:
        assert plan == plan_engine(config, _stub_model(top_k).cfg, log_choices=False).memory
        initial = memory.free_counts()
        memory.check_integrity()
        limit = config.max_context_len
        prompt = data.draw(st.just(limit) | st.integers(1, limit), label="prompt")
        request = _Request(memory, plan, random.Random(seed))
        request.run(prompt, lambda d: data.draw(st.integers(1, d), label="accepted"))
        memory.release(request.row)
        memory.check_integrity()
        assert memory.free_counts() == initial, "a pool did not return to its initial free count"
    finally:
        executor.close()


def test_an_injected_model_must_match_the_configured_dtype(tiny_model):
    from pipeline.executor import Executor

    with pytest.raises(ConfigError) as info:
        Executor(
            EngineConfig(dtype="float32", max_context_len=512, device_pool_tokens=1024), model=tiny_model
        )
    assert info.value.field == "dtype"


def test_the_adaptive_rules_auto_limits_follow_the_device():
    """``"auto"``: a CPU speculates for a request served alone and up to ``CPU_SPEC_MAX_CONTEXT``
    tokens, CUDA up to 8 requests at any length; numbers and None are kept as given."""
    from pipeline.config import CPU_SPEC_MAX_CONTEXT
    from pipeline.scheduler import SpecPolicy

    spec = SP()
    assert (spec.max_batch_size, spec.max_context) == ("auto", "auto")
    cpu, cuda = spec.for_device("cpu"), spec.for_device("cuda")
    assert (cpu.max_batch_size, cpu.max_context) == (1, CPU_SPEC_MAX_CONTEXT)
    assert (cuda.max_batch_size, cuda.max_context) == (8, None)
    given = SP(max_batch_size=3, max_context=None)
    assert given.for_device("cpu") == given and given.for_device("cuda") == given
    policy = SpecPolicy.from_config(spec, "cpu")
    assert (policy.max_batch_size, policy.max_context) == (1, CPU_SPEC_MAX_CONTEXT)
    assert policy.within_context(CPU_SPEC_MAX_CONTEXT) and not policy.within_context(CPU_SPEC_MAX_CONTEXT + 1)
    assert SpecPolicy.from_config(spec, "cuda").within_context(1 << 20)


def test_the_replacement_policy_auto_follows_the_device():
    """``HiSparseConfig.policy`` ``"auto"`` (the default): ``adaptive`` on a CPU, ``lru`` on CUDA;
    a named policy is kept; the memory plan carries the resolved one."""
    assert HS().policy == "auto"
    assert (HS().policy_for("cpu"), HS().policy_for("cuda")) == ("adaptive", "lru")
    assert HS(policy="near").policy_for("cpu") == "near" and HS(policy="lru").policy_for("cpu") == "lru"
    assert plan_engine(EngineConfig(**RESOLVED), _model(64)).memory.policy == "adaptive"
    slide = EngineConfig(**RESOLVED, hisparse=HS(policy="slide"))
    assert plan_engine(slide, _model(64)).memory.policy == "slide"


def test_the_prefill_budget_auto_is_2048_or_the_chunk_and_none_with_whole_prompts():
    from pipeline.startup import prefill_budget

    assert prefill_budget(EngineConfig()) == 2048
    assert prefill_budget(EngineConfig(chunked_prefill_tokens=4096, max_context_len=8192)) == 4096
    assert prefill_budget(EngineConfig(chunked_prefill_tokens=None, max_context_len=1024)) is None
    assert prefill_budget(EngineConfig(prefill_batch_tokens=None)) is None
    assert prefill_budget(EngineConfig(prefill_batch_tokens=1000)) == 1000


def test_an_mtp_layer_the_weights_lack_is_none_with_one_warning_for_auto():
    import structlog

    from pipeline.model import ModelConfig

    from tiny_models import TINY_CONFIG

    named = ModelConfig.from_hf_dict(TINY_CONFIG)
    assert named.num_nextn_predict_layers == 1
    absent = named.without_absent_mtp(["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight"])
    assert (absent.num_nextn_predict_layers, absent.absent_mtp_layers) == (0, 1)
    layer = f"model.layers.{named.num_hidden_layers}.eh_proj.weight"
    assert named.without_absent_mtp([layer]) is named and named.without_absent_mtp(None) is named
    with structlog.testing.capture_logs() as logs:
        assert plan_engine(EngineConfig(), absent).speculative is None
        assert plan_engine(EngineConfig(speculative=None), absent).speculative is None
        plan_engine(EngineConfig(), absent, log_choices=False)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["model.mtp_missing"]
    with pytest.raises(ConfigError) as info:
        plan_engine(EngineConfig(speculative=SpeculativeConfig(num_steps=2)), absent)
    assert info.value.field == "speculative" and "holds none of its tensors" in info.value.rule
    with pytest.raises(ConfigError) as info:  # a model with no MTP layer at all says so
        plan_engine(EngineConfig(speculative=SpeculativeConfig()),
                    attrs.evolve(named, num_nextn_predict_layers=0))
    assert "has none" in info.value.rule


def test_tokenizer_and_chat_template_name_existing_paths(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    config = EngineConfig(tokenizer=str(tmp_path), chat_template=str(template))
    assert (config.tokenizer, config.chat_template) == (str(tmp_path), str(template))
    for field, value, rule in (
        ("tokenizer", str(tmp_path / "missing"), "no such directory"),
        ("tokenizer", str(template), "no such directory"),
        ("tokenizer", 3, "must be a directory path"),
        ("chat_template", str(tmp_path), "no such file"),
        ("chat_template", "", "must be a file path"),
    ):
        with pytest.raises(ConfigError) as info:
            EngineConfig(**{field: value})
        assert info.value.field == field and rule in info.value.rule


# --- every field of the wrong type is a ConfigError naming it, never an AttributeError or TypeError ----

# field -> values of a type it does not take (a list of them: each is tried)
WRONG_TYPES = {
    "model": [3, None, ["tiny"], b"tiny"],
    "tokenizer": [3, ["dir"], b"dir"],
    "chat_template": [3, ["file"]],
    "device": [0, None, ["cpu"], {"cpu": 1}],
    "dtype": [torch.float32, None, 32, ["float32"]],
    "kv_cache_dtype": [torch.float8_e4m3fn, None, 8, ["fp8"]],
    "page_size": [16.0, "16", None, True],
    "max_context_len": [512.0, "512", True, [512]],
    "max_running_requests": [4.5, "4", True],
    "device_pool_tokens": [1024.0, "1024", True, [1024]],
    "device_memory_bytes": [1e9, "1GB", True],
    "device_memory_fraction": ["0.5", True, [0.5]],
    "chunked_prefill_tokens": [512.0, "512", True],
    "prefill_batch_tokens": [2048.0, "2048", True, ["auto"]],
    "mixed_steps": [1, "yes", None],
    "prefix_cache": [0, "no", None],
    "hisparse": ["yes", True, 128, {"device_buffer_size": 128}, SP()],
    "speculative": ["yes", True, 3, {"num_steps": 3}, HS()],
    "seed": [1.5, "0", None, True],
    "num_threads": [1.0, "1", True],
    "executor_thread": [1, "yes"],
    "tensor_parallel_size": [1.0, "2", None, True],
    "shared_host_pool": [1, "yes", None],
    "freeze_gc": [1, "yes", None],
    "cuda_graphs": [1, "yes", None],
}
HS_WRONG_TYPES = {
    "device_buffer_size": [128.0, "128", True, [128]],
    "host_to_device_ratio": [2.0, "2", True],
    "top_k": [64.0, "64", True],
    "policy": [None, 3, ["lru"]],
    "near_margin": [1.5, "1", True],
    "draft_rows_on_host": [1, "yes", None],
    "draft_keys_on_host": [1, "yes", None],
    "residency": [None, 1, ["dynamic"]],
}
SP_WRONG_TYPES = {
    "num_steps": [3.0, "3", None, True],
    "eagle_topk": [1.0, "1", None, True],
    "num_draft_tokens": [4.0, "4", True],
    "max_batch_size": [8.0, "8", True, ["auto"]],
    "max_context": [1024.0, "1024", True],
    "min_accept_length": ["2", True, [2]],
    "probe_every": [16.0, "16", None, True],
    "timed": [1, "yes", None],
    "plain_tail": [1, "yes", None],
    "plain_while_prefilling": [0, "no", None],
}


def _wrong(table):
    return [(field, value) for field, values in table.items() for value in values]


def test_every_field_has_wrong_typed_values_in_the_table():
    """A field added to a config gets its rows here too."""
    assert set(WRONG_TYPES) == {f.name for f in attrs.fields(EngineConfig)}
    assert set(HS_WRONG_TYPES) == {f.name for f in attrs.fields(HiSparseConfig)}
    assert set(SP_WRONG_TYPES) == {f.name for f in attrs.fields(SpeculativeConfig)}


@pytest.mark.parametrize(("field", "value"), _wrong(WRONG_TYPES), ids=repr)
def test_a_wrong_typed_engine_config_field_is_a_config_error_naming_it(field, value):
    with pytest.raises(ConfigError) as info:
        EngineConfig(**{field: value})
    assert info.value.field == field, str(info.value)


@pytest.mark.parametrize(
    ("config", "table"), [(HS, HS_WRONG_TYPES), (SP, SP_WRONG_TYPES)], ids=["hisparse", "speculative"]
)
def test_a_wrong_typed_nested_field_is_a_config_error_naming_it(config, table):
    prefix = "hisparse" if config is HS else "speculative"
    for field, value in _wrong(table):
        with pytest.raises(ConfigError) as info:
            config(**{field: value})
        assert info.value.field == f"{prefix}.{field}", (field, value, str(info.value))


# --- HOT defaults to the model's top-k when that is more than 128 ----------------------------------


def _model(index_topk: int, *, positions: int = 4096, mtp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(index_topk=index_topk, num_nextn_predict_layers=mtp,
                           max_position_embeddings=positions, absent_mtp_layers=0, num_hidden_layers=2,
                           kv_row_dim=80, index_head_dim=32)


@pytest.mark.parametrize(("index_topk", "page", "hot"), [
    (8, 16, 128), (128, 16, 128), (129, 16, 144), (2048, 16, 2048), (2048, 64, 2048), (300, 48, 336),
    (8, 48, 144),
])
def test_hot_unset_is_the_larger_of_128_and_the_models_top_k_in_whole_pages(index_topk, page, hot):
    from pipeline.config import auto_hot

    assert HS().device_buffer_size is None
    assert auto_hot(index_topk, page) == hot
    config = EngineConfig(page_size=page, speculative=None, device_pool_tokens=page * 1024)
    plan = plan_engine(config, _model(index_topk), log_choices=False)  # the model's rules passed
    assert plan.hot == plan.memory.hot == hot
    assert config.hisparse.device_buffer_size is None  # the config stays as given


def test_a_v32_sized_model_serves_without_hot_and_the_choice_is_logged():
    """index_topk 2048 (DeepSeek-V3.2): the default config resolves HOT 2048 and passes the model's
    rules; an explicit HOT below the top-k stays the clear error."""
    import structlog


    model = _model(2048, positions=163840)
    with structlog.testing.capture_logs() as logs:
        plan = plan_engine(EngineConfig(device_pool_tokens=65536), model)  # the model's rules passed
    assert plan.hot == 2048
    [event] = [e for e in logs if e["event"] == "config.hisparse.device_buffer_size"]
    assert event["device_buffer_size"] == 2048 and event["index_topk"] == 2048
    with pytest.raises(ConfigError) as info:
        plan_engine(EngineConfig(hisparse=HS(device_buffer_size=128)), model, log_choices=False)
    assert info.value.field == "hisparse.device_buffer_size" and "index_topk (2048)" in info.value.rule


def test_a_pool_too_small_for_the_resolved_hot_names_device_pool_tokens():

    config = EngineConfig(device_pool_tokens=1024, max_context_len=4096, speculative=None)
    with pytest.raises(ConfigError) as info:
        plan_engine(config, _model(2048), log_choices=False)
    assert info.value.field == "device_pool_tokens"


def test_hot_unset_is_resolved_under_a_budget_too():

    config = EngineConfig(device_memory_bytes=64 << 20, speculative=None)
    plan = plan_engine(config, _model(256, positions=8192, mtp=0), log_choices=False)
    assert plan.hot == 256
    assert plan.device_pool_tokens >= 256 + 16


def test_the_cli_leaves_hot_to_the_model():
    from pipeline.generate import build_parser as generate_parser
    from pipeline.generate import engine_config

    args = generate_parser().parse_args(["x"])
    assert engine_config(args).hisparse.device_buffer_size is None
    pytest.importorskip("uvicorn")
    from pipeline.server.serve import build_parser as serve_parser

    assert serve_parser().parse_args([]).hot is None
    assert serve_parser().parse_args(["--hot", "256"]).hot == 256


# --- a budget with an explicit device pool, before the ratio is chosen --------------------------------


def test_a_budget_with_an_explicit_pool_is_checked_once_the_ratio_is_chosen():
    """``hispec plan --context 2048 --device-memory 32MB --device-pool-tokens 100000`` ended in a
    TypeError: the pool was checked against a host_to_device_ratio a budget had not chosen yet."""
    config = EngineConfig(
        device_memory_bytes=32 << 20, device_pool_tokens=100_000 // 16 * 16, max_context_len=2048
    )
    assert config.hisparse.host_to_device_ratio is None


def test_plan_with_a_budget_and_an_explicit_pool_is_one_line_or_a_plan(capsys):
    import pipeline.cli as cli

    status = cli.main(
        ["plan", "--context", "2048", "--device-memory", "32MB", "--device-pool-tokens", "100000"]
    )
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    if status == 0:
        assert "HiSparse" in captured.out
    else:
        assert status == 2 and len(captured.err.splitlines()) == 1, captured.err
        assert "device_pool_tokens" in captured.err
