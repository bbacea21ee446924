"""Speculative greedy decoding equals plain greedy decoding, token for token.

A random tiny model's MTP head almost never agrees with its target, so on its own it would only
test the all-rejected path. The *oracle drafter* used here replaces the MTP's proposals by the
true continuation (known from a plain run) with one deliberate error at a pseudo-random draft
position per round, so every accept length from 1 to num_steps + 1 occurs and the verify, finalize
and draft-extend paths run with partial acceptance. The bundled model is checked with its real MTP
head in ``test_bundled.py``.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from _spec_util import RandomSwitch, oracle_drafter, quiet_logs

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import SyncDriver, prefill_whole
from pipeline.executor import Executor
from pipeline.messages import Mixed
from pipeline.sampling import SamplingParams
from pipeline.scheduler import split

from tiny_models import build_tiny_model

PAGE = 8  # the draft zone holds PAGE - 1 = 7 verify tokens: num_steps 1..6 are allowed
HOT = 16
MAX_NEW = 24


def config(hisparse: bool, num_steps: int | None) -> EngineConfig:
    return EngineConfig(
        dtype="float64",
        page_size=PAGE,
        max_context_len=320,
        max_running_requests=8,
        device_pool_tokens=1024,
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2) if hisparse else None,
        speculative=SpeculativeConfig(num_steps=num_steps, max_batch_size=None, timed=False,
                                       min_accept_length=None, plain_tail=False, plain_while_prefilling=False)
        if num_steps else None,
    )


def make_prompts(batch: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = [3, HOT - 2, HOT, 2 * HOT + 5, 9 * HOT + 1, 7, 50, HOT + 1][:batch]  # crossing HOT
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]


def generate(model, cfg, prompts, monkeypatch=None, truth=None):
    executor = Executor(cfg, model=model)
    if truth is not None:
        oracle_drafter(monkeypatch, executor, truth)
    driver = SyncDriver(executor, check=True)
    with quiet_logs():
        reqs = driver.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    empty = Executor(cfg, model=model).pool_counts()
    assert executor.pool_counts() == empty, "a pool did not return to its initial free count"
    executor.close()
    return reqs, executor


def plain_with_lengths(model, hisparse: bool, prompts, lengths):
    """Plain greedy decoding of ``prompts``, each for its own number of tokens: the requests, and
    each one's full token sequence by request id (what the oracle drafter proposes from)."""
    driver = SyncDriver(Executor(config(hisparse, None), model=model), check=True)
    with quiet_logs():
        plain = [
            driver.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, lengths)
        ]
        driver.run()
    return plain, {r.request_id: [*p, *r.output_ids] for r, p in zip(plain, prompts)}


def check_partial_acceptance(model, monkeypatch, hisparse, num_steps, prompts):
    plain, _ = generate(model, config(hisparse, None), prompts)
    truth = {f"req-{i}": [*r.prompt_ids, *r.output_ids] for i, r in enumerate(plain)}
    spec, executor = generate(model, config(hisparse, num_steps), prompts, monkeypatch, truth)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    lengths = executor.spec_counters.accept_length_histogram
    assert len(lengths) == num_steps + 1 or sum(lengths.values()) < 3 * (num_steps + 1)
    assert max(lengths) > 1, "the oracle drafter must get drafts accepted"


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("hisparse", [False, True], ids=["resident", "hisparse"])
@pytest.mark.parametrize("num_steps", [1, 2, 3, 4, 5, 6])
def test_every_num_steps_with_partial_acceptance(tiny_model, monkeypatch, hisparse, num_steps, batch):
    """num_steps 1..6 is every value HiSparse allows with PAGE = 8; batch 1 takes the prompt of
    2 * HOT + 5 tokens (HiSparse swaps from the first step), batch 8 all the lengths."""
    prompts = make_prompts(8, seed=num_steps)
    prompts = prompts if batch == 8 else prompts[3:4]
    check_partial_acceptance(tiny_model, monkeypatch, hisparse, num_steps, prompts)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("num_steps", [7, 9])
def test_resident_num_steps_beyond_the_draft_zone(tiny_model, monkeypatch, num_steps, batch):
    """Without HiSparse the config sets no upper bound on num_steps (the D <= PAGE - 1 rule is
    HiSparse's draft zone): 7 (D = 8 = PAGE) and 9 (D = 10 > PAGE verify tokens per round)."""
    prompts = make_prompts(8, seed=num_steps)
    prompts = prompts if batch == 8 else prompts[3:4]
    check_partial_acceptance(tiny_model, monkeypatch, False, num_steps, prompts)


@pytest.mark.parametrize("batch", range(1, 9))
def test_batch_sizes_with_the_random_mtp_head(batch):
    """The model's own (random) MTP head: whatever it drafts, the output is plain greedy's."""
    model = build_tiny_model(seed=batch, index_topk=4)
    prompts = make_prompts(batch, seed=100 + batch)
    for hisparse in (False, True):
        plain, _ = generate(model, config(hisparse, None), prompts)
        spec, _ = generate(model, config(hisparse, 3), prompts)
        assert [r.output_ids for r in spec] == [r.output_ids for r in plain]


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "resident"])
def test_greedy_output_unchanged_while_switching_between_rounds_and_plain_steps(
    tiny_model, monkeypatch, hisparse, batch
):
    """Adaptive speculation forced at random (each turn a round or a plain step, by a coin): greedy
    tokens equal plain decoding's; the MTP layer is caught up over plainly decoded positions."""
    prompts = make_prompts(batch, seed=40 + batch)
    plain, _ = generate(tiny_model, config(hisparse, None), prompts)
    truth = {r.request_id: [*p, *r.output_ids] for r, p in zip(plain, prompts)}
    executor = Executor(config(hisparse, 3), model=tiny_model)
    oracle_drafter(monkeypatch, executor, truth)
    policy = RandomSwitch(seed=batch)
    driver = SyncDriver(executor, check=True, spec_policy=policy)
    with quiet_logs():
        reqs = driver.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    assert policy.rounds > 0 and policy.plain > 0
    assert executor.spec_counters.accepted_drafts > 0
    executor.close()


def test_default_adaptive_rule_decodes_plainly_above_its_batch_size(tiny_model):
    """The default ``SpeculativeConfig``: past ``max_batch_size`` requests a step is a plain one."""
    prompts = make_prompts(8, seed=3)
    cfg = EngineConfig(
        dtype="float64", page_size=PAGE, max_context_len=320, max_running_requests=8, device_pool_tokens=1024,
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2),
        speculative=SpeculativeConfig(num_steps=3, max_batch_size=4),
    )
    plain, _ = generate(tiny_model, config(True, None), prompts)
    executor = Executor(cfg, model=tiny_model)
    driver = SyncDriver(executor, check=True)
    with quiet_logs():
        reqs = driver.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    assert executor.spec_counters.verify_rounds == 0  # 8 requests stepped together: never a round
    executor.close()


@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "resident"])
def test_long_plain_runs_keep_a_bounded_catch_up_and_rounds_resume_exactly(tiny_model, monkeypatch, hisparse):
    """Two requests over ``max_batch_size`` 1 decode plainly for dozens of steps: the MTP layer is
    caught up every ``MtpLedger.catch_up_after`` plain steps (the hidden states a request keeps stay
    bounded), and once the short one finishes the long one speculates alone, with plain decoding's
    tokens."""
    catch_up_after = 16
    prompts = make_prompts(2, seed=5)
    lengths = (catch_up_after * 2 + 20, catch_up_after * 2 + 6)
    plain, truth = plain_with_lengths(tiny_model, hisparse, prompts, lengths)
    cfg = attrs.evolve(
        config(hisparse, 3), speculative=SpeculativeConfig(num_steps=3, max_batch_size=1, timed=False)
    )
    executor = Executor(cfg, model=tiny_model)
    executor.mtp.catch_up_after = catch_up_after
    oracle_drafter(monkeypatch, executor, truth)
    driver = SyncDriver(executor, check=True)
    with quiet_logs():
        reqs = [
            driver.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, lengths)
        ]
        most = 0
        while driver.step():
            most = max([most, *(executor.mtp.held(rid) for rid in executor.seqs)])
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    assert 0 < most < catch_up_after  # caught up as soon as catch_up_after were held
    assert executor.spec_counters.verify_rounds > 0 and executor.spec_counters.accepted_drafts > 0
    executor.close()


@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "resident"])
def test_plain_tails_and_prefill_pauses_keep_the_tokens(tiny_model, monkeypatch, hisparse):
    """``plain_tail`` and ``plain_while_prefilling`` on, rounds otherwise always: a request that
    arrives while another decodes is prefilled in chunks that ride in plain decode steps (mixed
    steps), rounds resume when its prompt is done, no round runs once every stream is within D
    tokens of its end, and the tokens are plain decoding's."""
    prompts = make_prompts(5, seed=13)[3:5]  # 37 and 145 tokens
    cfg = attrs.evolve(config(hisparse, None), chunked_prefill_tokens=24)
    plain_ex = Executor(cfg, model=tiny_model)
    plain_driver = SyncDriver(plain_ex, check=True)
    with quiet_logs():
        plain = plain_driver.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    truth = {r.request_id: [*p, *r.output_ids] for r, p in zip(plain, prompts, strict=True)}
    spec = SpeculativeConfig(num_steps=3, max_batch_size=None, timed=False, min_accept_length=None)
    executor = Executor(attrs.evolve(cfg, speculative=spec), model=tiny_model)
    oracle_drafter(monkeypatch, executor, truth)
    left_at_rounds, mixed = [], []
    real_verify, real_run = executor.verify, executor.run

    def verify(request_ids):
        left_at_rounds.append(max(executor.seqs[rid].params.max_new_tokens - len(executor.seqs[rid].produced)
                                  for rid in request_ids))
        return real_verify(request_ids)

    def run(command, idle=True):
        outcome = real_run(command, idle=idle)
        if isinstance(command, Mixed):
            mixed.extend(o.mixed for o in split(outcome) if o.mixed)
        return outcome

    executor.verify, executor.run = verify, run
    driver = SyncDriver(executor, check=True)
    with quiet_logs():
        first = driver.submit(prompts[0], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
        for _ in range(4):
            driver.step()
        second = driver.submit(prompts[1], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
        driver.run()
    assert [first.output_ids, second.output_ids] == [r.output_ids for r in plain]
    assert left_at_rounds and min(left_at_rounds) >= 4  # D = 4: the last 3 tokens of each stream are plain
    assert mixed  # the second prompt's chunks rode in plain steps of the first request
    assert executor.spec_counters.verify_rounds > 0 and executor.spec_counters.accepted_drafts > 0
    executor.close()


def test_a_batch_that_never_speculates_never_runs_the_draft_layer(tiny_model, monkeypatch):
    """The MTP layer's draft extend is deferred from prefill to the first round that needs it: over
    ``max_batch_size`` requests that never comes (in fewer than ``MtpLedger.catch_up_after`` steps), so
    the speculative config costs what plain decoding does (without a prefix cache, which would want the
    MTP rows of the pages it keeps); the tokens are plain decoding's."""
    import pipeline.executor as executor_module

    calls = []
    real = executor_module.draft_extend
    monkeypatch.setattr(executor_module, "draft_extend", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = make_prompts(3, seed=9)
    plain, _ = generate(tiny_model, config(True, None), prompts)
    cfg = attrs.evolve(
        config(True, 3), speculative=SpeculativeConfig(num_steps=3, max_batch_size=2), prefix_cache=False
    )
    reqs, executor = generate(tiny_model, cfg, prompts)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    assert executor.spec_counters.verify_rounds == 0 and calls == []
    reqs, executor = generate(tiny_model, cfg, prompts[:1])  # alone: rounds, the first one catches up
    assert reqs[0].output_ids == plain[0].output_ids
    assert executor.spec_counters.verify_rounds > 0 and calls


@pytest.mark.parametrize("eager", [False, True], ids=["rows-left-for-later", "caught-up-on-leaving"])
def test_a_request_that_never_speculated_still_leaves_its_pages_to_the_prefix_cache(tiny_model, eager):
    """Its pages go to the cache with its MTP rows as hidden states (or, over
    ``MtpLedger.pending_limit``, caught up as it leaves), so the next request with the same prompt
    hits."""
    cfg = attrs.evolve(
        config(True, 3), speculative=SpeculativeConfig(num_steps=3, max_batch_size=1), prefix_cache=True
    )
    executor = Executor(cfg, model=tiny_model)
    if eager:
        executor.mtp.pending_limit = 0
    prompt = make_prompts(4, seed=11)[3]  # 37 tokens
    driver = SyncDriver(executor, check=True)
    with quiet_logs():
        first = [driver.submit(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True)) for _ in range(2)]
        driver.run()  # two at once over max_batch_size 1: plain steps only, the extend deferred
        assert executor.spec_counters.verify_rounds == 0
        assert executor.memory.cache.pending_positions == (0 if eager else (len(prompt) + 8) // PAGE * PAGE)
        again = driver.submit(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
        driver.run()
    assert again.metrics.cached_tokens >= PAGE * (len(prompt) // PAGE) - PAGE
    assert again.output_ids == first[0].output_ids == first[1].output_ids
    executor.close()


@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "resident"])
def test_rows_only_draft_extend_proposes_what_one_forward_proposes(tiny_model, monkeypatch, hisparse):
    """A draft extend stores the rows of the positions whose outputs it does not read alone, then runs
    the full forward over the proposing positions only. With the model's own MTP head (float64) it
    proposes every draft a single forward over all positions proposes, round after round."""
    from pipeline.speculative import drafting

    drafted: dict[int, list[int]] = {}
    seen = _record_proposals(monkeypatch)

    def run(rows_only_min: int) -> list[list[int]]:
        monkeypatch.setattr(drafting, "ROWS_ONLY_MIN", rows_only_min)
        seen.clear()
        reqs, _ = generate(tiny_model, config(hisparse, 3), make_prompts(6, seed=13))
        drafted[rows_only_min] = list(seen)
        return [r.output_ids for r in reqs]

    split, whole = run(1), run(10**9)
    assert split == whole
    assert len(drafted[1]) > 50 and drafted[1] == drafted[10**9]


def _decode_plainly(executor, ids, prompts, params, steps: int) -> None:
    """Admit and prefill ``prompts`` as ``ids``, then ``steps`` plain decode steps of all of them
    (no round: every MTP row behind)."""
    from pipeline.executor import NewSequence

    prefill_whole(executor, [NewSequence(rid, tuple(p), params) for rid, p in zip(ids, prompts)])
    executor.wait_staging()
    executor.collect_ready()
    for _ in range(steps):
        executor.decode(ids)


def test_requests_leaving_together_catch_up_in_one_extend_that_proposes_nothing(tiny_model, monkeypatch):
    """Requests that never speculated and leave in one ``Release`` get their MTP rows in a single
    draft extend, which proposes nothing (their generators are left alone), over the positions of
    their full pages only (the last page's others are freed with them); their pages go to the
    prefix cache, and a request retracted the same way leaves its pages too."""
    import pipeline.executor as executor_module
    from pipeline.messages import Release

    calls = []
    real = executor_module.draft_extend
    monkeypatch.setattr(
        executor_module, "draft_extend", lambda m, mem, inputs: calls.append(inputs) or real(m, mem, inputs)
    )
    cfg = attrs.evolve(
        config(True, 3), speculative=SpeculativeConfig(num_steps=3, max_batch_size=1), prefix_cache=True
    )
    executor = Executor(cfg, model=tiny_model)
    executor.mtp.pending_limit = 0  # nothing left for later: every row is written on leaving
    prompts = make_prompts(8, seed=17)[3:6]  # 37, 145 and 7 tokens
    params = SamplingParams(max_new_tokens=64, temperature=1.0, seed=5)
    ids = [f"r{i}" for i in range(3)]
    with quiet_logs():
        _decode_plainly(executor, ids, prompts, params, 20)
        states = [executor.seqs[rid].generator.get_state() for rid in ids]
        assert calls == []
        executor.run(Release(tuple(ids[:2])))
        assert len(calls) == 1 and len(calls[0]) == 2
        assert not any(x.propose for x in calls[0])
        executor.run(Release((ids[2],), keep_sampling_state=True))  # a retraction
        assert len(calls) == 2 and not calls[1][0].propose
    for x, prompt in zip([*calls[0], *calls[1]], prompts):  # up to the last full page, none of the rest
        assert x.start + len(x.next_ids) == (len(prompt) + 20) // PAGE * PAGE
    # its generator untouched
    assert torch.equal(executor.requests.sampling_state[ids[2]].get_state(), states[2])
    full = sum((len(p) + 20) // PAGE for p in prompts)
    assert executor.memory.cache_stats()["pages_held"] == full
    executor.close()


def _record_proposals(monkeypatch) -> list[int]:
    from pipeline.speculative import drafting

    seen: list[int] = []
    real = drafting.propose_rows

    def spy(*args):
        out = real(*args)
        seen.extend(token for token, _ in out)
        return out

    monkeypatch.setattr(drafting, "propose_rows", spy)
    return seen


@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "resident"])
def test_mtp_rows_left_to_the_cache_are_written_by_the_first_request_that_shares_them(tiny_model, monkeypatch,
                                                                                     hisparse):
    """Requests that decoded plainly leave their pages with the hidden states in place of the MTP
    rows (no draft extend as they leave); the request that hits them writes those rows at its
    admission, in one extend that proposes nothing, and then drafts exactly what it drafts after an
    eager catch-up on leaving: the same rows (float64, the model's own MTP head), so the same
    proposals, round after round, and plain decoding's tokens. Cached pages nobody shares again
    drop their hidden states when evicted, and every pool returns to its initial count."""
    import pipeline.executor as executor_module
    from pipeline.messages import Release

    prompts = make_prompts(8, seed=23)[3:5]  # 37 and 145 tokens
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain, _ = generate(tiny_model, attrs.evolve(config(hisparse, None), prefix_cache=True), prompts[1:])
    seen = _record_proposals(monkeypatch)
    extends = []
    real = executor_module.draft_extend
    monkeypatch.setattr(
        executor_module, "draft_extend", lambda m, mem, inputs: extends.append(inputs) or real(m, mem, inputs)
    )

    def run(eager: bool):
        cfg = attrs.evolve(config(hisparse, 3), prefix_cache=True)
        executor = Executor(cfg, model=tiny_model)
        if eager:
            executor.mtp.pending_limit = 0
        ids = ["a", "b"]
        seen.clear()
        extends.clear()
        with quiet_logs():
            _decode_plainly(executor, ids, prompts, params, 10)
            assert extends == [] and seen == []
            executor.run(Release(tuple(ids)))
            on_leaving = len(extends)
            cache = executor.memory.cache
            full = [(len(p) + 10) // PAGE * PAGE for p in prompts]
            assert cache.pending_positions == (0 if eager else sum(full))
            executor.check_integrity()
            driver = SyncDriver(executor, check=True)
            again = driver.submit(prompts[1], params)
            driver.run()
        hit = len(prompts[1]) // PAGE * PAGE
        assert again.metrics.cached_tokens == hit
        if not eager:  # written at the hit's admission, for the pages it shares only
            assert on_leaving == 0 and not any(x.propose for x in extends[0])
            spans = [(x.start, len(x.next_ids)) for x in extends[0]]
            assert spans == [(i, PAGE) for i in range(0, hit, PAGE)]
            assert cache.pending_positions == full[0] + full[1] - hit
        else:
            assert on_leaving == 1
        assert executor.spec_counters.verify_rounds > 0
        outputs, proposals = again.output_ids, list(seen)
        executor.flush_prefix_cache()
        assert cache.pending_positions == 0
        executor.check_integrity()
        assert executor.pool_counts() == Executor(cfg, model=tiny_model).pool_counts()
        executor.close()
        return outputs, proposals

    later, eager = run(False), run(True)
    assert later[0] == eager[0] == plain[0].output_ids[: params.max_new_tokens]
    assert len(later[1]) >= 3 and later[1] == eager[1]


def test_rows_left_for_later_stay_within_the_limit(tiny_model):
    """Past ``MtpLedger.pending_limit`` positions held as hidden states, a leaving request's MTP layer
    catches up as it leaves, so what the cache holds stays bounded."""
    from pipeline.messages import Release

    cfg = attrs.evolve(
        config(True, 3), speculative=SpeculativeConfig(num_steps=3, max_batch_size=1), prefix_cache=True
    )
    executor = Executor(cfg, model=tiny_model)
    prompts = make_prompts(8, seed=29)[3:6]  # 37, 145 and 7 tokens
    executor.mtp.pending_limit = (len(prompts[0]) + 6) // PAGE * PAGE  # room for the first only
    ids = ["x", "y", "z"]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    with quiet_logs():
        _decode_plainly(executor, ids, prompts, params, 6)
        executor.run(Release(tuple(ids)))
    cache = executor.memory.cache
    assert cache.pending_positions == executor.mtp.pending_limit
    full = sum((len(p) + 6) // PAGE for p in prompts)
    assert cache.held_pages() == full  # the others' rows were written as they left: cached too
    executor.check_integrity()
    executor.close()


@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "resident"])
def test_rounds_stop_at_the_context_limit_with_plain_decodings_tokens(tiny_model, monkeypatch, hisparse):
    """``max_context``: a request speculates while it holds at most that many tokens and decodes
    plainly past it (its verify and drafts would scan the whole context); a second, shorter request
    keeps speculating alone after the first has passed the limit. Every token is plain decoding's,
    and no verify ever ran for a batch holding more than the limit."""
    prompts = make_prompts(8, seed=21)[5:7]  # 7 and 50 tokens
    limit = 60  # the long request passes it after 10 tokens, the short one never does
    lengths = (MAX_NEW, 40)
    plain, truth = plain_with_lengths(tiny_model, hisparse, prompts, lengths)
    spec = SpeculativeConfig(num_steps=3, max_batch_size=None, max_context=limit, timed=False,
                             plain_tail=False, plain_while_prefilling=False)
    executor = Executor(attrs.evolve(config(hisparse, None), speculative=spec), model=tiny_model)
    oracle_drafter(monkeypatch, executor, truth)
    held_at_rounds: list[int] = []
    real_verify = executor.verify

    def verify(request_ids):
        seqs = [executor.seqs[rid] for rid in request_ids]  # prompt and tokens produced so far
        held_at_rounds.append(max(len(seq.token_ids) + len(seq.produced) for seq in seqs))
        return real_verify(request_ids)

    executor.verify = verify
    driver = SyncDriver(executor, check=True)
    with quiet_logs():
        reqs = [
            driver.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, lengths)
        ]
        driver.run()
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    assert held_at_rounds and max(held_at_rounds) <= limit
    assert len(held_at_rounds) > 2  # rounds before the limit, and the short request's alone after it
    assert executor.spec_counters.accepted_drafts > 0
    assert executor.pool_counts() == Executor(config(hisparse, None), model=tiny_model).pool_counts()
    executor.close()


@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "resident"])
def test_no_mtp_row_at_or_past_the_context_limit_is_ever_computed(tiny_model, monkeypatch, hisparse):
    """No round runs for a request holding more than ``max_context`` tokens, so no draft reads an MTP
    row at or past it: the executor never computes one, not for the plain steps past it, nor for the
    pages a request leaves to the prefix cache. A prompt that reaches the limit never runs a round at
    all: the rows of its positions below the limit are left to the cache as hidden states, and the
    later request that shares its first pages (and stays under the limit) writes them at admission
    and drafts what it drafts without the cache. Every token is plain decoding's; a draft asked for a
    request past the limit fails that request with a clear error; the pools come back."""
    import pipeline.executor as executor_module

    limit = 40
    gen = torch.Generator().manual_seed(31)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (50, 7)]  # past it, and under it
    lengths = (12, 40)  # the short one passes the limit after 33 tokens
    plain, _ = plain_with_lengths(tiny_model, hisparse, prompts, lengths)
    spec = SpeculativeConfig(num_steps=3, max_batch_size=None, max_context=limit, timed=False,
                             plain_tail=False, plain_while_prefilling=False)
    cfg = attrs.evolve(config(hisparse, None), speculative=spec, prefix_cache=True, chunked_prefill_tokens=16)
    extends: list = []
    real = executor_module.draft_extend
    monkeypatch.setattr(
        executor_module, "draft_extend", lambda m, mem, inputs: extends.extend(inputs) or real(m, mem, inputs)
    )
    seen = _record_proposals(monkeypatch)
    executor = Executor(cfg, model=tiny_model)
    assert executor.mtp.limit == limit
    driver = SyncDriver(executor, check=True)
    with quiet_logs():
        reqs = [
            driver.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, lengths)
        ]
        driver.run()
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    assert extends and max(x.start + len(x.next_ids) for x in extends) <= limit
    assert len({x.row for x in extends}) == 1  # the short request's only: none over the long prompt
    assert executor.spec_counters.verify_rounds > 0  # the short request speculated under the limit
    cache = executor.memory.cache
    assert cache.pending_positions >= limit  # the long prompt's pages below the limit, as hidden states
    extends.clear()

    sharer = [*prompts[0][:33], *prompts[1][:5]]  # 4 pages of the long prompt (and the next token), 38 tokens
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)

    def proposals(ex) -> tuple[list[int], list[int], int]:
        seen.clear()
        drv = SyncDriver(ex, check=True)
        with quiet_logs():
            req = drv.submit(sharer, params)
            drv.run()
        return req.output_ids, list(seen), req.metrics.cached_tokens

    hit = proposals(executor)
    written = [(x.start, len(x.next_ids)) for x in extends if not x.propose]
    assert written[:4] == [(0, 8), (8, 8), (16, 8), (24, 8)]  # at its admission: the pages it shares
    fresh = Executor(attrs.evolve(cfg, prefix_cache=False), model=tiny_model)
    assert hit[2] == 32 and hit[:2] == proposals(fresh)[:2] and hit[1]
    fresh.close()

    from pipeline.executor import NewSequence

    with quiet_logs():  # a draft asked for past the limit (the scheduler never asks): that request fails
        # no cache hit: its rows held
        prefill_whole(executor, [NewSequence("past", tuple(reversed(prompts[0])), params)])
        executor.wait_staging()
        executor.collect_ready()
        executor.decode(["past"])
        result = executor.draft(["past"])
    assert "holds more than the speculative max_context (40) tokens" in result.failed["past"]
    executor.release("past")
    executor.flush_prefix_cache()
    executor.check_integrity()
    assert executor.pool_counts() == Executor(cfg, model=tiny_model).pool_counts()
    executor.close()
