"""Dynamic residency is invisible to the math (docs/residency.md).

A request of a dynamic engine decodes with its whole context on the device (``Layout.FULL``) or
through its hot buffer over the host copy (``Layout.HOT``), and moves between the two at step
boundaries. Whatever it went through, its greedy tokens equal all-resident decoding's (float64, the
tiny random model, the synchronous driver, which forms the same batches in every mode):

* demotions and promotions forced between the driver's steps, every decoding request at once, with
  speculation on and off (the oracle drafter: every accept length), with prompts prefilled in
  chunks beside the running batch, and with the prefix cache (requests that share cached pages);
* demotions and promotions made by memory pressure, in device tensors no larger (in bytes) than
  those of an all-resident engine that cannot seat the requests at once: the dynamic engine seats
  them together by demoting, and promotes again once requests have finished.

After every run (and, for requests served one after another, after every request) each pool is back
at its initial free count.
"""

from __future__ import annotations

import itertools

import anyio
import attrs
import pytest
import structlog
import torch
from speculative._spec_util import oracle_drafter, quiet_logs

from pipeline import Engine
from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.memory.interface import Layout, Residency
from pipeline.sampling import SamplingParams

HOT = 16
PAGE = 4  # a draft zone of 3 columns: num_steps up to 2
MAX_NEW = 24
# below HOT, exactly HOT, between, and more than 8x HOT
PROMPT_LENS = (5, HOT, 40, 3 * HOT + 1, 8 * HOT + 9)


def config(
    residency: str | None,
    *,
    pool: int = 1024,
    num_steps: int | None = None,
    chunk: int | None = None,
    cache: bool = False,
    rows: int = 6,
    max_len: int = 320,
    ratio: int = 4,
) -> EngineConfig:
    """float64, pages of PAGE; ``residency`` None: all-resident (``hisparse=None``)."""
    return EngineConfig(
        dtype="float64",
        page_size=PAGE,
        max_context_len=max_len,
        max_running_requests=rows,
        device_pool_tokens=pool,
        hisparse=None
        if residency is None
        else HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=ratio, residency=residency),
        # every turn a round (no adaptive rule), so both runs take the same forwards
        speculative=SpeculativeConfig(
            num_steps=num_steps, max_batch_size=None, timed=False, min_accept_length=None,
            plain_tail=False, plain_while_prefilling=False,
        )
        if num_steps
        else None,
        chunked_prefill_tokens=chunk,
        prefix_cache=cache,
    )


def prompts(seed: int, lens=PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def decoding_rows(executor: Executor, layout: Layout) -> list[int]:
    """Rows of the live requests in their decode layout that have ``layout``."""
    memory = executor.memory
    rows = [seq.row for seq in executor.seqs.values()]
    return [r for r in rows if memory.residency(r) is Residency.RESIDENT and memory.layout(r) is layout]


def decoding_layouts(executor: Executor) -> dict[str, tuple[Layout, int]]:
    """Each decoding request's layout and context length (none without HiSparse)."""
    memory = executor.memory
    if memory.residency_stats() is None:
        return {}
    return {
        rid: (memory.layout(seq.row), memory.length(seq.row))
        for rid, seq in executor.seqs.items()
        if memory.residency(seq.row) is Residency.RESIDENT
    }


def first_demotion(layouts: list[dict[str, tuple[Layout, int]]]) -> tuple[str, dict[str, int]]:
    """The request first found demoted, and the FULL requests' lengths the step before."""
    for before, after in itertools.pairwise(layouts):
        for rid, (layout, _) in after.items():
            if layout is Layout.HOT and before.get(rid, (None, 0))[0] is Layout.FULL:
                return rid, {r: n for r, (lay, n) in before.items() if lay is Layout.FULL}
    raise AssertionError("no request was demoted")


def demote_all(executor: Executor, *, every: int = 1) -> int:
    """Demote every FULL request (``every``: every other one, ...) at a step boundary: between two
    of the driver's steps."""
    rows = decoding_rows(executor, Layout.FULL)[::every]
    for row in rows:
        freed = executor.memory.demote(row)
        assert freed >= 0 and executor.memory.layout(row) is Layout.HOT
    return len(rows)


def promote_all(executor: Executor) -> int:
    """Promote every HOT request the device pool has room for."""
    promoted = 0
    for row in decoding_rows(executor, Layout.HOT):
        try:
            executor.memory.promote(row)
        except Exception as exc:  # no room (OutOfMemory): the rest stay HOT
            assert type(exc).__name__ == "OutOfMemory", exc
            continue
        assert executor.memory.layout(row) is Layout.FULL
        promoted += 1
    return promoted


@attrs.define
class Run:
    outputs: list[list[int]]
    residency: dict[str, int] | None  # the executor's ``stats()["residency"]`` at the end
    prefix_cache: dict[str, float] | None  # and its ``stats()["prefix_cache"]``
    most_live: int  # the most requests live (admitted, not ended) at once, after any step
    # after each step, every decoding request's layout and length (none for resident memory)
    layouts: list[dict[str, tuple[Layout, int]]]
    forced: int  # demotions and promotions the test forced


def run(
    model,
    cfg: EngineConfig,
    prompt_list: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    *,
    demote_at: tuple[int, ...] = (),
    promote_at: tuple[int, ...] = (),
    split_at: tuple[int, ...] = (),
    arrive_at: dict[int, list[int]] | None = None,
    monkeypatch=None,
    truth: dict[str, list[int]] | None = None,
) -> Run:
    """Drive ``prompt_list`` to the end on the synchronous driver (every invariant checked each
    step); after the driver's step ``n`` demote every FULL request when ``n`` is in ``demote_at``
    (every other one when in ``split_at``: mixed batches), promote every HOT one when in
    ``promote_at``; ``arrive_at[n]``: the prompts (indices) submitted
    after step ``n`` (the others before the first). Pools are checked back at their initial counts."""
    executor = Executor(cfg, model=model)
    if truth is not None:
        oracle_drafter(monkeypatch, executor, truth)
    initial = executor.pool_counts()
    driver = SyncDriver(executor, check=True)
    plist = params if isinstance(params, list) else [params] * len(prompt_list)
    later = {i for ids in (arrive_at or {}).values() for i in ids}
    reqs = {i: driver.submit(p, plist[i], f"req-{i}") for i, p in enumerate(prompt_list) if i not in later}
    step = most_live = forced = 0
    layouts: list[dict[str, tuple[Layout, int]]] = []
    last_arrival = max(arrive_at or {0: []})
    with quiet_logs():
        while True:
            going = driver.step()
            step += 1
            most_live = max(most_live, len(executor.seqs))
            layouts.append(decoding_layouts(executor))
            for i in (arrive_at or {}).get(step, []):
                reqs[i] = driver.submit(prompt_list[i], plist[i], f"req-{i}")
                going = True
            if not going and step >= last_arrival:
                break
            if step in demote_at:
                forced += demote_all(executor)
            if step in split_at:
                forced += demote_all(executor, every=2)
            if step in promote_at:
                forced += promote_all(executor)
    assert executor.pool_counts() == initial, "a pool is not back at its initial free count"
    stats = executor.stats()
    executor.close()
    outputs = [reqs[i].output_ids for i in range(len(prompt_list))]
    return Run(outputs, stats.get("residency"), stats["prefix_cache"], most_live, layouts, forced)


def reference(model, prompt_list, params, **kw) -> list[list[int]]:
    """All-resident greedy tokens (``hisparse=None``)."""
    return run(model, config(None, **kw), prompt_list, params).outputs


# --- forced moves between steps ------------------------------------------------------------------


def test_dynamic_without_pressure_is_all_full_and_equals_resident(tiny_model):
    """A pool that holds everything: every request stays FULL, nothing moves, same tokens."""
    plist = prompts(0)
    got = run(tiny_model, config("dynamic"), plist, greedy())
    assert got.outputs == reference(tiny_model, plist, greedy())
    figures = got.residency
    assert figures is not None and figures["mode"] == "dynamic"
    assert figures["demotions"] == figures["promotions"] == 0
    assert figures["resident"] == figures["demoted"] == 0  # nothing live at the end


def recording_logits(model, monkeypatch) -> list[torch.Tensor]:
    """Every forward's logits from now on, in call order."""
    calls: list[torch.Tensor] = []
    original = model.logits
    monkeypatch.setattr(model, "logits", lambda hidden: calls.append(original(hidden)) or calls[-1])
    return calls


@pytest.mark.parametrize("seed", [0, 1])
def test_demoted_and_promoted_mid_decode_equals_resident(tiny_model, monkeypatch, seed):
    """Every decoding request demoted after steps 3 and 12, promoted after step 7 (and by the
    rebalance whenever it decides to): the tokens of all-resident decoding, and in float64 the
    logits of every forward bit for bit."""
    plist = prompts(seed)
    calls = recording_logits(tiny_model, monkeypatch)
    got = run(tiny_model, config("dynamic"), plist, greedy(), demote_at=(3, 12), promote_at=(7,))
    dynamic_logits = list(calls)
    calls.clear()
    assert got.outputs == reference(tiny_model, plist, greedy())
    assert len(dynamic_logits) == len(calls)
    for a, b in zip(dynamic_logits, calls):
        assert torch.equal(a, b)
    figures = got.residency
    assert figures is not None
    assert figures["demotions"] >= len(plist) and figures["promotions"] >= 1
    assert figures["demoted_bytes"] > 0 and figures["promoted_bytes"] > 0


def test_every_step_demoted_is_hisparse_and_equals_resident(tiny_model):
    """Demoted after every step (a promotion in between is undone at once): HiSparse decoding."""
    plist = prompts(2)
    got = run(tiny_model, config("dynamic"), plist, greedy(), demote_at=tuple(range(1, 200)))
    assert got.outputs == reference(tiny_model, plist, greedy())


def test_always_residency_never_moves_a_request(tiny_model):
    """``residency="always"``: every decoding row is HOT; the figures say so, nothing moves."""
    plist = prompts(3, lens=(9, 40))
    executor = Executor(config("always"), model=tiny_model)
    driver = SyncDriver(executor, check=True)
    reqs = [driver.submit(p, greedy(), f"req-{i}") for i, p in enumerate(plist)]
    seen = set()
    while driver.step():
        seen.update(executor.memory.layout(seq.row) for seq in executor.seqs.values()
                    if executor.memory.residency(seq.row) is Residency.RESIDENT)
    assert seen == {Layout.HOT}
    figures = executor.stats()["residency"]
    assert figures["mode"] == "always" and figures["demotions"] == figures["promotions"] == 0
    assert [r.output_ids for r in reqs] == reference(tiny_model, plist, greedy())
    executor.close()


def test_resident_memory_has_no_residency_figures(tiny_model):
    executor = Executor(config(None), model=tiny_model)
    assert "residency" not in executor.stats()
    executor.close()


@pytest.mark.parametrize("num_steps", [1, 2])
def test_speculative_rounds_across_demotion_and_promotion_equal_plain_resident(
    tiny_model, monkeypatch, num_steps
):
    """Speculative rounds (oracle drafts, every accept length) on requests demoted and promoted
    between rounds, all of them or every other one (rounds over FULL and HOT requests together):
    plain all-resident greedy tokens."""
    plist = prompts(10 + num_steps)
    plain = reference(tiny_model, plist, greedy())
    truth = {f"req-{i}": [*p, *out] for i, (p, out) in enumerate(zip(plist, plain))}
    got = run(
        tiny_model, config("dynamic", num_steps=num_steps), plist, greedy(),
        demote_at=(2,), promote_at=(4, 7), split_at=(5, 8), monkeypatch=monkeypatch, truth=truth,
    )
    assert got.outputs == plain
    assert got.residency["demotions"] >= len(plist) and got.residency["promotions"] >= 1


def test_chunked_prefill_beside_demoted_requests_equals_resident(tiny_model):
    """Prompts prefilled 24 tokens per forward, two of them arriving while the others decode (their
    chunks ride in the decode steps' forwards), with the decoding requests demoted and promoted
    around them: all-resident's tokens, prefilled in the same chunks."""
    plist = prompts(5, lens=(9, 40, 8 * HOT + 9, 3 * HOT + 1))
    arrive = {3: [2], 6: [3]}
    got = run(tiny_model, config("dynamic", chunk=24), plist, greedy(), demote_at=(2, 5, 9),
              promote_at=(4, 8), arrive_at=arrive)
    want = run(tiny_model, config(None, chunk=24), plist, greedy(), arrive_at=arrive)
    assert got.outputs == want.outputs
    assert got.residency["demotions"] >= 2 and got.residency["promotions"] >= 1


def family(seed: int) -> list[list[int]]:
    """Prompts sharing a 70-token base: unaligned, page-aligned, the whole base, and longer."""
    (base,) = prompts(seed, lens=(70,))
    (tail,) = prompts(seed + 100, lens=(30,))
    return [base, base[:45] + tail[:7], base[: 8 * PAGE] + tail[:5], list(base), base + tail]


def test_prefix_cache_with_demotion_equals_resident(tiny_model):
    """Requests sharing cached pages, together and one after another, demoted and promoted mid-decode
    (FULL requests whose first pages are shared with the cache and with each other): the
    all-resident engine's tokens with the same cache. Served one after another, every pool is back
    at its initial count after each request."""
    plist = family(0)
    params = [greedy(4)] + [greedy()] * (len(plist) - 1)  # the first fills the cache, then the rest
    arrive = {8: list(range(1, len(plist)))}
    together = run(tiny_model, config("dynamic", cache=True), plist, params, demote_at=(10, 14),
                   promote_at=(12,), arrive_at=arrive)
    want = run(tiny_model, config(None, cache=True), plist, params, arrive_at=arrive)
    assert together.outputs == want.outputs
    assert together.prefix_cache["hit_tokens"] > 0
    assert together.residency["demotions"] >= 2 and together.residency["promotions"] >= 1

    executor = Executor(config("dynamic", cache=True), model=tiny_model)
    initial = executor.pool_counts()
    driver = SyncDriver(executor, check=True)
    one_by_one = []
    with quiet_logs():
        for i, p in enumerate(plist):
            req = driver.submit(p, params[i], f"one-{i}")
            step = 0
            while driver.step():
                step += 1
                if step % 3 == 1:
                    demote_all(executor)
                elif step % 3 == 2:
                    promote_all(executor)
            one_by_one.append(req.output_ids)
            assert executor.pool_counts() == initial, f"request {i}: a pool is not back at its initial count"
    assert executor.memory.cache_stats()["hit_tokens"] > 0
    executor.close()
    assert one_by_one == want.outputs


def test_a_full_request_leaves_its_decoded_pages_to_the_cache_with_their_host_copies(tiny_model):
    """A FULL request backs up its filled pages a few at a time (``BACKUP_PAGES``), so it may end
    with filled pages that have no host copy yet; the cache keeps host copies, so its release copies
    them first. A follow-up whose prompt is the first request's prompt and output reads those pages
    from the cache: all-resident's tokens, and the hit covers decoded positions."""
    (first,) = prompts(3, lens=(5,))
    outputs: dict[str, list[list[int]]] = {}
    logprobs: dict[str, list[float]] = {}  # (a wrong row moves them where it may not move a token)
    hits: dict[str, int] = {}
    for name, residency in (("dynamic", "dynamic"), ("resident", None)):
        executor = Executor(config(residency, cache=True), model=tiny_model)
        initial = executor.pool_counts()
        driver = SyncDriver(executor, check=True)
        with quiet_logs():
            one = driver.submit(first, greedy(), f"{name}-one")
            driver.run()
            follow = first + one.output_ids + [7, 11]
            scored = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=0)
            two = driver.submit(follow, scored, f"{name}-two")
            driver.run()
        outputs[name] = [one.output_ids, two.output_ids]
        logprobs[name] = [entry.logprob for entry in two.output_logprobs or []]
        hits[name] = int(executor.memory.cache_stats()["hit_tokens"])
        assert executor.pool_counts() == initial
        executor.close()
    assert outputs["dynamic"] == outputs["resident"]
    assert len(logprobs["dynamic"]) == 4
    assert logprobs["dynamic"] == pytest.approx(logprobs["resident"], rel=0, abs=1e-9)
    # the first request committed 5 + 23 positions: 7 filled pages, the last ones past its last
    # backup (at 24 positions), all of them taken by the follow-up
    assert hits["dynamic"] >= 7 * PAGE


# --- moves made by memory pressure ---------------------------------------------------------------

POOL = 128  # device slots: 32 pages of PAGE
PRESSURE_CHUNK = 16  # prompts in chunks: the headroom a promotion leaves is one chunk's admission
PRESSURE_LENS = (56, 52, 40)  # the first two fill an all-resident pool of POOL as they decode
# A dynamic engine's device arena holds the KV rows and the indexer keys of every logical location
# (pipeline/memory/arena.py): a device pool of POOL slots and ratio 4 would be an arena twice the
# bytes of all-resident's rows and keys. These sizes keep every device tensor of the dynamic engine
# within all-resident's bytes (asserted):
SEAT_POOL, SEAT_RATIO = 40, 6
# and an arena that seats the four growth requests FULL but cannot hold them all as they grow
GROWTH_POOL = 68


def device_bytes(model, cfg: EngineConfig) -> int:
    """Bytes of every device tensor of the memory layer of an engine of ``cfg``."""
    executor = Executor(cfg, model=model)
    try:
        return sum(t.numel() * t.element_size() for t in executor.memory.device_tensors().values())
    finally:
        executor.close()


def test_pressure_demotes_to_seat_what_all_resident_cannot(tiny_model):
    """All-resident with a device pool of POOL slots seats the first two requests and the third
    waits for one of them to finish. A dynamic engine whose device tensors, all of them, take no
    more bytes than all-resident's (its arena of KV rows and indexer keys included) seats all three
    at once by demoting (largest context first), promotes once requests have finished, and decodes
    the tokens all-resident decodes."""
    plist = prompts(20, lens=PRESSURE_LENS)
    params = [greedy(8), greedy(8), greedy(40)]  # the third outlives the others: room returns
    sizes = dict(max_len=POOL, rows=4, chunk=PRESSURE_CHUNK)
    resident = config(None, pool=POOL, **sizes)
    dynamic = config("dynamic", pool=SEAT_POOL, ratio=SEAT_RATIO, **sizes)
    assert device_bytes(tiny_model, dynamic) <= device_bytes(tiny_model, resident)
    want = run(tiny_model, resident, plist, params)
    assert want.most_live == 2, "all-resident must not seat the three at once"
    got = run(tiny_model, dynamic, plist, params)
    assert got.outputs == want.outputs
    assert got.most_live == 3
    demoted, lengths = first_demotion(got.layouts)
    assert lengths[demoted] == max(lengths.values()), f"{demoted} demoted first, lengths {lengths}"
    figures = got.residency
    assert figures["demotions"] >= 1 and figures["demoted_bytes"] > 0
    assert figures["promotions"] >= 1 and figures["promoted_bytes"] > 0


def test_pressure_from_growth_demotes_and_promotes_after_finishes(tiny_model):
    """Four requests admitted FULL grow until the pool is short: the largest is demoted so that the
    others can grow, and once they have finished it is promoted back (after the hysteresis); the
    tokens are all-resident's (its pool large enough for all of them). Each move is its request's
    lifecycle event (``Demoted`` / ``Promoted``, the state unchanged), logged once."""
    plist = prompts(21, lens=(30, 26, 22, 18))
    params = [greedy(40), greedy(12), greedy(12), greedy(12)]
    want = run(tiny_model, config(None, pool=512, rows=4, chunk=PRESSURE_CHUNK), plist, params)
    cfg = config("dynamic", pool=GROWTH_POOL, max_len=POOL, rows=4, chunk=PRESSURE_CHUNK)
    executor = Executor(cfg, model=tiny_model)
    initial = executor.pool_counts()
    driver = SyncDriver(executor, check=True)
    reqs = [driver.submit(p, sp, f"req-{i}") for i, (p, sp) in enumerate(zip(plist, params))]
    promoted_after_a_finish = all_full = False
    promotions = finished = 0
    with structlog.testing.capture_logs() as logs:
        while driver.step():
            layouts = [layout for layout, _ in decoding_layouts(executor).values()]
            all_full |= layouts == [Layout.FULL] * len(reqs)
            now = executor.stats()["residency"]["promotions"]
            promoted_after_a_finish |= bool(finished) and now > promotions
            promotions, finished = now, sum(r.is_finished for r in reqs)
    assert [r.output_ids for r in reqs] == want.outputs
    figures = executor.stats()["residency"]
    assert all_full, "the four requests never decoded FULL together"
    assert figures["demotions"] >= 1
    assert promoted_after_a_finish, "no promotion once requests had finished"
    moves = [e for e in logs if e["event"] in ("Demoted", "Promoted")]
    assert [e["event"] for e in moves].count("Demoted") == figures["demotions"]
    assert [e["event"] for e in moves].count("Promoted") == figures["promotions"]
    ids = {r.request_id for r in reqs}
    assert all(e["from_state"] == e["state"] and e["request_id"] in ids for e in moves)
    assert moves[0]["event"] == "Demoted" and moves[0]["request_id"] == "req-0"  # the largest context
    assert executor.pool_counts() == initial
    executor.close()


@pytest.mark.asyncio
async def test_the_engine_under_pressure_equals_resident(tiny_model):
    """The same requests through the asynchronous engine (its own batches, its own rebalance after
    each command): all-resident's tokens, demotions and promotions counted, every pool back."""
    plist = prompts(21, lens=(30, 26, 22, 18))
    params = [greedy(40), greedy(12), greedy(12), greedy(12)]
    sizes = dict(max_len=POOL, rows=4, chunk=PRESSURE_CHUNK)
    want = run(tiny_model, config(None, pool=POOL, **sizes), plist, params).outputs
    out: dict[int, list[int]] = {}

    async def consume(i: int) -> None:
        tokens: list[int] = []
        async for delta in engine.generate(plist[i], params[i], request_id=f"req-{i}"):
            tokens += delta.token_ids
        out[i] = tokens

    with quiet_logs():
        async with Engine(config("dynamic", pool=GROWTH_POOL, **sizes), model=tiny_model) as engine:
            async with anyio.create_task_group() as tg:
                for i in range(len(plist)):
                    tg.start_soon(consume, i)
            figures = engine.stats()["residency"]
    assert [out[i] for i in range(len(plist))] == want
    assert figures["demotions"] >= 1 and figures["promotions"] >= 1
    assert engine.final_pool_counts == engine.initial_pool_counts


# --- faults -------------------------------------------------------------------------------------


def test_a_promotion_whose_copy_fails_fails_that_request_only(tiny_model, monkeypatch):
    """The host -> device copy of a promotion raises (a device out of memory): that request fails
    at its next step and is released; every other request gets its all-resident tokens; the pools
    come back."""
    import pipeline.hisparse.residency as residency

    plist = prompts(0)
    want = reference(tiny_model, plist, greedy())
    executor = Executor(config("dynamic"), model=tiny_model)
    initial = executor.pool_counts()
    driver = SyncDriver(executor, check=True)
    reqs = [driver.submit(p, greedy(), f"req-{i}") for i, p in enumerate(plist)]
    with quiet_logs():
        for _ in range(4):
            driver.step()
        demote_all(executor)
        row = decoding_rows(executor, Layout.HOT)[0]
        victim = executor._by_row[row]

        def failing_copy(*args, **kwargs):
            raise RuntimeError("device out of memory")

        monkeypatch.setattr(residency, "copy_rows", failing_copy)
        assert executor.memory.promote(row) == 0
        monkeypatch.undo()
        executor.memory.check_integrity()
        while driver.step():
            pass
    for i, req in enumerate(reqs):
        if req.request_id == victim:
            assert req.finish_reason == "error" and "promotion copy failed" in (req.error or "")
        else:
            assert req.output_ids == want[i], req.request_id
    assert executor.pool_counts() == initial
    executor.close()


def test_a_failing_rebalance_fails_no_request(tiny_model, monkeypatch):
    """A fault in the step boundary's rebalance is logged; the command it followed stands and its
    requests go on with their all-resident tokens."""
    from pipeline.hisparse.coordinator import HiSparseCoordinator

    calls = {"n": 0}
    original = HiSparseCoordinator.rebalance

    def rebalance(self):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("rebalance fault")
        return original(self)

    monkeypatch.setattr(HiSparseCoordinator, "rebalance", rebalance)
    plist = prompts(0)
    got = run(tiny_model, config("dynamic"), plist, greedy(), demote_at=(3,))
    assert calls["n"] >= 3
    assert got.outputs == reference(tiny_model, plist, greedy())
