"""``Sequence``: what the executor keeps per live request, from its admission to its release; the
``SequenceTable`` of them all."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import attrs
import torch

from pipeline.memory.interface import Residency
from pipeline.messages import NewSequence, PrefillChunk, TokenLogprob
from pipeline.sampling import LogitContext, SamplingParams, choose, make_generator
from pipeline.speculative.draft_state import DraftState
from statemachines.request import State

if TYPE_CHECKING:
    from pipeline.memory.interface import KVMemory


@attrs.define(eq=False)
class Sequence:
    """One live request's tokens, sampling state and next token. Its MTP rows still to write are the
    ledger's (``pipeline/speculative/ledger.py``)."""

    request_id: str
    row: int
    params: SamplingParams
    generator: torch.Generator | None
    token_ids: tuple[int, ...] = ()  # what the prefill runs (prompt, plus output after a retraction)
    num_prompt: int = 0  # the prompt's share of token_ids (the rest is output from before a retraction)
    end_ids: frozenset[int] = frozenset()  # the ids that end it (what ``min_tokens`` keeps from being drawn)
    prefilled: int = 0  # positions of token_ids computed so far (chunked prefill; the cached prefix)
    produced: list[int] = attrs.Factory(list)  # tokens returned since admission, in order
    plain_next: int = -1  # plain decoding: sampled, its KV not computed yet (it sits at position = length)
    draft: DraftState | None = None  # speculative: the stash between rounds; its bonus is the next token

    @property
    def next_token(self) -> int:
        """The token whose KV comes next: the draft state's bonus in speculative mode."""
        return self.draft.bonus if self.draft is not None else self.plain_next

    def context(self) -> LogitContext | None:
        """What its logit adjustments read before its next token is chosen (None when none apply)."""
        if not self.params.adjusts_logits:
            return None
        output = (*self.token_ids[self.num_prompt :], *self.produced)
        return LogitContext(self.token_ids[: self.num_prompt], output, self.end_ids)

    def choose(self, logits: torch.Tensor, pick: int | None = None) -> tuple[int, TokenLogprob | None]:
        """Its next token from ``logits [V]`` (``pipeline.sampling.choose``) and its log-probabilities."""
        return choose(logits, self.params, self.generator, self.context(), pick)


# which residency a row must have while its request is in each state (the rest hold no row)
RESIDENCY: dict[State, Residency] = {
    State.PREFILL: Residency.PREFILL,
    State.STAGING: Residency.STAGING,
    State.READY: Residency.RESIDENT,
    State.DECODE: Residency.RESIDENT,
    State.DRAFT: Residency.RESIDENT,
    State.VERIFY: Residency.RESIDENT,
}


@attrs.define(eq=False)
class SequenceTable:
    """The live requests' records, by request id and by memory row, and what outlives a record: a
    failed admission until the request's release, a retracted request's generator until it is
    admitted again (so its random stream continues where it stopped)."""

    seed: int  # the engine's: each request's generator derives from it and the request id
    eos_ids: frozenset[int]  # the tokenizer's end-of-sequence ids
    seqs: dict[str, Sequence] = attrs.Factory(dict)
    by_row: dict[int, str] = attrs.Factory(dict)
    # requests whose admission raised: admitted, holding nothing, failed at their first prefill
    failed_admissions: dict[str, str] = attrs.Factory(dict)
    # generators of retracted requests, kept for their re-admission
    sampling_state: dict[str, torch.Generator | None] = attrs.Factory(dict)

    def register(self, new: NewSequence, row: int) -> Sequence:
        """The record of a request admitted into ``row`` (a retracted one gets its generator back)."""
        if new.request_id in self.sampling_state:
            gen = self.sampling_state.pop(new.request_id)
        else:
            gen = make_generator(new.params, self.seed, new.request_id)
        params = new.params
        prompt = len(new.token_ids) if new.num_prompt_tokens is None else new.num_prompt_tokens
        ends = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        seq = Sequence(new.request_id, row, params, gen, tuple(new.token_ids), prompt, ends)
        self.seqs[new.request_id] = seq
        self.by_row[row] = new.request_id
        return seq

    def drop(self, request_id: str, *, keep_sampling_state: bool = False) -> Sequence | None:
        """Forget a request, in any state; with ``keep_sampling_state`` (a retraction) its generator
        waits for its re-admission. Returns its record (None when it held no row)."""
        self.failed_admissions.pop(request_id, None)
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            if not keep_sampling_state:
                self.sampling_state.pop(request_id, None)
            return None
        if keep_sampling_state:
            self.sampling_state[request_id] = seq.generator
        self.by_row.pop(seq.row, None)
        return seq

    def chunk_items(self, chunks: Iterable[PrefillChunk]) -> list[tuple[Sequence, int, int]]:
        """(request, start, end) of each chunk, checked against its prefill so far; the chunks of
        requests whose admission failed are left out (``unadmitted``)."""
        items = []
        for chunk in chunks:
            if chunk.request_id in self.failed_admissions:
                continue
            seq = self.seqs[chunk.request_id]
            if chunk.start != seq.prefilled or not chunk.start < chunk.end <= len(seq.token_ids):
                raise ValueError(
                    f"request {chunk.request_id!r}: chunk [{chunk.start}, {chunk.end}) does not continue its "
                    f"prefill ({seq.prefilled} of {len(seq.token_ids)} positions computed)"
                )
            items.append((seq, chunk.start, chunk.end))
        return items

    def unadmitted(self, chunks: Iterable[PrefillChunk]) -> dict[str, str]:
        """The requests of ``chunks`` whose admission failed, with the reason (they fail now)."""
        return {c.request_id: self.failed_admissions[c.request_id] for c in chunks
                if c.request_id in self.failed_admissions}

    def check_integrity(self, memory: KVMemory, states: dict[str, State] | None) -> None:
        """The records' rows against the memory's live rows, and (``states``: each live request's
        lifecycle state) every row's residency against its request's state."""
        assert {s.row for s in self.seqs.values()} == set(memory.live_rows()), "executor rows disagree"
        if states is None:
            return
        for rid, state in states.items():
            want = RESIDENCY.get(state)
            seq = self.seqs.get(rid)
            if want is None or rid in self.failed_admissions:  # (the latter hold nothing, and fail next)
                assert seq is None, f"request {rid} is {state.name} but holds row {seq.row}"
                continue
            assert seq is not None, f"request {rid} is {state.name} but holds no row"
            have = memory.residency(seq.row)
            assert have is want, f"request {rid} is {state.name} but its row is {have.name}"
        unknown = sorted(set(self.seqs) - set(states))
        assert not unknown, f"rows of unknown requests: {unknown}"
