"""Penalties, logit bias, ``min_tokens`` and log-probabilities: the formulas, and speculation lossless
under each of them.

* ``adjust_logits`` against the definitions written out by hand (vLLM's and OpenAI's);
* greedy speculative decoding equals plain greedy decoding under every adjustment, with drafts
  accepted in part (the oracle drafter), so each verify position's adjustment counts the drafts
  before it;
* the log-probabilities a request reports equal the log-softmax (float64) of the logits the engine
  computed for that token, greedy and sampled, plain and speculative.
"""

from __future__ import annotations

import math

import pytest
import torch
from _spec_util import oracle_drafter, quiet_logs
from test_lossless import config, make_prompts

from pipeline.driver import SyncDriver
from pipeline.errors import RequestError
from pipeline.executor import Executor
from pipeline.sampling import LogitContext, SamplingParams, adjust_logits, logprob_row

MAX_NEW = 20


def test_adjust_logits_follows_the_definitions():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, generator=gen, dtype=torch.float64)
    context = LogitContext(prompt_ids=(1, 2), output_ids=(3, 3, 4), end_ids=frozenset({0, 7}))
    params = SamplingParams(
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5, logit_bias={5: 2.0, 9: -1.0},
        min_tokens=4,
    )
    got = adjust_logits(logits, params, context)
    want = logits.clone().tolist()
    for t in (0, 7):  # 3 output tokens < min_tokens: the end tokens cannot be drawn
        want[t] = -math.inf
    want[5] += 2.0
    want[9] -= 1.0
    for t in (1, 2, 3, 4):  # seen in prompt or output
        want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
    counts = {3: 2, 4: 1}  # output only
    for t, c in counts.items():
        want[t] -= 0.25 * c + 0.5
    assert got.tolist() == pytest.approx(want)
    # at min_tokens output tokens the end tokens are free again
    later = adjust_logits(logits, SamplingParams(min_tokens=3), context)
    assert torch.equal(later, logits)


def test_logprob_row_is_the_sampling_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0], dtype=torch.float64)
    greedy = logprob_row(logits, SamplingParams())
    assert torch.allclose(greedy, torch.log_softmax(logits, -1))
    hot = logprob_row(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(hot, torch.log_softmax(logits / 0.5, -1))
    top2 = logprob_row(logits, SamplingParams(temperature=1.0, top_k=2))
    assert math.isinf(top2[2]) and math.isinf(top2[3])
    assert torch.allclose(top2[:2], torch.log_softmax(logits[:2], -1))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5), ("frequency_penalty", float("nan")), ("repetition_penalty", 0.0),
        ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0}), ("min_tokens", -1), ("min_tokens", 65),
        ("logprobs", 21), ("logprobs", True),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(RequestError) as err:
        SamplingParams(**{field: value}).validate()
    assert err.value.field == field


def test_logit_bias_ids_are_checked_against_the_vocabulary(tiny_model):
    executor = Executor(config(False, None), model=tiny_model)
    with pytest.raises(RequestError) as err:
        executor.validate([1, 2, 3], SamplingParams(logit_bias={tiny_model.cfg.vocab_size: 1.0}))
    assert err.value.field == "logit_bias"
    executor.close()


def _run(model, cfg, prompts, params, monkeypatch=None, truth=None):
    executor = Executor(cfg, model=model)
    if truth is not None:
        oracle_drafter(monkeypatch, executor, truth)
    driver = SyncDriver(executor, check=True)
    with quiet_logs():
        reqs = driver.generate(prompts, params)
    assert executor.pool_counts() == Executor(cfg, model=model).pool_counts()
    executor.close()
    return reqs


ADJUSTED = {
    "repetition": dict(repetition_penalty=1.8),
    "presence-frequency": dict(presence_penalty=1.5, frequency_penalty=0.8),
    "bias": dict(logit_bias={7: 3.0, 11: 2.5, 200: -50.0}),
    "min-tokens": dict(min_tokens=12),
}


@pytest.mark.parametrize("hisparse", [False, True], ids=["resident", "hisparse"])
@pytest.mark.parametrize("name", list(ADJUSTED))
def test_speculation_is_lossless_under_every_adjustment(tiny_model, monkeypatch, hisparse, name):
    prompts = make_prompts(8, seed=3)[:4]
    base = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, **ADJUSTED[name])
    if name == "min-tokens":  # a stop id that greedy decoding reaches early, kept out until min_tokens
        first = _run(tiny_model, config(hisparse, None), prompts, base)
        stop = (first[0].output_ids[1],)
        base = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=stop)
        params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=stop, min_tokens=12)
        assert len(_run(tiny_model, config(hisparse, None), prompts[:1], base)[0].output_ids) == 2
    plain = _run(tiny_model, config(hisparse, None), prompts, params)
    unadjusted = _run(tiny_model, config(hisparse, None), prompts, base)
    assert [r.output_ids for r in plain] != [r.output_ids for r in unadjusted], "the adjustment must matter"
    if name == "min-tokens":
        assert all(len(r.output_ids) >= 12 for r in plain)
    truth = {f"req-{i}": [*r.prompt_ids, *r.output_ids] for i, r in enumerate(plain)}
    spec = _run(tiny_model, config(hisparse, 3), prompts, params, monkeypatch, truth)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]


class LogitsRecorder:
    """Every row of logits the model computes, in order (one request decoding plainly: one row a
    token, the prefill's last row first)."""

    def __init__(self, model):
        self.rows: list[torch.Tensor] = []
        self._logits = model.logits
        model.logits = self

    def __call__(self, hidden):
        out = self._logits(hidden)
        self.rows.extend(out.detach().to(torch.float64).clone())
        return out


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_the_log_softmax_of_the_engines_logits(temperature):
    from tiny_models import build_tiny_model

    model = build_tiny_model(seed=5)
    prompt = make_prompts(8, seed=9)[3]
    recorder = LogitsRecorder(model)
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, temperature=temperature, seed=11,
                            logprobs=3)
    (req,) = _run(model, config(False, None), [prompt], params)
    rows = recorder.rows[-MAX_NEW:]  # the pool check's empty executor computes no logits
    assert len(req.output_logprobs) == MAX_NEW
    for token, entry, row in zip(req.output_ids, req.output_logprobs, rows):
        want = torch.log_softmax(row / (temperature or 1.0), -1)
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(want[token]), abs=1e-9)
        order = torch.sort(want, descending=True, stable=True).indices[:3].tolist()
        assert [t for t, _ in entry.top] == order
        assert [lp for _, lp in entry.top] == pytest.approx(want[order].tolist(), abs=1e-9)
    if temperature == 0:
        assert all(entry.top[0][0] == entry.token_id for entry in req.output_logprobs)


@pytest.mark.parametrize("hisparse", [False, True], ids=["resident", "hisparse"])
def test_speculative_logprobs_equal_plain_ones(tiny_model, monkeypatch, hisparse):
    prompts = make_prompts(8, seed=4)[:3]
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=2, repetition_penalty=1.3)
    plain = _run(tiny_model, config(hisparse, None), prompts, params)
    truth = {f"req-{i}": [*r.prompt_ids, *r.output_ids] for i, r in enumerate(plain)}
    spec = _run(tiny_model, config(hisparse, 3), prompts, params, monkeypatch, truth)
    for p, s in zip(plain, spec):
        assert s.output_ids == p.output_ids
        assert [e.token_id for e in s.output_logprobs] == p.output_ids
        for a, b in zip(s.output_logprobs, p.output_logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-9)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
