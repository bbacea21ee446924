"""The MTP ledger: which positions of each request still lack their MTP rows, and when they get them.

Row p of the MTP layer pairs the target's hidden state at position p with the token at p + 1; a
round's drafts read the rows of every position before them. Writing rows costs a draft extend
(``drafting.py``), and a request that decodes plainly (adaptive speculation: a batch over
``max_batch_size``, a prompt past ``max_context``) reads none, so rows are written late:

* held: the target's hidden states at positions whose rows are not written yet wait here, per
  request (``HiddenRun``), with the token after each;
* caught up: a round writes them before it drafts (``before_draft``); a request holding
  ``catch_up_after`` of them writes them at once (``after_step``), which bounds what it holds, and a
  prompt that long writes its rows at its prefill (``after_prompt``);
* the limit: no round runs for a request holding more than ``limit`` tokens (the rule's
  ``max_context``), so no row at or past it is ever written, nor held;
* leaving: a request that leaves its pages to the prefix cache with rows held gives the cache the
  hidden states in place of those rows while the cache holds fewer than ``pending_limit`` such
  positions (deferred: the first request that shares a page writes them, ``on_admit``, and a page
  nobody shares again never costs them); beyond it, its rows are written as it leaves
  (``before_leaving``). Only full pages count: the rest of the last page is freed with the row.

One request's positions in speculative mode::

    0 ....... rows written ....... | held: first .. last | next token (no KV yet)
                                     (never at or past ``limit``)

The executor calls it at named points: ``on_admit``; ``after_chunk`` and ``after_prompt`` (then
``write``) for a prefill; ``after_step`` for a plain decode step; ``before_draft``;
``before_leaving``, ``leave`` and ``left`` for a release. The draft extend is given to the points
that may run one (``extend``), so the ledger runs with a fake one and no model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import structlog
import torch

from pipeline.isolation import isolate
from pipeline.memory.interface import Residency
from pipeline.speculative.draft_state import DraftState
from pipeline.speculative.drafting import ExtendInput
from pipeline.speculative.hidden_run import HiddenRun

if TYPE_CHECKING:
    from pipeline.config import EngineConfig
    from pipeline.memory.interface import KVMemory
    from pipeline.memory.prefix_cache import PrefixCache
    from pipeline.sequence import Sequence
    from pipeline.startup import EnginePlan

log = structlog.get_logger(__name__)

# plain steps a speculative request decodes before the MTP layer is caught up over them: bounds the
# target hidden states it keeps while adaptive speculation decodes plainly, and is large enough that
# a busy spell of plain steps (a batch over max_batch_size) seldom pays for the MTP layer at all
CATCH_UP_AFTER = 256

# the MTP layer's draft extend over the given rows (``drafting.draft_extend``): a draft state for
# each input that proposes, None for the others
Extend = Callable[[list[ExtendInput]], list[DraftState | None]]


@attrs.define(eq=False)
class MtpLedger:
    """Every live request's MTP rows not written yet, and the rule that decides when they are."""

    page_size: int
    # no round runs while a request of the batch holds more tokens than this (the rule's max_context),
    # so no draft ever reads an MTP row at or past it: those rows are never computed (None: all are)
    limit: int | None
    # positions whose MTP rows the prefix cache may hold as hidden states, left for the first request
    # that shares their pages
    pending_limit: int
    catch_up_after: int = CATCH_UP_AFTER  # held positions that make a plain step catch up
    # request id -> its held positions (never empty); deferred: leaving with its held rows deferred to
    # the cache; leaving: between ``leave`` and ``left``, (its tokens to cache, entries cached before)
    _held: dict[str, HiddenRun] = attrs.Factory(dict)
    _deferred: set[str] = attrs.Factory(set)
    _leaving: dict[str, tuple[tuple[int, ...], frozenset[int]]] = attrs.Factory(dict)

    @classmethod
    def for_config(cls, config: EngineConfig, plan: EnginePlan) -> MtpLedger:
        spec = plan.speculative
        limit = None if spec is None else spec.for_device(config.device).max_context
        assert not isinstance(limit, str), "for_device resolves an 'auto' limit"
        # as many positions as the running requests may hold
        pending = max(CATCH_UP_AFTER, limit or 0) * plan.max_running_requests
        return cls(config.page_size, limit, pending)

    # --- the rule -----------------------------------------------------------------------------------

    def held(self, request_id: str) -> int:
        """Positions of the request whose MTP rows are held, not written."""
        run = self._held.get(request_id)
        return 0 if run is None else run.count

    def past_limit(self, length: int) -> bool:
        """A request whose KV holds ``length`` positions holds more tokens than ``limit`` (its next
        token too): no round runs for it, now or later."""
        return self.limit is not None and length >= self.limit

    def rows_read(self, start: int, end: int) -> int:
        """How many of positions ``[start, end)`` (from ``start``) a draft may read the MTP rows of:
        all but those at or past ``limit``."""
        return end - start if self.limit is None else max(0, min(end, self.limit) - start)

    def never_speculates(self, seq: Sequence) -> bool:
        """Its prompt alone reaches ``limit``: no round will ever run for it, and the MTP rows of its
        positions below the limit are only for a later request that shares its pages. They are
        held (at most ``limit`` of them) and written only if one does (``before_leaving``)."""
        return self.past_limit(len(seq.token_ids))

    # --- the named points ---------------------------------------------------------------------------

    def on_admit(self, seq: Sequence, memory: KVMemory, extend: Extend) -> None:
        """A request that shares cached pages whose MTP rows were deferred (their request left with
        its rows held): those rows, from the hidden states the pages hold, in one draft extend that
        proposes nothing, before anything reads them. If that fails the pages stay as they are (a
        later request tries again) and this request's drafts read what the rows hold: slower, never
        different tokens, since verification decides."""
        cache = memory.cache
        shared = memory.length(seq.row) // self.page_size
        if cache is None or not shared or not cache.pending_positions:
            return
        todo = cache.pending(cache.match(seq.token_ids)[:shared])
        if not todo:
            return
        page = self.page_size
        inputs = []
        for index, entry in todo:
            assert entry.mtp_pending is not None
            offset, hidden = entry.mtp_pending
            start, end = index * page + offset, (index + 1) * page
            next_ids = tuple(seq.token_ids[start + 1 : end + 1])  # the page's key holds the token after it
            inputs.append(ExtendInput(seq.row, start, next_ids, hidden, seq.params, None, propose=False))
        try:
            extend(inputs)
        except Exception:
            log.warning("executor.cached_mtp_rows_failed", request_id=seq.request_id, exc_info=True)
            return
        cache.clear_pending(entry for _, entry in todo)

    def after_chunk(self, seq: Sequence, start: int, end: int, hidden: torch.Tensor) -> ExtendInput | None:
        """A prompt chunk ``[start, end)`` that is not its last, with its hidden states ``[n, D]``:
        the extend that writes its MTP rows (the next id of its last position is the next chunk's
        first token), or None: none are read, or the prompt never speculates (they are held)."""
        keep = self.rows_read(start, end)
        if not keep:
            return None
        next_ids = seq.token_ids[start + 1 : start + keep + 1]
        if self.never_speculates(seq):  # rows only a request sharing its pages reads
            self._run(seq.request_id).add(start, hidden[:keep], next_ids)
            return None
        return ExtendInput(seq.row, start, next_ids, hidden[:keep], seq.params, None, False)

    def after_prompt(self, seq: Sequence, start: int, hidden: torch.Tensor, token: int) -> ExtendInput | None:
        """A prompt's last chunk (from ``start``) and its first token: the extend that writes its
        rows and proposes the first draft, or None: its rows are held, and the request decodes
        plainly until a round needs them (it may never: a busy batch, a prompt past ``limit``)."""
        next_ids = (*seq.token_ids[start + 1 :], token)
        keep = self.rows_read(start, len(seq.token_ids))
        if self.held(seq.request_id) + keep < self.catch_up_after or self.never_speculates(seq):
            if keep:
                self._run(seq.request_id).add(start, hidden[:keep], next_ids[:keep])
            return None
        return ExtendInput(seq.row, start, next_ids, hidden, seq.params, seq.generator)

    def write(self, items: list[tuple[Sequence, ExtendInput]], extend: Extend) -> dict[str, str]:
        """A prefill's draft extends, isolated per request: each that proposes leaves its request's
        draft state. Returns {request id: reason} of the requests whose extend failed."""

        def run(group: list[tuple[Sequence, ExtendInput]]) -> list[tuple[Sequence, DraftState | None]]:
            return list(zip([seq for seq, _ in group], extend([x for _, x in group]), strict=True))

        extended, failed = isolate(items, run, "draft extend")
        for seq, state in extended:
            if state is not None:
                seq.draft = state
        return failed

    def after_step(self, steps: list[tuple[Sequence, int, torch.Tensor]], extend: Extend) -> dict[str, str]:
        """A plain decode step of speculative requests: (request, the position it computed, the
        hidden state there ``[D]``). Their draft states are stale; the rows are held, and a request
        holding ``catch_up_after`` catches up now. Returns {request id: reason} of those that fail."""
        due: list[Sequence] = []
        for seq, position, hidden in steps:
            seq.draft = None
            if self.past_limit(position):  # (a row at or past the limit is never read)
                continue
            run = self._run(seq.request_id)
            # a view of the step's hidden states, which nothing writes again: the requests of the
            # step hold its rows together (what a copy each would hold), without a copy per request
            run.add(position, hidden, (seq.plain_next,))
            # (one that can no longer speculate, past the limit, keeps its rows for the cache)
            if run.count >= self.catch_up_after and not self.past_limit(position + 1):
                due.append(seq)

        def catch_up(group: list[Sequence]) -> list[Sequence]:
            self.catch_up(group, extend)
            return group

        _, failed = isolate(due, catch_up, "draft catch-up")
        return failed

    def before_draft(self, seqs: list[Sequence], memory: KVMemory, extend: Extend) -> None:
        """A round's requests, before their drafts: raises if one holds more than ``limit`` tokens
        (the rule never asks past it: its rows there were never written); the others' held rows
        are written, leaving fresh draft states."""
        for seq in seqs:
            if self.past_limit(memory.length(seq.row)):
                raise ValueError(f"request {seq.request_id!r} holds more than the speculative max_context "
                                 f"({self.limit}) tokens: no round may run for it")
        self.catch_up([s for s in seqs if s.request_id in self._held], extend)

    def catch_up(self, seqs: list[Sequence], extend: Extend, *, propose: bool = True) -> None:
        """The held rows of ``seqs`` in one draft extend, leaving each a fresh draft state (none
        without ``propose``: for requests that are leaving, which draw nothing from their
        generators)."""
        if not seqs:
            return
        inputs = []
        for seq in seqs:
            start, hidden, next_ids = self._held[seq.request_id].whole()
            inputs.append(
                ExtendInput(seq.row, start, next_ids, hidden, seq.params, seq.generator, propose=propose)
            )
        for seq, state in zip(seqs, extend(inputs)):
            seq.draft = state
            del self._held[seq.request_id]

    def before_leaving(self, seqs: list[Sequence], memory: KVMemory, extend: Extend) -> None:
        """Decoding requests leaving their pages to the prefix cache with rows held: only the
        positions of pages the cache may take count (full pages, ``PrefixCache.full_pages``, below
        ``limit``). Within ``pending_limit`` a request's rows are deferred to the cache; beyond it
        they are written now, in one draft extend that proposes nothing for all of them. If that
        fails, a request leaving alone (``leave``) tries again, and one whose catch-up fails just
        leaves fewer pages cached."""
        cache = memory.cache
        assert cache is not None, "leaving to the prefix cache needs one"
        page = self.page_size
        for seq in seqs:
            run = self._held.get(seq.request_id)
            if run is None:
                continue
            known = len(seq.token_ids) + len(seq.produced)
            end = min(memory.length(seq.row) // page, (known - 1) // page) * page
            if self.limit is not None:  # a sharer of a page that ends past it never runs a round
                end = min(end, self.limit // page * page)
            if run.last >= end:
                run.truncate(end)
                if not run:
                    del self._held[seq.request_id]
        behind = [s for s in seqs if s.request_id in self._held and s.request_id not in self._deferred
                  and memory.residency(s.row) is Residency.RESIDENT]
        # most cached pages are never shared again: the work is done only for those that are
        room = self.pending_limit - cache.pending_positions
        for seq in behind:
            if self.held(seq.request_id) <= room:
                self._deferred.add(seq.request_id)
                room -= self.held(seq.request_id)
        behind = [s for s in behind if s.request_id not in self._deferred]
        if not behind:
            return
        try:
            self.catch_up(behind, extend, propose=False)
        except Exception:
            ids = [s.request_id for s in behind]
            rid = ids[0] if len(ids) == 1 else ids
            log.warning("executor.catch_up_failed", request_id=rid, exc_info=True)

    def leave(self, seq: Sequence, memory: KVMemory, extend: Extend) -> tuple[int, ...]:
        """A request about to leave its pages to the prefix cache (``before_leaving`` for it alone
        first): the tokens whose pages the cache may take. Every known token, or, while rows are
        held and not deferred, up to the first position whose row is missing (a cached page's rows
        must all be there). ``left`` follows the memory's release."""
        self.before_leaving([seq], memory, extend)
        tokens = (*seq.token_ids, *seq.produced)
        run = self._held.get(seq.request_id)
        if run is None:
            return tokens
        if seq.request_id not in self._deferred:
            return tokens[: run.first + 1]
        assert memory.cache is not None
        self._leaving[seq.request_id] = (tokens, frozenset(e.id for e in memory.cache.match(tokens)))
        return tokens

    def left(self, seq: Sequence, memory: KVMemory) -> None:
        """A request's release is done: the pages it just gave the cache whose rows it deferred hold
        its hidden states there instead, and its state here goes. Never raises: if that fails, its
        sharers' drafts read what those rows hold (slower, same tokens)."""
        leaving = self._leaving.get(seq.request_id)
        run = self._held.get(seq.request_id)
        self.forget(seq.request_id)
        if leaving is None or run is None or memory.cache is None:
            return
        try:
            self._leave_pending(seq.request_id, run, *leaving, memory.cache)
        except Exception:
            log.warning("executor.cached_mtp_rows_failed", request_id=seq.request_id, exc_info=True)

    def forget(self, request_id: str) -> None:
        """Drop a request's state (it is gone)."""
        self._held.pop(request_id, None)
        self._deferred.discard(request_id)
        self._leaving.pop(request_id, None)

    def check_integrity(self, live: set[str]) -> None:
        """Only live requests hold state here, and no run is empty."""
        known = set(self._held) | self._deferred | set(self._leaving)
        assert known <= live, f"MTP state of requests that are gone: {sorted(known - live)}"
        assert all(self._held.values()), "an empty held run"

    # --- helpers ------------------------------------------------------------------------------------

    def _run(self, request_id: str) -> HiddenRun:
        run = self._held.get(request_id)
        if run is None:
            run = self._held[request_id] = HiddenRun()
        return run

    def _leave_pending(
        self,
        request_id: str,
        run: HiddenRun,
        tokens: tuple[int, ...],
        before: frozenset[int],
        cache: PrefixCache,
    ) -> None:
        """The pages a release just gave the cache (entries not among ``before``) whose rows are held
        keep the hidden states there instead."""
        page = self.page_size
        for index, entry in enumerate(cache.match(tokens)):
            end = (index + 1) * page
            if entry.id in before or end <= run.first:
                continue
            if self.limit is not None and end > self.limit:  # its sharers never read its rows
                break
            start = max(index * page, run.first)
            assert end <= run.last + 1, f"request {request_id}: MTP rows missing"
            # a copy of the page's rows alone: a view would keep its whole block (a prompt chunk) alive
            cache.set_pending(entry, start - index * page, run.rows(start, end, own=True))
