"""The MTP ledger with a fake draft extend and a fake memory: no model.

Each test drives the ledger through its named points (a prefill, plain steps, a draft, a release)
and checks the extends it asks for (which positions, whether they propose) and what it leaves held,
deferred or pending in a real prefix cache (one without pools: only its entries are kept).
"""

from __future__ import annotations

import attrs
import pytest
import structlog
import structlog.testing
import torch

from pipeline.memory.interface import Residency
from pipeline.memory.prefix_cache import PrefixCache
from pipeline.sampling import SamplingParams
from pipeline.sequence import Sequence
from pipeline.speculative.draft_state import DraftState
from pipeline.speculative.drafting import ExtendInput
from pipeline.speculative.ledger import CATCH_UP_AFTER, MtpLedger

PAGE = 4
D = 2  # hidden size: the hidden state at position p is [p, p], so rows name their positions


def hidden(start: int, end: int) -> torch.Tensor:
    return torch.arange(start, end, dtype=torch.float64)[:, None].expand(-1, D).clone()


@attrs.define
class FakeExtend:
    """Records every extend's inputs; a proposing input gets a draft state whose bonus is its last
    next id. ``fail``: request rows whose extend raises."""

    calls: list[list[ExtendInput]] = attrs.Factory(list)
    fail: set[int] = attrs.Factory(set)

    def __call__(self, inputs: list[ExtendInput]) -> list[DraftState | None]:
        if any(x.row in self.fail for x in inputs):
            raise RuntimeError("injected extend fault")
        self.calls.append(list(inputs))
        return [DraftState(x.next_ids[-1], torch.zeros(D), (0,), None) if x.propose else None for x in inputs]

    def spans(self, call: int = -1) -> list[tuple[int, int, int, bool]]:
        """(row, first position, end, proposes) of each input of an extend."""
        return [(x.row, x.start, x.start + len(x.next_ids), x.propose) for x in self.calls[call]]


@attrs.define
class FakeMemory:
    """What the ledger reads of the memory: lengths, residency, the prefix cache."""

    cache: PrefixCache | None = attrs.Factory(lambda: PrefixCache(page_size=PAGE, pools=(), owner=99))
    lengths: dict[int, int] = attrs.Factory(dict)

    def length(self, row: int) -> int:
        return self.lengths[row]

    def residency(self, row: int) -> Residency:
        return Residency.RESIDENT

    def release(self, seq: Sequence, tokens: tuple[int, ...] | None) -> None:
        """The memory's release with ``tokens``: its full pages the cache does not hold yet go to it."""
        if tokens is None or self.cache is None:
            return
        chain = self.cache.match(tokens)
        full = self.cache.full_pages(self.lengths[seq.row], tokens)
        self.cache.insert(tokens, chain, [()] * (full - len(chain)), seq.row)


def ledger(*, limit: int | None = None, pending_limit: int = 0, catch_up_after: int = 16) -> MtpLedger:
    return MtpLedger(PAGE, limit, pending_limit, catch_up_after)


def request(rid: str, row: int, prompt_len: int, params: SamplingParams | None = None) -> Sequence:
    prompt = tuple(range(100 + 10 * row, 100 + 10 * row + prompt_len))
    gen = torch.Generator().manual_seed(row)
    return Sequence(rid, row, params or SamplingParams(), gen, prompt, prompt_len)


def prefill(mtp: MtpLedger, memory: FakeMemory, seq: Sequence, token: int = 7) -> ExtendInput | None:
    """A whole prompt in one chunk, its first token ``token``; what the ledger hands back."""
    n = len(seq.token_ids)
    memory.lengths[seq.row] = n
    seq.prefilled = n
    seq.produced.append(token)
    rows = mtp.after_prompt(seq, 0, hidden(0, n), token)
    if rows is None:
        seq.plain_next = token
    return rows


def steps(
    mtp: MtpLedger, extend: FakeExtend, memory: FakeMemory, seqs: list[Sequence], count: int
) -> dict[str, str]:
    """``count`` plain decode steps of ``seqs`` (each token is its position); the failures."""
    failed: dict[str, str] = {}
    for _ in range(count):
        stepped = []
        for seq in seqs:
            position = memory.lengths[seq.row]
            memory.lengths[seq.row] += 1
            seq.plain_next = position + 1
            seq.produced.append(seq.plain_next)
            stepped.append((seq, position, hidden(position, position + 1)[0]))
        failed |= mtp.after_step(stepped, extend)
    return failed


# --- the catch-up rule --------------------------------------------------------------------------------


def test_a_short_prompt_holds_its_rows_and_a_long_one_writes_them_at_its_prefill():
    extend = FakeExtend()
    mtp, memory = ledger(catch_up_after=8), FakeMemory()
    short, long = request("s", 0, 7), request("l", 1, 8)
    assert prefill(mtp, memory, short) is None
    assert mtp.held("s") == 7
    rows = prefill(mtp, memory, long, token=5)
    assert rows is not None and rows.propose and (rows.start, rows.next_ids) == (0, (*long.token_ids[1:], 5))
    assert mtp.held("l") == 0 and extend.calls == []  # (the executor runs it: ``write``)
    assert mtp.write([(long, rows)], extend) == {} and long.draft is not None and long.draft.bonus == 5


def test_plain_steps_catch_up_exactly_when_the_bound_is_reached():
    extend = FakeExtend()
    mtp, memory = ledger(catch_up_after=8), FakeMemory()
    seq = request("a", 0, 3)
    prefill(mtp, memory, seq)
    assert steps(mtp, extend, memory, [seq], 4) == {}
    assert mtp.held("a") == 7 and extend.calls == []  # one short of the bound: nothing written
    seq.draft = DraftState(0, torch.zeros(D), (0,), None)
    steps(mtp, extend, memory, [seq], 1)
    assert extend.spans() == [(0, 0, 8, True)]  # every held position, in one extend that proposes
    assert mtp.held("a") == 0 and seq.draft is not None and seq.draft.bonus == 8  # the step's token
    steps(mtp, extend, memory, [seq], 1)
    assert mtp.held("a") == 1 and seq.draft is None  # a plain step: the draft state is stale
    mtp.check_integrity({"a"})


def test_the_default_bound():
    assert MtpLedger(PAGE, None, 0).catch_up_after == CATCH_UP_AFTER == 256


def test_a_round_catches_up_first_and_a_request_that_fails_its_catch_up_fails_alone():
    extend = FakeExtend(fail={1})
    mtp, memory = ledger(catch_up_after=4), FakeMemory()
    a, b = request("a", 0, 2), request("b", 1, 2)
    prefill(mtp, memory, a)
    prefill(mtp, memory, b)
    failed = steps(mtp, extend, memory, [a, b], 2)
    assert set(failed) == {"b"} and "injected" in failed["b"]
    assert extend.spans() == [(0, 0, 4, True)] and mtp.held("a") == 0
    steps(mtp, extend, memory, [a], 1)
    mtp.before_draft([a], memory, extend)
    assert extend.spans() == [(0, 4, 5, True)] and mtp.held("a") == 0


# --- the limit ------------------------------------------------------------------------------------------


def test_no_row_at_or_past_the_limit_is_held_or_written():
    extend = FakeExtend()
    mtp, memory = ledger(limit=10, catch_up_after=4), FakeMemory()
    seq = request("a", 0, 8)
    rows = prefill(mtp, memory, seq)  # 8 positions, over the bound: written at once
    assert rows is not None and rows.start == 0 and len(rows.next_ids) == 8
    steps(mtp, extend, memory, [seq], 3)  # positions 8, 9 held; 10 not (at the limit)
    assert mtp.held("a") == 2
    assert extend.calls == []  # 2 held, under the bound; and position 10 can no longer speculate
    with pytest.raises(ValueError, match=r"holds more than the speculative max_context \(10\) tokens"):
        mtp.before_draft([seq], memory, extend)
    assert mtp.rows_read(8, 12) == 2 and mtp.rows_read(10, 12) == 0 and mtp.rows_read(3, 9) == 6


def test_a_request_reaching_the_limit_keeps_its_rows_instead_of_catching_up():
    extend = FakeExtend()
    mtp, memory = ledger(limit=10, catch_up_after=5), FakeMemory()
    seq = request("a", 0, 1)
    prefill(mtp, memory, seq)
    steps(mtp, extend, memory, [seq], 8)  # positions 1..8: caught up once 5 are held
    assert extend.spans() == [(0, 0, 5, True)] and mtp.held("a") == 4
    steps(mtp, extend, memory, [seq], 1)  # position 9: 5 held, but it reaches the limit: no round
    assert len(extend.calls) == 1 and mtp.held("a") == 5
    steps(mtp, extend, memory, [seq], 2)  # positions 10, 11: at or past the limit, never held
    assert len(extend.calls) == 1 and mtp.held("a") == 5


def test_a_prompt_past_the_limit_never_proposes_and_holds_only_rows_below_it():
    mtp = ledger(limit=6, catch_up_after=2)
    seq = request("a", 0, 9)
    assert mtp.never_speculates(seq)
    assert mtp.after_chunk(seq, 0, 4, hidden(0, 4)) is None  # held, not written
    assert mtp.after_prompt(seq, 4, hidden(4, 9), 7) is None  # 4 and 5 only
    assert mtp.held("a") == 6
    short = request("b", 1, 5)  # a chunk of a prompt under the limit: its rows are written
    rows = mtp.after_chunk(short, 0, 3, hidden(0, 3))
    assert rows is not None and not rows.propose and rows.next_ids == short.token_ids[1:4]


# --- leaving to the prefix cache --------------------------------------------------------------------


def leave(mtp: MtpLedger, extend: FakeExtend, memory: FakeMemory, seq: Sequence) -> tuple[int, ...]:
    tokens = mtp.leave(seq, memory, extend)
    memory.release(seq, tokens)
    mtp.left(seq, memory)
    return tokens


def test_rows_are_deferred_to_the_cache_within_its_budget_for_full_pages_only():
    extend = FakeExtend()
    mtp, memory = ledger(pending_limit=100), FakeMemory()
    seq = request("a", 0, 5)
    prefill(mtp, memory, seq)
    steps(mtp, extend, memory, [seq], 6)  # 11 positions held, 12 tokens known: 2 full pages (8 positions)
    mtp.before_leaving([seq], memory, extend)
    tokens = leave(mtp, extend, memory, seq)
    assert extend.calls == []  # nothing written
    assert tokens == (*seq.token_ids, *seq.produced)
    cache = memory.cache
    chain = cache.match(tokens)
    assert len(chain) == 2 and cache.pending_positions == 8
    for index, entry in enumerate(chain):
        offset, rows = entry.mtp_pending
        assert offset == 0 and rows[:, 0].tolist() == list(range(index * PAGE, (index + 1) * PAGE))
    mtp.check_integrity(set())  # nothing of it stays

    # a request that shares those pages writes their rows at its admission, proposing nothing
    sharer = request("b", 1, 0)
    sharer.token_ids = (*tokens[:9], 3)
    memory.lengths[1] = 8  # the two shared pages
    mtp.on_admit(sharer, memory, extend)
    assert extend.spans() == [(1, 0, 4, False), (1, 4, 8, False)]
    assert [x.next_ids for x in extend.calls[-1]] == [sharer.token_ids[1:5], sharer.token_ids[5:9]]
    assert cache.pending_positions == 0 and all(e.mtp_pending is None for e in chain)


def test_beyond_the_budget_a_leaving_request_catches_up_without_proposing():
    extend = FakeExtend()
    mtp, memory = ledger(pending_limit=8), FakeMemory()
    a, b = request("a", 0, 5), request("b", 1, 5, SamplingParams(temperature=1.0))
    for seq in (a, b):
        prefill(mtp, memory, seq)
    steps(mtp, extend, memory, [a, b], 6)  # 8 rows of full pages each: room for one
    state = b.generator.get_state()
    mtp.before_leaving([a, b], memory, extend)
    assert extend.spans() == [(1, 0, 8, False)]  # b's full pages only; a's are deferred
    assert torch.equal(b.generator.get_state(), state) and b.draft is None
    assert mtp.held("b") == 0 and mtp.held("a") == 8
    tokens_a, tokens_b = leave(mtp, extend, memory, a), leave(mtp, extend, memory, b)
    assert memory.cache.pending_positions == 8  # a's, within the budget
    assert len(memory.cache.match(tokens_b)) == 2  # b's pages cached, their rows written
    assert all(e.mtp_pending is None for e in memory.cache.match(tokens_b))
    assert len(tokens_a) == len(tokens_b) == 12


def test_a_leaving_request_whose_catch_up_fails_caches_only_pages_with_every_row():
    extend = FakeExtend(fail={0})
    mtp, memory = ledger(pending_limit=0, catch_up_after=8), FakeMemory()
    seq = request("a", 0, 9)
    rows = prefill(mtp, memory, seq)  # 9 positions over the bound (8): written at the prefill
    assert rows is not None
    seq.draft = DraftState(7, torch.zeros(D), (0,), None)
    steps(mtp, extend, memory, [seq], 4)  # positions 9..12 held
    tokens = leave(mtp, extend, memory, seq)
    assert tokens == (*seq.token_ids, *seq.produced)[:10]  # up to the first position whose row is missing
    assert len(memory.cache.match(tokens)) == 2 and memory.cache.pending_positions == 0
    mtp.check_integrity(set())


def test_pages_past_the_limit_are_never_left_pending():
    extend = FakeExtend()
    mtp, memory = ledger(limit=6, pending_limit=4), FakeMemory()
    seq = request("a", 0, 11)  # never speculates: its rows below the limit held
    prefill(mtp, memory, seq)
    assert mtp.held("a") == 6
    with structlog.testing.capture_logs() as logs:
        tokens = leave(mtp, extend, memory, seq)
    assert extend.calls == [] and logs == []  # 4 rows count (the first page's), within the budget
    chain = memory.cache.match(tokens)
    assert len(chain) == 2  # both full pages cached
    assert chain[0].mtp_pending is not None and chain[1].mtp_pending is None  # the second ends past 6
    assert memory.cache.pending_positions == 4


def test_pages_cached_before_keep_what_they_hold():
    extend = FakeExtend()
    mtp, memory = ledger(pending_limit=0), FakeMemory()
    first, second = request("a", 0, 9), request("b", 1, 9)
    second.token_ids = first.token_ids
    for seq in (first, second):
        assert prefill(mtp, memory, seq, token=3) is None
    leave(mtp, extend, memory, first)  # over the budget: its rows written as it leaves
    assert extend.spans() == [(0, 0, 8, False)] and memory.cache.pending_positions == 0
    mtp.pending_limit = 100
    with structlog.testing.capture_logs() as logs:
        tokens = leave(mtp, extend, memory, second)  # the same pages, cached already with their rows
    assert len(extend.calls) == 1 and logs == []
    assert len(memory.cache.match(tokens)) == 2 and memory.cache.pending_positions == 0
    mtp.check_integrity(set())
