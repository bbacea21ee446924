"""Speculative counters (SGLang / vLLM names): accept length counts the bonus token, accept rate
does not.

Hand-built verify outcomes first (exact figures), then the per-request counters of a real run
through the executor and ``SyncDriver``, checked against what each verify returned and against the
request's output, and the executor's engine-wide counters against the sum of the requests'.
"""

from __future__ import annotations

import json
from collections import Counter
from fractions import Fraction

import hypothesis.strategies as st
import pytest
from _spec_util import oracle_drafter, quiet_logs
from hypothesis import given, settings

from pipeline.config import EngineConfig, SpeculativeConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.model.tokenizer import ByteTokenizer
from pipeline.request import Request
from pipeline.sampling import SamplingParams
from pipeline.speculative.metrics import SpecCounters

# --- hand-built outcomes ---------------------------------------------------------------------------


def counters(num_steps: int, accepted: list[int]) -> SpecCounters:
    c = SpecCounters(num_steps)
    for a in accepted:
        c.record(a)
    return c


def test_hand_built_rounds_give_exact_figures():
    c = counters(3, [0, 3, 1, 3, 2])  # committed per verify: 1, 4, 2, 4, 3 = 14 over 5 rounds
    assert c.verify_rounds == 5
    assert c.proposed_drafts == 15
    assert c.accepted_drafts == 9
    assert c.accept_length == 14 / 5  # the bonus token included
    assert c.accept_rate == 9 / 15  # the bonus token excluded
    # position j counts the rounds whose drafts 0..j were all accepted: a > j
    assert c.accepted_per_pos == [4, 3, 2]
    assert c.accept_length_histogram == {1: 1, 2: 1, 3: 1, 4: 2}
    d = c.as_dict()
    assert d == {
        "verify_rounds": 5,
        "proposed_drafts": 15,
        "accepted_drafts": 9,
        "accept_length": 2.8,
        "accept_rate": 0.6,
        "accepted_per_pos": [4, 3, 2],
        "accept_length_histogram": {1: 1, 2: 1, 3: 1, 4: 2},
    }
    assert list(d["accept_length_histogram"]) == [1, 2, 3, 4], "histogram keys sorted"
    d["accepted_per_pos"].append(0)
    d["accept_length_histogram"][9] = 1
    assert c.accepted_per_pos == [4, 3, 2] and 9 not in c.accept_length_histogram, "as_dict copies"


def test_no_verify_round_yet():
    c = SpecCounters(4)
    assert c.accept_length is None and c.accept_rate is None
    assert c.accepted_per_pos == [0, 0, 0, 0]
    assert c.as_dict()["accept_length_histogram"] == {}
    assert c.as_dict()["verify_rounds"] == 0


def test_every_draft_accepted():
    c = counters(4, [4] * 10)
    assert (c.accept_length, c.accept_rate) == (5.0, 1.0)
    assert c.accepted_per_pos == [10, 10, 10, 10]
    assert c.accept_length_histogram == {5: 10}


def test_every_draft_rejected():
    c = counters(2, [0] * 7)
    assert (c.accept_length, c.accept_rate) == (1.0, 0.0)  # the bonus token alone per verify
    assert c.accepted_per_pos == [0, 0]
    assert c.accept_length_histogram == {1: 7}
    assert c.proposed_drafts == 14


@pytest.mark.parametrize("bad", [-1, 3])
def test_an_impossible_round_is_refused_and_counts_nothing(bad):
    c = counters(2, [1, 2])
    before = c.as_dict()
    with pytest.raises(ValueError, match="accepted"):
        c.record(bad)
    assert c.as_dict() == before


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6).flatmap(lambda k: st.tuples(st.just(k), st.lists(st.integers(0, k), max_size=30))))
def test_counters_agree_with_their_definitions(case):
    k, accepted = case
    c = counters(k, accepted)
    rounds, total = len(accepted), sum(accepted)
    assert (c.verify_rounds, c.accepted_drafts, c.proposed_drafts) == (rounds, total, k * rounds)
    assert c.accepted_per_pos == [sum(a > j for a in accepted) for j in range(k)]
    assert c.accept_length_histogram == dict(Counter(a + 1 for a in accepted))
    if not rounds:
        assert c.accept_length is None and c.accept_rate is None
        return
    assert c.accept_length == float(Fraction(total + rounds, rounds))
    assert c.accept_rate == float(Fraction(total, k * rounds))
    # the same totals, seen through the per-position counts and through the histogram
    assert sum(c.accepted_per_pos) == total
    assert all(x >= y for x, y in zip(c.accepted_per_pos, c.accepted_per_pos[1:]))
    assert sum(c.accept_length_histogram.values()) == rounds
    assert sum(n * m for n, m in c.accept_length_histogram.items()) == total + rounds
    assert all(1 <= n <= k + 1 for n in c.accept_length_histogram)


def test_a_request_creates_its_counters_at_its_first_verify():
    req = Request("r", (1, 2, 3), SamplingParams(), ByteTokenizer(eos_token_id=256), 64)
    m = req.metrics
    assert m.spec is None and m.spec_accept_length is None and m.spec_accept_rate is None
    assert m.as_dict()["spec"] is None
    for a in (2, 0, 3):
        req.record_verify(a, 3)
    assert m.spec.num_steps == 3 and m.spec.verify_rounds == 3
    assert m.spec_accept_length == (5 + 3) / 3
    assert m.spec_accept_rate == 5 / 9
    assert m.spec.accepted_per_pos == [2, 2, 1]
    data = m.as_dict()
    assert data["spec"] == m.spec.as_dict()
    assert data["num_prompt_tokens"] == 3
    json.dumps(data)  # serialisable as it is (histogram keys become strings)


# --- a real run -----------------------------------------------------------------------------------

NUM_STEPS = 3
MAX_NEW = 20
PROMPT_LENS = (3, 9, 17, 30, 5)


def run_config(num_steps: int | None) -> EngineConfig:
    return EngineConfig(
        dtype="float64",
        page_size=8,
        max_context_len=128,
        max_running_requests=8,
        device_pool_tokens=1024,
        hisparse=None,
        speculative=SpeculativeConfig(num_steps=num_steps, max_batch_size=None, timed=False,
                                      min_accept_length=None, plain_tail=False, plain_while_prefilling=False)
        if num_steps else None,
    )


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * n) % 256 for i in range(n)] for n in PROMPT_LENS]


def params() -> list[SamplingParams]:
    # the last request ends with its first token, at the prefill: it never verifies
    return [SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)] * (len(PROMPT_LENS) - 1) + [
        SamplingParams(max_new_tokens=1, ignore_eos=True)
    ]


@pytest.fixture(scope="module")
def plain_run(tiny_model):
    executor = Executor(run_config(None), model=tiny_model)
    with quiet_logs():
        reqs = SyncDriver(executor).generate(prompts(), params())
    return reqs, executor


@pytest.fixture
def spec_run(tiny_model, plain_run, monkeypatch):
    """Oracle drafts (every accept length occurs); every verify's outcome recorded per request."""
    truth = {f"req-{i}": [*r.prompt_ids, *r.output_ids] for i, r in enumerate(plain_run[0])}
    executor = Executor(run_config(NUM_STEPS), model=tiny_model)
    oracle_drafter(monkeypatch, executor, truth)
    rounds: dict[str, list[tuple[int, tuple[int, ...]]]] = {}
    real_verify = executor.verify

    def verify(request_ids):
        result = real_verify(request_ids)
        for rid, tokens in result.tokens.items():
            rounds.setdefault(rid, []).append((result.accepted[rid], tokens))
        return result

    executor.verify = verify
    with quiet_logs():
        reqs = SyncDriver(executor, check=True).generate(prompts(), params())
    return reqs, executor, rounds


def test_plain_decoding_has_no_speculative_counters(plain_run):
    reqs, executor = plain_run
    assert executor.spec_counters is None and executor.stats()["speculative"] is None
    for r in reqs:
        assert r.metrics.spec is None and r.metrics.spec_accept_length is None
        assert r.metrics.as_dict()["spec"] is None


def test_per_request_counters_match_the_verify_rounds_and_the_output(spec_run, plain_run):
    reqs, _, rounds = spec_run
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain_run[0]]
    for req in reqs[:-1]:
        log = rounds[req.request_id]
        accepted = [a for a, _ in log]
        assert all(len(tokens) == a + 1 for a, tokens in log), "a verify commits a + 1 tokens"
        spec = req.metrics.spec
        assert spec.num_steps == NUM_STEPS
        assert spec.verify_rounds == len(log)
        assert spec.proposed_drafts == NUM_STEPS * len(log)
        assert spec.accepted_drafts == sum(accepted)
        assert spec.accepted_per_pos == [sum(a > j for a in accepted) for j in range(NUM_STEPS)]
        assert spec.accept_length_histogram == dict(Counter(a + 1 for a in accepted))
        assert req.metrics.spec_accept_length == (sum(accepted) + len(log)) / len(log)
        assert req.metrics.spec_accept_rate == sum(accepted) / (NUM_STEPS * len(log))
        assert req.metrics.as_dict()["spec"] == spec.as_dict()

        # against the output: the prefill's token, then every verify's tokens, the last round's
        # cut at max_new_tokens
        out = req.output_ids
        assert len(out) == MAX_NEW == req.metrics.num_generation_tokens
        assert out == ([out[0]] + [t for _, tokens in log for t in tokens])[:MAX_NEW]
        committed = 1 + sum(n * m for n, m in spec.accept_length_histogram.items())
        assert committed == 1 + spec.accepted_drafts + spec.verify_rounds
        assert 0 <= committed - len(out) <= NUM_STEPS, "only the last round's overshoot is dropped"
        assert committed - len(log[-1][1]) < MAX_NEW, "the request ended in its last round"
        assert sum(spec.accepted_per_pos) == spec.accepted_drafts
        assert sum(spec.accept_length_histogram.values()) == spec.verify_rounds


def test_a_request_that_ends_at_prefill_has_no_verify_counters(spec_run):
    reqs, _, rounds = spec_run
    last = reqs[-1]
    assert len(last.output_ids) == 1 and last.request_id not in rounds
    assert last.metrics.spec is None and last.metrics.spec_accept_rate is None


def test_engine_wide_counters_are_the_sum_of_the_requests(spec_run):
    reqs, executor, _ = spec_run
    total = executor.spec_counters
    per_request = [r.metrics.spec for r in reqs if r.metrics.spec is not None]
    assert total.num_steps == NUM_STEPS
    for name in ("verify_rounds", "proposed_drafts", "accepted_drafts"):
        assert getattr(total, name) == sum(getattr(s, name) for s in per_request), name
    assert total.accepted_per_pos == [sum(col) for col in zip(*(s.accepted_per_pos for s in per_request))]
    hist = Counter()
    for s in per_request:
        hist.update(s.accept_length_histogram)
    assert total.accept_length_histogram == dict(hist)
    assert set(hist) == set(range(1, NUM_STEPS + 2)), "the oracle drafter yields every accept length"
    assert total.accept_rate == total.accepted_drafts / total.proposed_drafts
    assert executor.stats()["speculative"] == total.as_dict()
