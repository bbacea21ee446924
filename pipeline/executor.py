"""The executor: the single owner of the model, the KV memory and every device command.

Mechanism only. The scheduling core (``pipeline/scheduler.py``) decides which requests go into which
command; the executor runs one command at a time (``run``) and reports what happened. Its commands
(``pipeline/messages.py``):

* ``Admit``: allocate the memory of the longest prefix of candidates that fits together;
* ``Prefill``: the admitted prompts in one flat forward, each first token, the start of staging (and,
  in speculative mode, the draft extend over the prompt);
* ``CollectReady``: requests whose staging finished, in FIFO order;
* ``Decode``: one plain decode step; ``Reserve`` / ``Draft`` / ``Verify``: a speculative round
  (``pipeline/speculative/round.py``);
* ``Release``: every resource of a request goes back, in any state.

``run_together`` runs a ``Decode`` and a ``Prefill`` as one *mixed* forward (``mixed``): the decode
tokens and the chunks' tokens in one flat batch, attention dispatched per segment
(``pipeline/memory/mixed.py``); each command gets its own ``Outcome``.

Fault isolation. Work for one request (sampling, acceptance) is guarded request by request; a batched
forward that raises is retried on halves of its batch until the requests that make it fail are
found, and only those are reported ``failed`` (a mixed forward is bisected over its decode and
prefill requests together). The retries redo nothing that was committed: a forward
commits only after it returns, and everything before the commit is idempotent. A request whose
admission raises holds nothing (the memory's admission is all or nothing) and fails at its first
prefill (``failed_admissions``), the candidates after it are admitted as if it were not there; a
release never raises and never keeps memory (``release``); a request whose staging copy or backup
copy failed fails alone.

Each request samples with its own generator, so its tokens do not depend on its batch companions; a
retracted request keeps its generator (``Release(keep_sampling_state=True)``), so its random stream
continues where it stopped when it is admitted again.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import attrs
import structlog
import torch

import kernels
from pipeline.capacity import DevicePlan
from pipeline.chunking import PrefillCounters, plan_chunks
from pipeline.config import EngineConfig, check_against_model, resolve_for_model
from pipeline.errors import ConfigError
from pipeline.hisparse import prefill_swap
from pipeline.hisparse.coordinator import HiSparseCoordinator
from pipeline.hisparse.trace import TopKTrace, trace_meta
from pipeline.hisparse.transfer import TransferStream
from pipeline.memory import OutOfMemory
from pipeline.memory.interface import KVMemory, Residency
from pipeline.memory.mixed import MixedBackend
from pipeline.memory.resident import ResidentMemory
from pipeline.messages import (
    NO_FIGURES,
    Admit,
    AdmitResult,
    CollectReady,
    Command,
    Decode,
    Draft,
    FlushCache,
    NewSequence,
    Outcome,
    Prefill,
    PrefillChunk,
    PrefillResult,
    ReadyResult,
    Release,
    Reserve,
    RoomResult,
    StepFigures,
    StepResult,
    TokenLogprob,
    Verify,
)
from pipeline.model import DeepseekV32, load_model
from pipeline.model.attention_api import AttentionBackend
from pipeline.model.checkpoint import parse_dtype
from pipeline.model.fused import fuse_for_inference
from pipeline.model.tokenizer import Tokenizer, tokenizer_for_model
from pipeline.sampling import (
    NON_FINITE,
    LogitContext,
    NonFiniteLogits,
    SamplingParams,
    checked_picks,
    choose,
    make_generator,
)
from pipeline.speculative import round as spec_round
from pipeline.speculative.draft_state import DraftState
from pipeline.speculative.metrics import SpecCounters
from pipeline.speculative.rounds import ExtendInput, draft_extend
from pipeline.validation import validate_request
from statemachines.request import State

log = structlog.get_logger(__name__)
# plain steps a speculative request decodes before the MTP layer is caught up over them: bounds the
# target hidden states it keeps while adaptive speculation decodes plainly, and is large enough that
# a busy spell of plain steps (a batch over max_batch_size) seldom pays for the MTP layer at all
CATCH_UP_AFTER = 256

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
class HiddenRun:
    """The target's hidden states at consecutive positions whose MTP rows are not written yet, and
    the token after each (what the MTP layer's draft extend over them reads). Kept as the blocks
    they came in (a prefill chunk's ``[n, D]``, a decode step's row ``[D]``), never split into one
    tensor per position: a prompt's block costs one entry, not one view per position."""

    blocks: list[tuple[int, torch.Tensor, tuple[int, ...]]] = attrs.Factory(list)  # (first position, rows, next ids)
    count: int = 0

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    @property
    def first(self) -> int:
        return self.blocks[0][0]

    @property
    def last(self) -> int:
        return self.blocks[0][0] + self.count - 1

    def add(self, start: int, hidden: torch.Tensor, next_ids: Seq[int]) -> None:
        """Positions ``start, start + 1, ...`` (they continue the run): ``hidden`` ``[n, D]`` (or one
        row ``[D]``), ``next_ids`` of length n."""
        n = 1 if hidden.dim() == 1 else hidden.shape[0]
        assert n == len(next_ids) > 0, (n, len(next_ids))
        assert not self.count or start == self.last + 1, f"position {start} does not continue the run at {self.last}"
        self.blocks.append((start, hidden, tuple(next_ids)))
        self.count += n

    def truncate(self, end: int) -> None:
        """Keep the positions below ``end``."""
        kept: list[tuple[int, torch.Tensor, tuple[int, ...]]] = []
        for start, hidden, ids in self.blocks:
            if start >= end:
                break
            if start + len(ids) > end:
                hidden, ids = hidden[: end - start], ids[: end - start]
            kept.append((start, hidden, ids))
        self.blocks, self.count = kept, sum(len(ids) for _, _, ids in kept)

    def rows(self, start: int, end: int, *, own: bool = False) -> torch.Tensor:
        """The hidden states of positions ``[start, end)`` (held), ``[end - start, D]``: a view where
        one block holds them all, unless ``own`` (a copy then, which keeps no block alive)."""
        assert self.count and self.first <= start < end <= self.last + 1, f"positions [{start}, {end}) not held"
        i = bisect.bisect_right(self.blocks, start, key=lambda block: block[0]) - 1
        parts: list[torch.Tensor] = []
        single: list[torch.Tensor] = []  # consecutive decode rows, stacked together
        while i < len(self.blocks) and self.blocks[i][0] < end:
            first, hidden, ids = self.blocks[i]
            if hidden.dim() == 1:
                single.append(hidden)
            else:
                if single:
                    parts.append(torch.stack(single))
                    single = []
                lo, hi = max(start, first), min(end, first + len(ids))
                parts.append(hidden[lo - first : hi - first])
            i += 1
        if single:
            parts.append(torch.stack(single))
        if len(parts) > 1:
            return torch.cat(parts)
        return parts[0].clone() if own and parts[0]._base is not None else parts[0]

    def whole(self) -> tuple[int, torch.Tensor, tuple[int, ...]]:
        """(first position, every row ``[count, D]``, every next id)."""
        ids = tuple(t for _, _, block in self.blocks for t in block)
        return self.first, self.rows(self.first, self.last + 1), ids


@attrs.define(eq=False)
class Sequence:
    """What the executor keeps per live request."""

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
    # speculative mode, plain steps since the last draft state: (position, target hidden there, the
    # token after it); the next round's draft extend catches the MTP layer up over them first, or a
    # plain step once ``Executor.catch_up_after`` of them are held. Positions at or past
    # ``Executor.mtp_limit`` are never held (no draft reads their rows); a request whose prompt
    # reaches it holds its prompt's positions below it until it leaves (``_never_speculates``)
    behind: HiddenRun = attrs.Factory(HiddenRun)
    # leaving with its MTP layer behind: its pages go to the prefix cache with the hidden states of
    # ``behind`` in place of their MTP rows (``Executor._catch_up_for_cache``)
    mtp_deferred: bool = False

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


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Executor:
    """Owns the model and the memory; runs one command at a time (not thread-safe by design)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        model: DeepseekV32 | None = None,
        trace_path: str | None = None,
        transfer: Callable[[str, torch.device], TransferStream] | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # process-wide: torch has no per-thread setting
        self.device = torch.device(config.device)
        self.dtype = parse_dtype(config.dtype)
        self.model = (
            model if model is not None else load_model(config.model, dtype=self.dtype, device=self.device)
        )
        fuse_for_inference(self.model)  # fewer torch calls per layer, same arithmetic (``fused.py``)
        cfg = self.model.cfg
        self.config = config = resolve_for_model(config, cfg)  # "auto" speculation, max_context_len=None
        if self.model.dtype != self.dtype:
            raise ConfigError("dtype", config.dtype, f"the model given is {self.model.dtype}: they must match")
        check_against_model(
            config,
            index_topk=cfg.index_topk,
            has_mtp=cfg.num_nextn_predict_layers > 0,
            max_positions=cfg.max_position_embeddings,
        )
        self.plan = config.memory_plan(cfg.index_topk)
        self.tokenizer = tokenizer if tokenizer is not None else tokenizer_for_model(
            None if model is not None else config.model, vocab_size=cfg.vocab_size, eos_token_id=cfg.eos_token_id
        )
        memory_args = dict(
            plan=self.plan,
            num_layers=cfg.num_hidden_layers,
            row_dim=cfg.kv_row_dim,
            index_dim=cfg.index_head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        drafts = cfg.num_nextn_predict_layers if config.speculative is not None else 0  # no draft: no MTP rows
        if config.hisparse is not None:
            streams = {"transfer": transfer} if transfer is not None else {}
            hs = config.hisparse
            self.memory: KVMemory = HiSparseCoordinator(
                **memory_args, **streams, num_draft_layers=drafts,
                draft_rows_on_host=hs.draft_rows_on_host, draft_keys_on_host=hs.draft_keys_on_host,
            )
        else:
            self.memory = ResidentMemory(**memory_args, num_mtp_layers=drafts)
        self.device_plan = DevicePlan.of(config, self.plan, cfg)
        self.device_plan.check(self.memory.device_tensors())  # every allocation is what the plan says
        # the compiled CPU loops this run will call, before its first step needs them
        kernels.warm_up(self.device, self.dtype, index_heads=cfg.index_n_heads, index_dim=cfg.index_head_dim,
                        swap_in=config.hisparse is not None,
                        attention=(cfg.num_attention_heads, cfg.kv_row_dim, cfg.index_topk))
        if config.hisparse is not None and self.device.type == "cpu":
            prefill_swap.warm_up()  # a chunk's grouping of its earlier positions
        self.trace = TopKTrace(trace_path, meta=trace_meta(config, cfg, self.dtype)) if trace_path else None
        spec = config.speculative
        self.num_steps = 0 if spec is None else spec.num_steps  # draft tokens per round; 0 = plain
        self.spec_counters = SpecCounters(spec.num_steps) if spec is not None else None
        self.prefill_counters = PrefillCounters()
        self.catch_up_after = CATCH_UP_AFTER  # plain steps held before the MTP layer catches up
        # no round runs while a request of the batch holds more tokens than the rule's max_context,
        # so no draft ever reads an MTP row at or past it: those rows are never computed (None: all are)
        self.mtp_limit = None if spec is None else spec.for_device(config.device).max_context
        # positions whose MTP rows the prefix cache may hold as hidden states, left for the first
        # request that shares their pages: as many as the running requests may hold behind
        self.pending_mtp_limit = max(CATCH_UP_AFTER, self.mtp_limit or 0) * config.max_running_requests
        self.seqs: dict[str, Sequence] = {}
        self._by_row: dict[int, str] = {}
        # requests whose admission raised: admitted, holding nothing, failed at their first prefill
        self.failed_admissions: dict[str, str] = {}
        # generators of retracted requests, kept for their re-admission
        self._sampling_state: dict[str, torch.Generator | None] = {}

    @property
    def speculative(self) -> bool:
        return self.num_steps > 0

    @property
    def draft_tokens(self) -> int:
        """D: positions a speculative round adds at most (0 without speculation)."""
        return self.config.speculative.draft_tokens if self.speculative else 0

    # --- the command protocol -----------------------------------------------------------------------

    def run(self, command: Command, *, idle: bool = True) -> Outcome:
        """Run one command. ``idle``: nothing else waits for the device (``CollectReady`` may then
        wait for the copies in flight). Never raises: an error outside any one request comes back in
        ``Outcome.error`` (nothing is known of the command's effect then)."""
        start = time.perf_counter()
        before = self._swap_totals()
        try:
            self.memory.reclaim()  # a release a fault interrupted twice is finished first
            result, changed = self._dispatch(command, idle)
        except Exception as exc:  # the whole command failed: its requests fail, not the engine
            log.error("executor.command_failed", command=type(command).__name__, exc_info=True)
            return Outcome(None, NO_FIGURES, True, _reason(exc), time.perf_counter() - start)
        after = self._swap_totals()
        figures = StepFigures(*(a - b for a, b in zip(after, before))) if after != before else NO_FIGURES
        return Outcome(result, figures, changed, None, time.perf_counter() - start)

    def _dispatch(self, command: Command, idle: bool) -> tuple[object, bool]:
        match command:
            case Admit(sequences=sequences):
                result = self.admit(sequences)
                return result, bool(result.admitted)
            case Prefill(chunks=chunks):
                return self.prefill_chunks(chunks), True
            case CollectReady(request_ids=ids):
                if idle:
                    self.wait_staging()
                ready = tuple(self.collect_ready(list(ids)))
                failed = {self._by_row[row]: why for row, why in self.memory.take_staging_failures().items()}
                return ReadyResult(ready, idle, failed), bool(ready or failed)
            case Decode(request_ids=ids):
                return self.decode(list(ids)), True
            case Reserve(request_ids=ids, new_tokens=n):
                runnable, refused = self.reserve(list(ids), new_tokens=n, speculative=self.speculative)
                return RoomResult(tuple(runnable), refused), bool(runnable)
            case Draft(request_ids=ids):
                return self.draft(list(ids)), True
            case Verify(request_ids=ids):
                return self.verify(list(ids)), True
            case Release(request_ids=ids, keep_sampling_state=keep, cache=cache):
                if cache:  # the leaving requests' catch-ups in one draft extend
                    self._catch_up_for_cache([self.seqs[rid] for rid in ids if rid in self.seqs])
                for rid in ids:
                    self._release_logged(rid, keep, cache)
                return None, bool(ids)
            case FlushCache():
                return self.flush_prefix_cache(), True
            case _:
                raise TypeError(f"unknown command {command!r}")

    # --- admission and prefill --------------------------------------------------------------------

    def validate(self, token_ids: list[int] | tuple[int, ...], params: SamplingParams) -> None:
        """Request-level checks (``pipeline/validation.py``); raises ``RequestError`` for this request
        only."""
        validate_request(
            token_ids, params, vocab_size=self.model.cfg.vocab_size, max_context_len=self.config.max_context_len
        )

    def can_admit(self, num_tokens: int, tokens: Seq[int] | None = None) -> bool:
        """Room for a prompt of ``num_tokens`` (``tokens``: the prompt, which may share cached pages)."""
        return self.memory.can_admit(num_tokens, speculative=self.speculative, tokens=self._cacheable(tokens))

    def _cacheable(self, tokens: Seq[int] | None) -> Seq[int] | None:
        return tokens if self.config.prefix_cache else None

    def admit(self, sequences: Seq[NewSequence]) -> AdmitResult:
        """Allocate, in order, every candidate until the first that does not fit: each allocation
        counts against the next, so the batch is judged as a whole. A candidate whose admission
        raises is admitted holding nothing (``failed_admissions``): its first prefill fails it."""
        admitted: list[str] = []
        cached: dict[str, int] = {}
        for seq in sequences:
            if seq.request_id in self.seqs or seq.request_id in self.failed_admissions:
                raise ValueError(f"request {seq.request_id!r} is already admitted")
            if not self.can_admit(len(seq.token_ids), seq.token_ids):
                break
            try:
                cached[seq.request_id] = self._admit_one(seq)
            except Exception as exc:  # this request's admission, this request's failure
                log.error("executor.request_failed", request_id=seq.request_id, step="admit", error=_reason(exc))
                self.failed_admissions[seq.request_id] = _reason(exc)
            admitted.append(seq.request_id)
        return AdmitResult(tuple(admitted), {rid: n for rid, n in cached.items() if n})

    def _admit_one(self, seq: NewSequence) -> int:
        """Allocate and register one request; returns its positions found in the prefix cache. All or
        nothing: on an error its row goes back before the error propagates."""
        row = self.memory.admit(len(seq.token_ids), speculative=self.speculative, tokens=self._cacheable(seq.token_ids))
        try:
            self._register(seq, row)
            if self.speculative:
                self._write_cached_mtp_rows(self.seqs[seq.request_id])
            self.seqs[seq.request_id].prefilled = self.memory.length(row)
        except BaseException:
            self.seqs.pop(seq.request_id, None)
            self._by_row.pop(row, None)
            self.memory.release(row)
            raise
        return self.seqs[seq.request_id].prefilled

    def _write_cached_mtp_rows(self, seq: Sequence) -> None:
        """A request that shares cached pages whose MTP rows were left for later (their request left
        with its MTP layer behind): those rows, from the hidden states the pages hold, in one draft
        extend that proposes nothing, before anything reads them. If that fails the pages stay as
        they are (a later request tries again) and this request's drafts read what the rows hold:
        slower, never different tokens, since verification decides."""
        cache = self.memory.cache
        shared = self.memory.length(seq.row) // self.config.page_size
        if cache is None or not shared or not cache.pending_positions:
            return
        todo = cache.pending(cache.match(seq.token_ids)[:shared])
        if not todo:
            return
        page = self.config.page_size
        inputs = []
        for index, entry in todo:
            offset, hidden = entry.mtp_pending
            start, end = index * page + offset, (index + 1) * page
            next_ids = tuple(seq.token_ids[start + 1 : end + 1])  # the page's key holds the token after it
            inputs.append(ExtendInput(seq.row, start, next_ids, hidden, seq.params, None, propose=False))
        try:
            with torch.inference_mode():
                draft_extend(self.model, self.memory, inputs)
        except Exception:
            log.warning("executor.cached_mtp_rows_failed", request_id=seq.request_id, exc_info=True)
            return
        cache.clear_pending(entry for _, entry in todo)

    @torch.inference_mode()
    def prefill_chunks(self, chunks: Seq[PrefillChunk]) -> PrefillResult:
        """One forward over a chunk of each request's prompt (a failing forward is bisected). A
        request whose chunk ends its prompt samples its first token, draft-extends (speculative; the
        MTP rows of earlier chunks are written with their chunk) and starts staging."""
        items = self._chunk_items(chunks)
        before = self._prefill_totals()
        ran, failed = self.isolate(items, self._prefill_forward, "prefill")
        self.prefill_counters.record(items, self._prefill_totals(), before)
        return self._finish_prefill(ran, {**failed, **self._unadmitted(chunks)})

    def _unadmitted(self, chunks: Seq[PrefillChunk]) -> dict[str, str]:
        """The requests of ``chunks`` whose admission failed, with the reason (they fail now)."""
        return {c.request_id: self.failed_admissions[c.request_id] for c in chunks
                if c.request_id in self.failed_admissions}

    def _chunk_items(self, chunks: Seq[PrefillChunk]) -> list[tuple[Sequence, int, int]]:
        """(request, start, end) of each chunk, checked against its prefill so far; the chunks of
        requests whose admission failed are left out (``_unadmitted``)."""
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

    def _finish_prefill(self, ran: list, failed: dict[str, str]) -> PrefillResult:
        """After a prefill forward: commit each chunk; a prompt's last chunk samples its first token,
        draft-extends (speculative) and starts staging."""
        first: dict[str, int] = {}
        logprobs: dict[str, TokenLogprob] = {}
        extend: list[tuple[Sequence, ExtendInput]] = []
        for (seq, start, end), hidden, logits in ran:
            final = end == len(seq.token_ids)
            try:
                self.memory.commit_prefill(seq.row, start, end, final=final)
                seq.prefilled = end
                if not final:
                    keep = self._mtp_rows(start, end)
                    next_ids = seq.token_ids[start + 1 : start + keep + 1]  # the next id of its last is the prompt's
                    if keep and self._never_speculates(seq):  # rows only a request sharing its pages reads
                        seq.behind.add(start, hidden[:keep], next_ids)
                    elif keep:  # the chunk's MTP rows
                        extend.append((seq, ExtendInput(seq.row, start, next_ids, hidden[:keep], seq.params, None,
                                                        False)))
                    continue
                token, logprob = seq.choose(logits)
            except Exception as exc:  # this request's commit or sampling, this request's failure
                failed[seq.request_id] = _reason(exc)
                continue
            first[seq.request_id] = token
            if logprob is not None:
                logprobs[seq.request_id] = logprob
            seq.produced.append(token)
            if self.speculative:
                next_ids = (*seq.token_ids[start + 1 :], token)
                keep = self._mtp_rows(start, end)
                if len(seq.behind) + keep < self.catch_up_after or self._never_speculates(seq):
                    # the MTP layer catches up when a round first needs it (or the bound is reached):
                    # a request that never speculates (a busy batch, a prompt past mtp_limit) never
                    # pays for its draft extend (a request that shares its pages may, ``release``)
                    seq.plain_next, seq.draft = token, None
                    if keep:
                        seq.behind.add(start, hidden[:keep], next_ids[:keep])
                else:
                    extend.append((seq, ExtendInput(seq.row, start, next_ids, hidden, seq.params, seq.generator)))
            else:
                seq.plain_next = token
        if extend:
            extended, errors = self.isolate(extend, self._extend, "draft extend")
            for seq, state in extended:
                if state is not None:
                    seq.draft = state
            failed.update(errors)
            for rid in errors:
                first.pop(rid, None)
                logprobs.pop(rid, None)
        for rid, token in first.items():
            seq = self.seqs[rid]
            if not self._ends_at_first(seq, token):
                self.memory.start_staging(seq.row, len(seq.token_ids))
        return PrefillResult(first, failed, logprobs)

    def _prefill_forward(
        self, items: list[tuple[Sequence, int, int]]
    ) -> list[tuple[tuple[Sequence, int, int], torch.Tensor | None, torch.Tensor]]:
        batch = self._prefill_batch(items)
        try:
            hidden = self.model(batch.ids, batch.positions, batch.backend)  # [T, D]
        finally:
            self.memory.end_forward()  # swap-in workspace lent to this forward goes back
        return self._prefill_outputs(items, hidden)

    def _prefill_batch(self, items: list[tuple[Sequence, int, int]]) -> _Batch:
        dev = self.device
        targets = [self.memory.prefill_targets(seq.row, start, end) for seq, start, end in items]
        ids = torch.tensor([t for seq, start, end in items for t in seq.token_ids[start:end]], device=dev)
        positions = torch.cat([torch.arange(start, end, device=dev) for _, start, end in items])
        rows = torch.cat([torch.full((end - start,), seq.row, device=dev) for seq, start, end in items])
        starts = torch.cat([torch.full((end - start,), start, device=dev) for _, start, end in items])
        locs = torch.cat([t.locs for t in targets])
        slots = torch.cat([t.slots for t in targets])
        backend = self.memory.backend(
            rows, positions, locs, slots, chunk_starts=starts, trace=self.trace, labels=self._labels()
        )
        return _Batch(ids, positions, backend)

    def _prefill_outputs(
        self, items: list[tuple[Sequence, int, int]], hidden: torch.Tensor
    ) -> list[tuple[tuple[Sequence, int, int], torch.Tensor | None, torch.Tensor]]:
        """Per chunk: (the item, its hidden states (speculative: the draft extend's input), the
        logits of its last token)."""
        dev = self.device
        lens = [end - start for _, start, end in items]
        ends = torch.cumsum(torch.tensor(lens), 0) - 1
        logits = self.model.logits(hidden[ends.to(dev)])  # [B, V]
        out, at = [], 0
        for i, (item, n) in enumerate(zip(items, lens)):
            # own copies (the draft extend's input): no batch retained
            own = hidden[at : at + n].clone() if self.speculative else None
            out.append((item, own, logits[i]))
            at += n
        return out

    def _never_speculates(self, seq: Sequence) -> bool:
        """Its prompt alone reaches ``mtp_limit``: no round will ever run for it, and the MTP rows
        of its positions below the limit are only for a later request that shares its pages. They
        are held as hidden states (``behind``, at most ``mtp_limit`` of them) and computed only if
        one does (``_catch_up_for_cache``)."""
        return self._past_limit(len(seq.token_ids))

    def _past_limit(self, length: int) -> bool:
        """A request whose KV holds ``length`` positions holds more tokens than ``mtp_limit`` (its
        next token too): no round runs for it, now or later."""
        return self.mtp_limit is not None and length >= self.mtp_limit

    def _mtp_rows(self, start: int, end: int) -> int:
        """How many of positions ``[start, end)`` (from ``start``) may have their MTP rows read: all
        of them in speculative mode, but none at or past ``mtp_limit``; 0 without speculation."""
        if not self.speculative:
            return 0
        return end - start if self.mtp_limit is None else max(0, min(end, self.mtp_limit) - start)

    def _extend(self, items: list[tuple[Sequence, ExtendInput]]) -> list[tuple[Sequence, DraftState]]:
        states = draft_extend(self.model, self.memory, [x for _, x in items])
        return [(seq, state) for (seq, _), state in zip(items, states)]

    def _ends_at_first(self, seq: Sequence, token: int) -> bool:
        """The first token certainly ends the request (the caller ends it at once): its prompt KV is
        not copied to host for nothing. A stop string is only known to the caller: it still copies."""
        limit = seq.params.max_new_tokens == 1 or len(seq.token_ids) + 1 >= self.config.max_context_len
        ends = token in seq.params.stop_token_ids or (token in self.tokenizer.eos_token_ids and not seq.params.ignore_eos)
        return limit or ends

    def prefill(self, sequences: list[NewSequence]) -> PrefillResult:
        """``Admit`` then every ``Prefill`` forward their prompts take, in chunks of the config's
        ``chunked_prefill_tokens`` within its ``prefill_budget`` (tests and benchmarks): the
        sequences that do not fit are left out of the result (neither in ``first_tokens`` nor in
        ``failed``)."""
        admitted = list(self.admit(sequences).admitted)
        first: dict[str, int] = {}
        failed = {rid: self.failed_admissions[rid] for rid in admitted if rid in self.failed_admissions}
        while True:
            pending = [
                (rid, self.seqs[rid].prefilled, len(self.seqs[rid].token_ids))
                for rid in admitted
                if rid not in failed and rid in self.seqs
            ]
            chunks = plan_chunks(pending, self.config.prefill_budget, self.config.chunked_prefill_tokens)
            if not chunks:
                return PrefillResult(first, failed)
            result = self.prefill_chunks(chunks)
            first.update(result.first_tokens)
            failed.update(result.failed)

    def collect_ready(self, request_ids: list[str] | None = None) -> list[str]:
        """Requests (of ``request_ids``; all when None) whose prompt KV reached host and that now own
        their device buffer (FIFO)."""
        rows = None if request_ids is None else [self.seqs[rid].row for rid in request_ids if rid in self.seqs]
        for rid in request_ids or []:
            seq = self.seqs.get(rid)
            computed = seq is not None and seq.prefilled == len(seq.token_ids)
            if computed and self.memory.residency(seq.row) is Residency.PREFILL:
                # its first token looked final, so staging was skipped; it goes on after all
                self.memory.start_staging(seq.row, len(seq.token_ids))
        ready = self.memory.collect_ready(rows, speculative=self.speculative)
        return [self._by_row[row] for row in ready]

    def staging(self) -> list[str]:
        return [self._by_row[row] for row in self.memory.staging_rows()]

    def wait_staging(self) -> None:
        """Block until every staging copy in flight has landed."""
        self.memory.wait_staging()

    # --- decode -----------------------------------------------------------------------------------

    def reserve(
        self, request_ids: list[str], *, new_tokens: int, speculative: bool
    ) -> tuple[list[str], tuple[str, ...]]:
        """Room for ``new_tokens`` more positions, request by request, each reservation counting
        against the next: (the requests that got it, the refused ones). Reserving again is a no-op."""
        runnable: list[str] = []
        refused: list[str] = []
        for rid in request_ids:
            try:  # (it raises before changing anything when the room is not there)
                self.memory.ensure_capacity(self.seqs[rid].row, new_tokens=new_tokens, speculative=speculative)
            except OutOfMemory:
                refused.append(rid)
            else:
                runnable.append(rid)
        return runnable, tuple(refused)

    @torch.inference_mode()
    def decode(self, request_ids: list[str]) -> StepResult:
        """One plain decode step: each request's pending token gets its KV and a successor."""
        runnable, refused = self.reserve(request_ids, new_tokens=1, speculative=False)
        if not runnable:
            return StepResult({}, refused)
        seqs = [self.seqs[rid] for rid in runnable]
        ran, failed = self.isolate(seqs, self._decode_forward, "decode")
        return self._finish_decode(ran, failed, refused)

    def _finish_decode(self, ran: list, failed: dict[str, str], refused: tuple[str, ...]) -> StepResult:
        """After a decode forward: commit the new rows, sample each request's next token."""
        out: dict[str, tuple[int, ...]] = {}
        logprobs: dict[str, tuple[TokenLogprob, ...]] = {}
        lost: dict[str, str] = {}
        if ran:
            self.memory.commit_decode([s.row for s, _ in ran], torch.cat([slots for _, (slots, *_) in ran]))
            lost = self._lost_backups([s for s, _ in ran])
        speculative = self.speculative
        due: list[Sequence] = []
        for seq, (_, logits, hidden, pick) in ran:
            if seq.request_id in lost:  # its KV has no host copy: it cannot go on
                failed[seq.request_id] = lost[seq.request_id]
                continue
            try:
                if pick == NON_FINITE:
                    raise NonFiniteLogits()
                if pick is not None and seq.params.plain_choice:
                    seq.plain_next, logprob = pick, None
                else:
                    seq.plain_next, logprob = seq.choose(logits, pick)
            except Exception as exc:  # this request's sampling, this request's failure
                failed[seq.request_id] = _reason(exc)
                continue
            out[seq.request_id] = (seq.plain_next,)
            if logprob is not None:
                logprobs[seq.request_id] = (logprob,)
            seq.produced.append(seq.plain_next)
            if not speculative:
                continue
            seq.draft = None  # a plain step of a speculative request (adaptive speculation)
            position = self.memory.length(seq.row) - 1  # of the token this step computed
            if not self._past_limit(position):  # (a row at or past the limit is never read)
                # a view of the step's hidden states, which nothing writes again: the requests of the
                # step hold its rows together (what a copy each would hold), without a copy per request
                seq.behind.add(position, hidden, (seq.plain_next,))
                # (one that can no longer speculate, past mtp_limit, keeps its rows for the cache)
                if seq.behind.count >= self.catch_up_after and not self._past_limit(position + 1):
                    due.append(seq)
        if due:  # bound what a long run of plain steps keeps: the MTP layer catches up now
            _, errors = self.isolate(due, self._catch_up_group, "draft catch-up")
            for rid, why in errors.items():
                failed[rid] = why
                out.pop(rid, None)
                logprobs.pop(rid, None)
        return StepResult(out, refused, failed=failed, logprobs=logprobs)

    def _lost_backups(self, seqs: list[Sequence]) -> dict[str, str]:
        """The requests of ``seqs`` whose backup to host failed (``KVMemory.take_backup_failures``)."""
        rows = self.memory.take_backup_failures([s.row for s in seqs])
        return {self._by_row[row]: why for row, why in rows.items()}

    def _catch_up_group(self, seqs: list[Sequence]) -> list[Sequence]:
        self._catch_up(seqs)
        return seqs

    def _decode_forward(self, seqs: list[Sequence]) -> list[tuple[Sequence, tuple[torch.Tensor, torch.Tensor]]]:
        batch = self._decode_batch(seqs)
        hidden = self.model(batch.ids, batch.positions, batch.backend)  # [B, D]
        return self._decode_outputs(seqs, batch, hidden)

    def _decode_batch(self, seqs: list[Sequence]) -> _Batch:
        row_list = [s.row for s in seqs]
        targets = self.memory.prepare_decode(row_list)
        dev = self.device
        rows = torch.tensor(row_list, device=dev)
        positions = torch.tensor([self.memory.length(r) for r in row_list], device=dev)
        ids = torch.tensor([s.next_token for s in seqs], device=dev)
        backend = self.memory.backend(
            rows, positions, targets.locs, targets.slots, steps=1, trace=self.trace, labels=self._labels()
        )
        return _Batch(ids, positions, backend, targets.slots)

    def _decode_outputs(self, seqs: list[Sequence], batch: _Batch, hidden: torch.Tensor) -> list:
        """Per request: (its new row's slot, its logits, its hidden state, its greedy token or None,
        or ``NON_FINITE``). The greedy requests' tokens are one ``argmax`` over the batch's rows (the
        one ``sample`` takes of each row alone: the first maximum), read back in one transfer with
        whether each request's logits are finite."""
        logits = self.model.logits(hidden)  # [B, V]
        picks = checked_picks(logits, [s.params for s in seqs])
        return [(s, (batch.slots[i : i + 1], logits[i], hidden[i], picks[i])) for i, s in enumerate(seqs)]

    # --- a mixed step -------------------------------------------------------------------------------

    def run_together(self, commands: Seq[Command], *, idle: bool = False) -> tuple[Outcome, ...]:
        """Run ``commands`` and return each one's own ``Outcome``, in order. One ``Decode`` and one
        ``Prefill`` (and mixed steps on) run as one mixed forward (``mixed``): the outcome of each
        says ``mixed`` and carries the shared forward's seconds and its own swap-in figures. Anything
        else runs one command after the other (``run``)."""
        kinds = sorted(type(c).__name__ for c in commands)
        if kinds != ["Decode", "Prefill"] or not self.config.mixed_steps:
            return tuple(self.run(c, idle=idle) for c in commands)
        decode = next(c for c in commands if isinstance(c, Decode))
        prefill = next(c for c in commands if isinstance(c, Prefill))
        try:
            self._chunk_items(prefill.chunks)
        except Exception:  # a chunk that does not continue its prompt fails its command alone
            return tuple(self.run(c, idle=idle) for c in commands)
        start = time.perf_counter()
        before = self._decode_totals(), self._prefill_totals()
        try:
            step, chunks, shared = self.mixed(list(decode.request_ids), prefill.chunks)
        except Exception as exc:  # the whole step failed: the requests of both commands fail
            log.error("executor.command_failed", command="Mixed", exc_info=True)
            failed = Outcome(None, NO_FIGURES, True, _reason(exc), time.perf_counter() - start, mixed=True)
            return tuple(failed for _ in commands)
        seconds = time.perf_counter() - start
        after = self._decode_totals(), self._prefill_totals()
        figures = [StepFigures(*(a - b for a, b in zip(x, y))) for x, y in zip(after, before)]
        # the chunks' own finishing failed as a whole (as their Prefill alone would): they fail, the
        # decode step's result stands
        prefill_error = _reason(chunks) if isinstance(chunks, Exception) else None
        by_kind = {
            Decode: Outcome(step, figures[0], True, None, seconds, mixed=shared),
            Prefill: Outcome(None if prefill_error else chunks, figures[1], True, prefill_error, seconds, mixed=shared),
        }
        return tuple(by_kind[type(c)] for c in commands)

    @torch.inference_mode()
    def mixed(
        self, request_ids: list[str], chunks: Seq[PrefillChunk]
    ) -> tuple[StepResult, PrefillResult | Exception, bool]:
        """A decode step of ``request_ids`` and a prefill forward of ``chunks`` in one model forward
        (``pipeline/memory/mixed.py``): the decode tokens, then the chunks' tokens. A failing forward
        is bisected over both kinds of request together, so a request that fails, fails alone.
        Returns both results (the prefill's is the exception when finishing its chunks failed as a
        whole) and whether the forward really carried both (no decode request may
        have had room)."""
        items = self._chunk_items(chunks)  # checked before anything is reserved
        runnable, refused = self.reserve(request_ids, new_tokens=1, speculative=False)
        seqs: list = [self.seqs[rid] for rid in runnable]
        before = self._prefill_totals()
        ran, failed = self.isolate(seqs + items, self._mixed_forward, "mixed step")
        decoded = [r for r in ran if isinstance(r[0], Sequence)]
        prefilled = [r for r in ran if not isinstance(r[0], Sequence)]
        decode_failed = {rid: why for rid, why in failed.items() if rid in runnable}
        chunk_failed = {rid: why for rid, why in failed.items() if rid not in runnable} | self._unadmitted(chunks)
        shared = bool(seqs) and bool(items)
        if items:
            self.prefill_counters.record(items, self._prefill_totals(), before, mixed=shared)
        step = self._finish_decode(decoded, decode_failed, refused) if runnable else StepResult({}, refused)
        try:
            chunk_result: PrefillResult | Exception = self._finish_prefill(prefilled, chunk_failed)
        except Exception as exc:  # the chunks' commit or staging: their command fails, not the decode step
            log.error("executor.command_failed", command="Prefill", mixed=True, exc_info=True)
            chunk_result = exc
        return step, chunk_result, shared

    def _mixed_forward(self, items: list) -> list:
        """One forward over decode items (``Sequence``) and prefill items (``(Sequence, start, end)``);
        the results of ``_decode_forward`` and of ``_prefill_forward``, decode first."""
        seqs = [x for x in items if isinstance(x, Sequence)]
        chunks = [x for x in items if not isinstance(x, Sequence)]
        if not chunks:
            return self._decode_forward(seqs)
        if not seqs:
            return self._prefill_forward(chunks)
        decode, prefill = self._decode_batch(seqs), self._prefill_batch(chunks)
        backend = MixedBackend(decode.backend, prefill.backend, len(seqs))
        ids = torch.cat([decode.ids, prefill.ids])
        try:
            hidden = self.model(ids, torch.cat([decode.positions, prefill.positions]), backend)  # [B + T, D]
        finally:
            self.memory.end_forward()  # swap-in workspace lent to the chunks goes back
        n = len(seqs)
        return self._decode_outputs(seqs, decode, hidden[:n]) + self._prefill_outputs(chunks, hidden[n:])

    # --- a speculative round ------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, request_ids: list[str]) -> StepResult:
        """Chain drafting; the round's room must have been reserved (``reserve``)."""
        assert self.speculative, "draft() needs a speculative config"
        seqs = [self.seqs[rid] for rid in request_ids]

        def chain(group: list[Sequence]) -> list[Sequence]:
            for seq in group:  # the rule never asks past it: its MTP rows there were never computed
                if self._past_limit(self.memory.length(seq.row)):
                    raise ValueError(f"request {seq.request_id!r} holds more than the speculative max_context "
                                     f"({self.mtp_limit}) tokens: no round may run for it")
            self._catch_up([s for s in group if s.behind])
            spec_round.draft(self.model, self.memory, group, self.num_steps)
            return group

        _, failed = self.isolate(seqs, chain, "draft")
        return StepResult({}, failed=failed)

    def _catch_up(self, seqs: list[Sequence], *, propose: bool = True) -> None:
        """Requests that decoded plainly since their last round: the MTP layer's draft extend over
        those positions (their target hidden states and next tokens), leaving a fresh draft state
        (none without ``propose``: for requests that are leaving, which draw nothing from their
        generators)."""
        if not seqs:
            return
        inputs = []
        for seq in seqs:
            start, hidden, next_ids = seq.behind.whole()
            inputs.append(ExtendInput(seq.row, start, next_ids, hidden, seq.params, seq.generator, propose=propose))
        for seq, state in zip(seqs, draft_extend(self.model, self.memory, inputs)):
            seq.draft, seq.behind = state, HiddenRun()

    @torch.inference_mode()
    def verify(self, request_ids: list[str]) -> StepResult:
        """One target forward over ``[bonus, d_1..d_k]`` of every request, acceptance, finalize, and
        the draft extend over the accepted tokens (``pipeline/speculative/round.py``)."""
        assert self.speculative, "verify() needs a speculative config"
        if not request_ids:
            return StepResult({})
        seqs = [self.seqs[rid] for rid in request_ids]
        done = spec_round.verify(
            self.model,
            self.memory,
            seqs,
            self.draft_tokens,
            trace=self.trace,
            labels=self._labels(),
            isolate=self.isolate,
        )
        for rid in request_ids:
            if rid in done.accepted:
                self.spec_counters.record(done.accepted[rid])
            if rid in done.tokens:
                self.seqs[rid].produced.extend(done.tokens[rid])
        return StepResult(done.tokens, accepted=done.accepted, failed=done.failed, logprobs=done.logprobs)

    # --- fault isolation ----------------------------------------------------------------------------

    def isolate(self, items: list, run: Callable[[list], list], what: str) -> tuple[list, dict[str, str]]:
        """``run(items)`` -> per-item results; when it raises, run halves until the items that fail
        alone are found. Returns (the results of the items that ran, {request id: reason})."""
        if not items:
            return [], {}
        try:
            return run(items), {}
        except Exception as exc:  # bisect to the culprit
            if len(items) == 1:
                rid = _request_id(items[0])
                log.error("executor.request_failed", request_id=rid, step=what, error=_reason(exc))
                return [], {rid: _reason(exc)}
        half = len(items) // 2
        left, left_failed = self.isolate(items[:half], run, what)
        right, right_failed = self.isolate(items[half:], run, what)
        return left + right, {**left_failed, **right_failed}

    # --- ending ----------------------------------------------------------------------------------------

    def release(self, request_id: str, *, keep_sampling_state: bool = False, cache: bool = True) -> None:
        """Free everything the request owns; safe in every state (staging included). With
        ``keep_sampling_state`` (a retraction) its generator waits for its re-admission; with
        ``cache`` (and the prefix cache on) its computed full pages stay cached.

        Never raises and never keeps memory: what goes wrong while its pages are prepared for the
        cache leaves them uncached (logged), and the memory's ``release`` frees the row whatever
        happens on its way."""
        self.failed_admissions.pop(request_id, None)
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            if not keep_sampling_state:
                self._sampling_state.pop(request_id, None)
            return
        if keep_sampling_state:
            self._sampling_state[request_id] = seq.generator
        self._by_row.pop(seq.row, None)
        tokens, deferred, before = None, False, set()
        try:
            if cache and self.config.prefix_cache:  # (it draws nothing from the generator a retracted request keeps)
                self._catch_up_for_cache([seq])
                tokens = self._cache_tokens(seq)
                deferred = seq.mtp_deferred and bool(seq.behind)
                before = {e.id for e in self.memory.cache.match(tokens)} if deferred else set()
        except Exception:
            log.error("executor.release_uncached", request_id=request_id, exc_info=True)
            tokens, deferred = None, False
        self.memory.release(seq.row, tokens=tokens)
        if deferred:
            try:
                self._leave_mtp_rows_pending(seq, tokens, before)
            except Exception:  # its sharers' drafts read what those MTP rows hold: slower, same tokens
                log.warning("executor.cached_mtp_rows_failed", request_id=request_id, exc_info=True)

    def _leave_mtp_rows_pending(self, seq: Sequence, tokens: tuple[int, ...], before: set[int]) -> None:
        """The pages ``seq``'s release just gave the cache (entries not among ``before``) whose MTP
        rows are behind hold the target's hidden states there instead."""
        cache, page = self.memory.cache, self.config.page_size
        first = seq.behind.first
        for index, entry in enumerate(cache.match(tokens)):
            end = (index + 1) * page
            if entry.id in before or end <= first:
                continue
            if self.mtp_limit is not None and end > self.mtp_limit:  # its sharers never read its rows
                break
            start = max(index * page, first)
            assert end <= seq.behind.last + 1, f"request {seq.request_id}: MTP rows missing"
            # a copy of the page's rows alone: a view would keep its whole block (a prompt chunk) alive
            cache.set_pending(entry, start - index * page, seq.behind.rows(start, end, own=True))

    def _catch_up_for_cache(self, seqs: list[Sequence]) -> None:
        """Decoding requests leaving with their MTP layer behind (they never speculated since): only
        the positions of pages the cache may take (full pages, ``PrefixCache.full_pages``) count;
        the rest of the last page is freed with the row anyway. While the cache holds fewer than
        ``pending_mtp_limit`` such positions, a request's pages go to it with the hidden states of
        those positions in place of their MTP rows (``mtp_deferred``): the first request that shares
        one writes them (``_write_cached_mtp_rows``), and a page nobody shares again never costs
        them. Beyond the limit the MTP layer catches up now, in one draft extend that proposes
        nothing for all of them; if that fails, a request leaving alone (``release``) tries again,
        and one whose catch-up fails just leaves fewer pages cached."""
        if not self.config.prefix_cache:
            return
        page = self.config.page_size
        for seq in seqs:
            if seq.behind:
                known = len(seq.token_ids) + len(seq.produced)
                end = min(self.memory.length(seq.row) // page, (known - 1) // page) * page
                if self.mtp_limit is not None:  # a sharer of a page that ends past it never runs a round
                    end = min(end, self.mtp_limit // page * page)
                if seq.behind.last >= end:
                    seq.behind.truncate(end)
        behind = [s for s in seqs if s.behind and not s.mtp_deferred and self.memory.residency(s.row) is Residency.RESIDENT]
        # within ``pending_mtp_limit``, the rows are left for the first request that shares the pages
        # (most cached pages are never shared again: the work is done only for those that are)
        room = self.pending_mtp_limit - self.memory.cache.pending_positions
        for seq in behind:
            if len(seq.behind) <= room:
                seq.mtp_deferred, room = True, room - len(seq.behind)
        behind = [s for s in behind if not s.mtp_deferred]
        if not behind:
            return
        try:
            with torch.inference_mode():
                self._catch_up(behind, propose=False)
        except Exception:
            ids = [s.request_id for s in behind]
            log.warning("executor.catch_up_failed", request_id=ids[0] if len(ids) == 1 else ids, exc_info=True)

    def _cache_tokens(self, seq: Sequence) -> tuple[int, ...]:
        """The tokens whose pages may be cached: every known token, or, while the MTP layer is behind
        (plain steps in speculative mode) and its rows are not left to the cache as hidden states,
        up to the first position whose MTP row is missing (a cached page's rows must all be there)."""
        tokens = (*seq.token_ids, *seq.produced)
        if seq.behind and not seq.mtp_deferred:
            tokens = tokens[: seq.behind.first + 1]
        return tokens

    def flush_prefix_cache(self) -> int:
        """Evict every cached page no live request shares; returns how many (0 without a cache)."""
        return self.memory.flush_cache()

    def _release_logged(self, request_id: str, keep_sampling_state: bool, cache: bool = True) -> None:
        """``release``, guarded once more: should it raise all the same, the failure is logged with
        the request id and the row is given back to the memory directly."""
        try:
            self.release(request_id, keep_sampling_state=keep_sampling_state, cache=cache)
        except Exception:
            log.error("executor.release_failed", request_id=request_id, exc_info=True)
            self.failed_admissions.pop(request_id, None)
            seq = self.seqs.pop(request_id, None)
            if seq is not None:
                self._by_row.pop(seq.row, None)
                self.memory.release(seq.row)

    def close(self) -> None:
        for rid in list(self.seqs):
            self.release(rid)
        self.failed_admissions.clear()
        self._sampling_state.clear()
        self.memory.close()
        if self.trace is not None:
            self.trace.close()

    # --- figures and checks -----------------------------------------------------------------------

    def check_integrity(self, *, data: bool = True, states: dict[str, State] | None = None) -> None:
        """The memory's invariants, the executor's rows against the memory's, and (``states``: each
        live request's lifecycle state) every row's residency against its request's state."""
        self.memory.check_integrity(data=data)
        assert {s.row for s in self.seqs.values()} == set(self.memory.live_rows()), "executor rows disagree"
        if states is None:
            return
        for rid, state in states.items():
            want = RESIDENCY.get(state)
            seq = self.seqs.get(rid)
            if want is None or rid in self.failed_admissions:  # (the latter hold nothing, and fail next)
                assert seq is None, f"request {rid} is {state.name} but holds row {seq.row}"
                continue
            assert seq is not None, f"request {rid} is {state.name} but holds no row"
            have = self.memory.residency(seq.row)
            assert have is want, f"request {rid} is {state.name} but its row is {have.name}"
        assert set(self.seqs) <= set(states), f"rows of unknown requests: {sorted(set(self.seqs) - set(states))}"

    def stats(self) -> dict[str, object]:
        """Every pool's free count and capacity, HiSparse transfer counters, speculative counters."""
        return {
            "pools": self.memory.pools(),
            "hisparse": self.memory.counters_dict(),
            "speculative": None if self.spec_counters is None else self.spec_counters.as_dict(),
            "prefill": self.prefill_counters.as_dict(),
            "prefix_cache": self.memory.cache_stats(),
            "live_requests": len(self.seqs),
            "staging_requests": len(self.memory.staging_rows()),
        }

    def pool_counts(self) -> dict[str, int]:
        """Free counts of every pool (equal to their initial values when nothing is live). A release
        that faults set aside is finished first (``reclaim``), so a shutdown that runs no command
        after it still counts that memory free."""
        self.memory.reclaim()
        return self.memory.free_counts()

    # --- helpers ----------------------------------------------------------------------------------

    def _register(self, seq: NewSequence, row: int) -> None:
        if seq.request_id in self._sampling_state:
            gen = self._sampling_state.pop(seq.request_id)
        else:
            gen = make_generator(seq.params, self.config.seed, seq.request_id)
        params = seq.params
        prompt = len(seq.token_ids) if seq.num_prompt_tokens is None else seq.num_prompt_tokens
        ends = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids)
        self.seqs[seq.request_id] = Sequence(seq.request_id, row, params, gen, tuple(seq.token_ids), prompt, ends)
        self._by_row[row] = seq.request_id

    def _labels(self) -> dict[int, str] | None:
        return dict(self._by_row) if self.trace is not None else None

    def _swap_totals(self) -> tuple[int, int, int]:
        """A command's figures: the swap-ins of decode and verify, and a prefill's loads."""
        return tuple(a + b for a, b in zip(self._decode_totals(), self._prefill_totals()))

    def _decode_totals(self) -> tuple[int, int, int]:
        """Swap-in totals of decode and verify (hits, misses, bytes); zeros without HiSparse."""
        counters = getattr(self.memory, "counters", None)
        if counters is None:
            return 0, 0, 0
        return sum(counters.hits), sum(counters.misses), sum(counters.h2d_bytes)

    def _prefill_totals(self) -> tuple[int, int, int]:
        """A prefill's earlier positions found on the device, loaded from host, and their bytes."""
        counters = getattr(self.memory, "counters", None)
        if counters is None:
            return 0, 0, 0
        return sum(counters.prefill_hits), sum(counters.prefill_loads), sum(counters.prefill_h2d_bytes)


@attrs.frozen
class _Batch:
    """The model inputs of one forward's tokens and the backend prepared for them."""

    ids: torch.Tensor
    positions: torch.Tensor
    backend: AttentionBackend
    slots: torch.Tensor | None = None  # decode: the device slot of each token's new row


def _request_id(item: object) -> str:
    """The request an isolated item belongs to (a ``Sequence``, or a tuple starting with one)."""
    while isinstance(item, tuple):
        item = item[0]
    return item.request_id
