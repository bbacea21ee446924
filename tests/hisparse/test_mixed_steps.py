"""Mixed steps: the running requests' decode step and a prefill chunk in one forward.

While requests decode, the synchronous driver sends the decode part's ``Decode`` and the prefill
part's ``Prefill`` as one ``Mixed`` command (``scheduler.together``), which ``Executor.run`` runs as
one model forward (linear and MoE layers over every token, attention per segment). In float64 the
tokens are those of unchunked prefill and of the all-resident reference, HiSparse on and off,
speculation on and off; a request that makes the mixed forward fail fails alone; an abort asked for
while a mixed forward runs leaves every pool at its initial count.
"""

from __future__ import annotations

import attrs
import pytest
from test_chunked_prefill import PAGE, SPEC, config, prompts

from pipeline.config import EngineConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.memory.resident import ResidentMemory
from pipeline.sampling import SamplingParams
from statemachines.request import State

RUNNING = (5, 16, 9)  # prompt lengths of the requests decoding when the long ones arrive
LONG = (40, 3 * 16 + 9)  # the longer one past three HOT regions: its later chunks swap in
POISON = 251  # a token id whose presence in a forward's input makes the injected forward raise
PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True)
PROMPTS = [[t if t != POISON else POISON - 1 for t in p] for p in prompts(0, lens=RUNNING + LONG)]


def serve(model, cfg: EngineConfig, *, hook=None, params=PARAMS, plist=PROMPTS):
    """Requests of ``RUNNING`` decode, then those of ``LONG`` arrive and are prefilled in chunks
    while the first decode (invariants checked after every step). ``hook(driver)``, if given, runs
    inside every mixed forward. Returns (requests, stats, initial pool counts, final pool counts)."""
    executor = Executor(cfg, model=model)
    initial = executor.pool_counts()
    driver = SyncDriver(executor, check=True)
    if hook is not None:
        real = executor._mixed_step

        def hooked(*args):
            hook(driver)
            return real(*args)

        executor._mixed_step = hooked
    reqs = [driver.submit(p, params, request_id=f"run-{i}") for i, p in enumerate(plist[: len(RUNNING)])]
    while not all(r.state is State.DECODE or r.is_finished for r in reqs):
        driver.step()
    reqs += [driver.submit(p, params, request_id=f"long-{i}") for i, p in enumerate(plist[len(RUNNING) :])]
    driver.run()
    final = executor.pool_counts()
    stats = executor.stats()
    executor.close()
    return reqs, stats, initial, final


@pytest.fixture(scope="module")
def reference(tiny_model):
    """The tokens of each prompt prefilled whole, all resident."""
    reqs, *_ = serve(tiny_model, config(hisparse=False, chunk=None, mixed_steps=False))
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize(("hisparse", "chunk"), [(True, PAGE), (True, 7), (False, 7)], ids=str)
def test_mixed_steps_give_the_tokens_of_unchunked_prefill(tiny_model, reference, hisparse, chunk):
    reqs, stats, initial, final = serve(tiny_model, config(hisparse=hisparse, chunk=chunk))
    assert [r.output_ids for r in reqs] == reference
    assert final == initial
    prefill = stats["prefill"]
    assert prefill["mixed_forwards"] >= 10, "the chunks shared the decode steps' forwards"
    if hisparse:
        assert prefill["misses"] > 0, "a mixed step's chunk reads the earlier chunks through swap-in"


def test_without_mixed_steps_no_forward_is_mixed(tiny_model, reference):
    reqs, stats, *_ = serve(tiny_model, config(hisparse=True, chunk=7, mixed_steps=False))
    assert [r.output_ids for r in reqs] == reference
    assert stats["prefill"]["mixed_forwards"] == 0


@pytest.mark.parametrize("max_batch_size", [None, 1], ids=["rounds", "plain-steps"])
def test_speculation_and_mixed_steps_give_the_plain_tokens(tiny_model, reference, max_batch_size):
    """Greedy speculation: a round (Reserve, Draft, Verify) is never mixed, and the chunk waiting
    beside it still runs; plain steps of the speculative batch (more requests than
    ``max_batch_size``) are mixed, and the MTP layer catches up over them before the next round."""
    spec = attrs.evolve(SPEC, max_batch_size=max_batch_size)
    reqs, stats, initial, final = serve(
        tiny_model, config(hisparse=True, chunk=7, spec=True, speculative=spec)
    )
    assert [r.output_ids for r in reqs] == reference
    assert final == initial
    mixed = stats["prefill"]["mixed_forwards"]
    assert (mixed == 0) if max_batch_size is None else (mixed > 0)


@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "resident"])
def test_an_abort_asked_for_during_a_mixed_step_releases_everything(tiny_model, reference, hisparse):
    """During the first mixed forward past the long prompt's second chunk, aborts are asked for (as
    the engine does: a wish applied at the parts' next safe point) for that prompt and for one
    decoding request: both end ABORTED, every pool returns, the others' tokens are unchanged."""
    asked = []

    def abort_once(driver):
        progress = driver.core.prefill.progress.get("long-1", 0)
        if not asked and progress >= 2 * 7:
            asked.extend(["long-1", "run-1"])
            for rid in asked:
                driver.core.aborts.add(rid)

    reqs, _, initial, final = serve(tiny_model, config(hisparse=hisparse, chunk=7), hook=abort_once)
    assert asked, "no mixed step ran past the second chunk"
    by_id = {r.request_id: r for r in reqs}
    assert {rid: by_id[rid].finish_reason for rid in asked} == {"long-1": "abort", "run-1": "abort"}
    for req, want in zip(reqs, reference):
        if req.request_id not in asked:
            assert req.output_ids == want
    assert final == initial


def test_a_prompt_that_makes_the_mixed_forward_fail_fails_alone(tiny_model, reference, monkeypatch):
    """The long prompt holds the poison token in a later chunk, so every forward carrying that chunk
    raises: the mixed forward is bisected over decode and prefill requests together, the prompt
    fails, the running requests and the other prompt get their tokens."""
    model_type = type(tiny_model)
    real = model_type.forward

    def forward(self, input_ids, positions, backend):
        if bool((input_ids == POISON).any()):
            raise RuntimeError("injected forward fault")
        return real(self, input_ids, positions, backend)

    monkeypatch.setattr(model_type, "forward", forward)
    plist = [list(p) for p in PROMPTS]
    plist[len(RUNNING) + 1][30] = POISON
    reqs, stats, initial, final = serve(tiny_model, config(hisparse=True, chunk=7), plist=plist)
    culprit = reqs[len(RUNNING) + 1]
    assert culprit.state is State.FAILED and "injected forward fault" in culprit.error
    for req, want in zip(reqs, reference):
        if req is not culprit:
            assert req.output_ids == want, req.request_id
    assert stats["prefill"]["mixed_forwards"] > 0 and final == initial


def test_a_decoding_request_that_makes_the_mixed_forward_fail_fails_alone(tiny_model, reference, monkeypatch):
    """One running request's decode rows cannot be prepared (injected): every mixed forward with it
    raises and is bisected; it fails alone, the chunks and the other running requests go on."""
    failing: dict[str, int] = {}
    real = ResidentMemory.prepare_decode

    def prepare_decode(self, rows):
        if failing.get("row") in rows:
            raise RuntimeError("injected decode fault")
        return real(self, rows)

    def arm(driver):  # from the first mixed forward with a long prompt's chunk on, run-1's decode fails
        if "long-0" in driver.requests and driver.requests["run-1"].state is State.DECODE:
            failing.setdefault("row", driver.executor.seqs["run-1"].row)

    monkeypatch.setattr(ResidentMemory, "prepare_decode", prepare_decode)
    reqs, _, initial, final = serve(tiny_model, config(hisparse=False, chunk=7), hook=arm)
    culprit = reqs[1]
    assert culprit.state is State.FAILED and "injected decode fault" in culprit.error
    for req, want in zip(reqs, reference):
        if req is not culprit:
            assert req.output_ids == want, req.request_id
    assert final == initial


def test_a_sampled_request_gives_the_same_tokens_mixed_and_not(tiny_model):
    """Seeded sampling: each request's random stream is its own, so sharing a forward changes
    nothing."""
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    runs = [
        serve(tiny_model, config(hisparse=True, chunk=6, mixed_steps=m), params=params) for m in (True, False)
    ]
    assert [r.output_ids for r in runs[0][0]] == [r.output_ids for r in runs[1][0]]
    assert runs[0][1]["prefill"]["mixed_forwards"] > 0


def test_chunks_failing_as_a_whole_after_a_mixed_forward_leave_the_decode_step(
    tiny_model, reference, monkeypatch
):
    """Finishing a mixed step's chunks fails outside any one request (injected in staging): their
    Prefill fails, as it would alone; the decode step's tokens stand and the running requests go on."""
    from pipeline.hisparse.coordinator import HiSparseCoordinator

    real = HiSparseCoordinator.start_staging
    hit = []

    def start_staging(self, row, length):
        if length == LONG[0] and not hit:
            hit.append(row)
            raise RuntimeError("injected staging fault")
        return real(self, row, length)

    monkeypatch.setattr(HiSparseCoordinator, "start_staging", start_staging)
    reqs, stats, initial, final = serve(tiny_model, config(hisparse=True, chunk=7))
    assert hit, "the fault was not reached"
    failed = [r for r in reqs if r.state is State.FAILED]
    assert failed and all(r.request_id.startswith("long-") for r in failed)
    assert all("injected staging fault" in r.error for r in failed)
    for req, want in zip(reqs, reference):
        if req.state is not State.FAILED:
            assert req.output_ids == want, req.request_id
    assert stats["prefill"]["mixed_forwards"] > 0 and final == initial
