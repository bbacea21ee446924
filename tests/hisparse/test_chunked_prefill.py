"""Chunked prefill never changes the answer, and bounds a prefilling request's device rows.

A prompt longer than ``chunked_prefill_tokens`` is computed over several forwards; with HiSparse each
finished chunk goes to host and the next chunk reads it through swap-in, as decode does. In float64
the tokens equal those of the unchunked all-resident reference for chunk sizes of one page, odd
sizes, and sizes larger than the prompt, with HiSparse on and off, speculation on and off.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.sampling import SamplingParams

HOT = 16
PAGE = 4
PROMPT_LENS = (5, 16, 40, 3 * HOT + 1, 8 * HOT + 9)
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)
SPEC = SpeculativeConfig(num_steps=2, max_batch_size=None, timed=False, min_accept_length=None,
                                   plain_tail=False, plain_while_prefilling=False)


def config(*, hisparse: bool | HiSparseConfig, chunk: int | None, spec: bool = False, **kw) -> EngineConfig:
    if isinstance(hisparse, HiSparseConfig):
        kw["hisparse"] = hisparse
    base = dict(
        dtype="float64",
        page_size=PAGE,
        max_context_len=512,
        max_running_requests=6,
        device_pool_tokens=1024,
        chunked_prefill_tokens=chunk,
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2) if hisparse else None,
        speculative=SPEC if spec else None,
    )
    return EngineConfig(**{**base, **kw})


def prompts(seed: int, lens=PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]


def generate(model, cfg: EngineConfig, prompt_list, *, check: bool = False, params=PARAMS):
    executor = Executor(cfg, model=model)
    try:
        initial = Executor(cfg, model=model).pool_counts()
        reqs = SyncDriver(executor, check=check).generate(prompt_list, params)
        assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
        assert executor.pool_counts() == initial, "a pool did not return to its initial count"
        return [r.output_ids for r in reqs], executor.stats()
    finally:
        executor.close()


@pytest.fixture(scope="module")
def reference(tiny_model):
    """The unchunked all-resident tokens of each seed's prompts."""
    cache: dict[int, list[list[int]]] = {}

    def tokens(seed: int) -> list[list[int]]:
        if seed not in cache:
            cache[seed] = generate(tiny_model, config(hisparse=False, chunk=None), prompts(seed))[0]
        return cache[seed]

    return tokens


@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "resident"])
@pytest.mark.parametrize("chunk", [PAGE, 7, 33, 1000], ids=lambda c: f"chunk{c}")
def test_chunked_prefill_gives_the_tokens_of_unchunked_prefill(tiny_model, reference, hisparse, chunk):
    tokens, stats = generate(tiny_model, config(hisparse=hisparse, chunk=chunk), prompts(0), check=chunk == 7)
    assert tokens == reference(0)
    longest = max(PROMPT_LENS)
    assert stats["prefill"]["continued_chunks"] >= (-(-longest // chunk) - 1 if chunk < longest else 0)
    if hisparse and chunk < 3 * HOT:
        assert stats["prefill"]["misses"] > 0, "later chunks must read earlier ones through swap-in"


@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "resident"])
@pytest.mark.parametrize("budget", [7, 20, 64, None], ids=lambda b: f"budget{b}")
def test_a_forwards_budget_above_the_chunk_shares_forwards_and_keeps_the_tokens(
    tiny_model, reference, hisparse, budget
):
    """Chunks of 7 within a forward budget of 7 (one chunk a forward), 20, 64 or none: the requests'
    chunks share forwards as the plan says, and the tokens are the unchunked reference's."""
    cfg = config(hisparse=hisparse, chunk=7, prefill_batch_tokens=budget)
    tokens, stats = generate(tiny_model, cfg, prompts(0), check=budget == 20)
    assert tokens == reference(0)
    chunks = sum(-(-n // 7) for n in PROMPT_LENS)  # a budget that ends inside a chunk cuts it in two
    forwards = stats["prefill"]["forwards"]
    if budget is None:  # every prompt's next chunk in each forward: as many as the longest has chunks
        assert stats["prefill"]["chunks"] == chunks and forwards == -(-max(PROMPT_LENS) // 7)
    elif budget == 7:  # one chunk's worth a forward, every forward full but the last
        assert forwards == -(-sum(PROMPT_LENS) // 7)
    else:
        assert -(-sum(PROMPT_LENS) // budget) <= forwards < chunks


@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "resident"])
@pytest.mark.parametrize("chunk", [PAGE, 13], ids=lambda c: f"chunk{c}")
def test_chunked_prefill_with_speculation_gives_the_plain_tokens(tiny_model, reference, hisparse, chunk):
    """The MTP layer's draft extend is chunked with the target's forward: greedy speculation gives
    the plain reference's tokens, and the drafts are those of an unchunked prefill (the same
    acceptance, draft position by draft position)."""
    tokens, stats = generate(tiny_model, config(hisparse=hisparse, chunk=chunk, spec=True), prompts(0))
    assert tokens == reference(0)
    _, whole = generate(tiny_model, config(hisparse=hisparse, chunk=None, spec=True), prompts(0))
    assert stats["speculative"]["verify_rounds"] > 0
    assert stats["speculative"] == whole["speculative"]


def test_sampled_requests_give_the_same_tokens_chunked_and_not(tiny_model):
    """A seeded sampled request's random stream is not touched by the chunks that do not end its
    prompt (nothing is sampled or proposed for them)."""
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    plist = prompts(3, lens=(70, 9))
    for spec in (False, True):
        whole, _ = generate(tiny_model, config(hisparse=True, chunk=None, spec=spec), plist, params=params)
        chunked, _ = generate(tiny_model, config(hisparse=True, chunk=6, spec=spec), plist, params=params)
        assert chunked == whole


def device_rows(executor: Executor) -> dict[str, int]:
    """Device rows (MLA KV slots) each live request holds."""
    memory = executor.memory
    return {rid: len(memory.alloc.physical.pages_of(seq.row)) * PAGE for rid, seq in executor.seqs.items()}


def test_a_prompt_four_times_the_device_pool_is_served_within_chunk_hot_and_a_page(tiny_model):
    """Device pool 64 rows, prompt 256: with chunks of 24 the request never holds more than
    chunk + HOT + page device rows (checked after every step), and its tokens are the reference's."""
    chunk, pool, prompt_len = 24, 64, 256
    cfg = config(
        chunk=chunk,
        device_pool_tokens=pool,
        max_context_len=300,
        max_running_requests=2,
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=8),
    )
    plist = prompts(11, lens=(prompt_len,))
    executor = Executor(cfg, model=tiny_model)
    initial = executor.pool_counts()
    driver = SyncDriver(executor, check=True)
    req = driver.submit(plist[0], PARAMS)
    peak = 0
    while driver.step():
        held = device_rows(executor).get(req.request_id, 0)
        assert held <= chunk + HOT + PAGE, f"{held} device rows while {req.state.name}"
        peak = max(peak, held)
    assert req.finish_reason == "length" and executor.pool_counts() == initial
    assert peak > HOT, "the chunk rows were really used"
    executor.close()
    want, _ = generate(tiny_model, config(hisparse=False, chunk=None), plist)
    assert req.output_ids == want[0]


def test_an_abort_between_chunks_gives_every_pool_back(tiny_model, reference):
    """A long prompt aborted halfway through its chunks, while short requests decode: it releases
    everything (pools at their initial counts once the rest finish), and the others' tokens are
    unaffected."""
    cfg = config(hisparse=True, chunk=8)
    executor = Executor(cfg, model=tiny_model)
    initial = executor.pool_counts()
    driver = SyncDriver(executor, check=True)
    plist = prompts(0)
    reqs = [driver.submit(p, PARAMS) for p in plist]
    longest = reqs[-1]
    progress = driver.core.prefill.progress
    while progress.get(longest.request_id, 0) < 3 * 8:  # the others decode meanwhile
        driver.step()
    assert any(r.state.name == "DECODE" for r in reqs)
    assert longest.state.name == "PREFILL" and 0 < driver.core.prefill.progress[longest.request_id] < len(
        plist[-1]
    )
    driver.abort(longest.request_id)
    driver.run()
    assert longest.finish_reason == "abort"
    assert [r.output_ids for r in reqs[:-1]] == reference(0)[:-1]
    assert executor.pool_counts() == initial
    executor.close()


def test_the_lifecycle_log_has_one_event_per_chunk(tiny_model):
    import structlog

    cfg = config(hisparse=True, chunk=10)
    executor = Executor(cfg, model=tiny_model)
    with structlog.testing.capture_logs() as logs:
        SyncDriver(executor).generate(prompts(0, lens=(35,)), PARAMS)
    chunks = [e for e in logs if e["event"] == "ChunkDone"]
    assert [(e["start"], e["end"]) for e in chunks] == [(0, 10), (10, 20), (20, 30)]
    assert all("step_misses" in e and "step_h2d_bytes" in e for e in chunks)
    assert executor.stats()["prefill"]["chunks"] == 4
    executor.close()
