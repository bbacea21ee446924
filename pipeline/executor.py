"""The executor: the single owner of the model, the KV memory and every device command.

Mechanism only. The scheduling core (``pipeline/scheduler.py``) decides which requests go into which
command; the executor runs one command at a time (``run``) and reports what happened. Its commands
(``pipeline/messages.py``):

* ``Admit``: allocate the memory of the longest prefix of candidates that fits together;
* ``Prefill``: the admitted prompts in one flat forward, each first token, the start of staging (and,
  in speculative mode, the draft extend over the prompt);
* ``CollectReady``: requests whose staging finished, in FIFO order;
* ``Decode``: one plain decode step; ``Reserve`` / ``Draft`` / ``Verify``: a speculative round
  (``pipeline/speculative/batch_round.py``);
* ``Release``: every resource of a request goes back, in any state;
* ``Mixed``: a ``Decode`` and a ``Prefill`` as one forward (``mixed``): the decode tokens and the
  chunks' tokens in one flat batch, attention dispatched per segment (``pipeline/memory/mixed.py``);
  each part gets its own ``Outcome`` (``MixedResult``).

A command's forward is built and read by ``pipeline/forward.py``, its results committed and its
tokens chosen by ``pipeline/finish.py``; the live requests' records are a ``SequenceTable``
(``pipeline/sequence.py``), and the MTP rows of speculative mode are the ledger's
(``pipeline/speculative/ledger.py``).

Fault isolation. Work for one request (sampling, acceptance) is guarded request by request; a batched
forward that raises is bisected to the requests that make it fail (``pipeline/isolation.py``; a mixed
forward over its decode and prefill requests together). A request whose admission raises holds
nothing and fails at its first prefill (``failed_admissions``); a release never raises and never
keeps memory (``release``); a request whose staging copy or backup copy failed fails alone.

Each request samples with its own generator, so its tokens do not depend on its batch companions; a
retracted request keeps its generator (``Release(keep_sampling_state=True)``), so its random stream
continues where it stopped when it is admitted again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import attrs
import structlog
import torch

from pipeline.chunking import PrefillCounters
from pipeline.config import EngineConfig
from pipeline.finish import finish_decode, finish_prefill
from pipeline.forward import Chunk, DecodeOut, Forwards, PrefillOut
from pipeline.graphs import DecodeGraphs
from pipeline.hisparse.coordinator import HiSparseCoordinator
from pipeline.hisparse.transfer import TransferStream
from pipeline.isolation import isolate
from pipeline.isolation import reason as _reason
from pipeline.memory import OutOfMemory
from pipeline.memory.host_pool import HostRows
from pipeline.memory.interface import Residency, Transfers, TransferTotals
from pipeline.memory.resident import ResidentMemory
from pipeline.messages import (
    NO_SWAPS,
    Admit,
    AdmitResult,
    CollectReady,
    Command,
    Decode,
    Draft,
    FlushCache,
    Mixed,
    MixedResult,
    NewSequence,
    Outcome,
    Prefill,
    PrefillChunk,
    PrefillResult,
    ReadyResult,
    Release,
    Reserve,
    Result,
    RoomResult,
    StepResult,
    SwapCounts,
    Verify,
)
from pipeline.model import DeepseekV32
from pipeline.model.tokenizer import Tokenizer
from pipeline.sampling import SamplingParams
from pipeline.sequence import Sequence, SequenceTable
from pipeline.speculative import batch_round
from pipeline.speculative.draft_state import DraftState
from pipeline.speculative.drafting import ExtendInput, draft_extend
from pipeline.speculative.ledger import MtpLedger
from pipeline.speculative.metrics import SpecCounters
from pipeline.startup import start
from pipeline.validation import validate_request
from statemachines.request import Demoted, Promoted, State

log = structlog.get_logger(__name__)


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
        check_machine: bool = True,
        host_rows: HostRows | None = None,
    ) -> None:
        """Start-up (``pipeline.startup.start``, which says what each argument does)."""
        self.config = config  # as the user wrote it; what start-up derived from it is ``self.plan``
        started = start(config, model=model, tokenizer=tokenizer, transfer=transfer, trace_path=trace_path,
                        check_machine=check_machine, host_rows=host_rows)
        self.device, self.dtype, self.model = started.device, started.dtype, started.model
        self.tokenizer, self.plan = started.tokenizer, started.plan
        self.memory, self.trace = started.memory, started.trace
        # fixed-size decode inputs, replayed from CUDA graphs on CUDA (``EngineConfig.cuda_graphs``)
        self.graphs: DecodeGraphs | None = None
        if config.cuda_graphs:  # (the config allows it in one process only)
            assert isinstance(self.memory, ResidentMemory | HiSparseCoordinator)
            self.graphs = DecodeGraphs(self.model, self.memory)
        spec = self.plan.speculative
        self.num_steps = 0 if spec is None else spec.num_steps  # draft tokens per round; 0 = plain
        self.spec_counters = SpecCounters(spec.num_steps) if spec is not None else None
        self.prefill_counters = PrefillCounters()
        self.mtp = MtpLedger.for_config(config, self.plan)  # each request's MTP rows to write
        self.requests = SequenceTable(config.seed, self.tokenizer.eos_token_ids)
        # the table's maps, under the names the commands read
        self.seqs, self._by_row = self.requests.seqs, self.requests.by_row
        self.failed_admissions = self.requests.failed_admissions
        self.lost: str | None = None  # one process has no rank to lose (``CommandExecutor.lost``)
        # dynamic residency: each layout change as its request's lifecycle event, in order, until
        # taken (``take_residency_events``)
        self.residency_events: list[tuple[str, Demoted | Promoted]] = []

    @property
    def speculative(self) -> bool:
        return self.num_steps > 0

    @property
    def draft_tokens(self) -> int:
        """D: positions a speculative round adds at most (0 without speculation)."""
        return self.plan.draft_tokens

    # --- the command protocol -----------------------------------------------------------------------

    def run(self, command: Command, *, idle: bool = True) -> Outcome:
        """Run one command. ``idle``: nothing else waits for the device (``CollectReady`` may then
        wait for the copies in flight). Never raises: an error outside any one request comes back in
        ``Outcome.error`` (nothing is known of the command's effect then)."""
        start = time.perf_counter()
        before = self.memory.transfer_totals()
        try:
            self.memory.reclaim()  # a release a fault interrupted twice is finished first
            result, changed = self._dispatch(command, idle)
        except Exception as exc:  # the whole command failed: its requests fail, not the engine
            log.error("executor.command_failed", command=type(command).__name__, exc_info=True)
            # moves it made before failing are mapped to their requests now, while the rows are theirs
            self._take_residency_changes()
            return Outcome(None, NO_SWAPS, True, _reason(exc), time.perf_counter() - start)
        self._rebalance(changed)
        after = self.memory.transfer_totals()
        swaps = NO_SWAPS if after is before else _swaps_between(_summed(before), _summed(after))
        outcome = Outcome(result, swaps, changed, None, time.perf_counter() - start)
        return self._with_residency(command, outcome)

    def _rebalance(self, changed: bool) -> None:
        """A step boundary after a command that changed memory: a demoted request may come back
        (``memory.rebalance``). The command's own work is done and stands: a fault here is logged,
        never its requests' failure (a promotion whose copy failed fails its own request, at its
        next step)."""
        try:
            if changed:
                self.memory.rebalance()
        except Exception:
            log.error("executor.rebalance_failed", exc_info=True)
        self._take_residency_changes()

    def _with_residency(self, command: Command, outcome: Outcome) -> Outcome:
        """A decode command's outcome carries the residency events so far (the decode part owns the
        requests they are about); any other command's leaves them waiting."""
        if not self.residency_events or not isinstance(command, (Decode, Reserve, Draft, Verify, Mixed)):
            return outcome
        if isinstance(command, Mixed):
            if not isinstance(outcome.result, MixedResult):  # (failed whole: they wait for the next)
                return outcome
            decode = attrs.evolve(outcome.result.decode, residency=tuple(self.take_residency_events()))
            return attrs.evolve(outcome, result=attrs.evolve(outcome.result, decode=decode))
        return attrs.evolve(outcome, residency=tuple(self.take_residency_events()))

    def _take_residency_changes(self) -> None:
        """The memory's layout changes as their requests' ``Demoted`` / ``Promoted`` events (logged)."""
        for change in self.memory.take_residency_changes():
            rid = self._by_row.get(change.row)
            if rid is None:
                continue
            event = Demoted(change.num_bytes) if change.kind == "demoted" else Promoted(change.num_bytes)
            log.info("executor.residency_changed", request_id=rid, change=change.kind,
                     num_bytes=change.num_bytes)
            self.residency_events.append((rid, event))

    def take_residency_events(self) -> list[tuple[str, Demoted | Promoted]]:
        """(request id, ``Demoted`` / ``Promoted``) of the layout changes since the last call, in
        order, each once: the owner of each request's lifecycle applies them."""
        events, self.residency_events = self.residency_events, []
        return events

    def _dispatch(self, command: Command, idle: bool) -> tuple[Result, bool]:
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
            case Mixed():
                return self._mixed_step(command, idle), True
            case _:
                raise TypeError(f"unknown command {command!r}")

    # --- admission and prefill --------------------------------------------------------------------

    def validate(self, token_ids: list[int] | tuple[int, ...], params: SamplingParams) -> None:
        """Request-level checks (``pipeline/validation.py``); raises ``RequestError`` for this request
        only."""
        validate_request(
            token_ids, params, vocab_size=self.model.cfg.vocab_size, max_context_len=self.plan.max_context_len
        )

    def can_admit(self, num_tokens: int, tokens: Seq[int] | None = None, final: int | None = None) -> bool:
        """Room for a prompt of ``num_tokens`` (``tokens``: the prompt, which may share cached pages;
        ``final``: the most positions the request can reach, ``_final``)."""
        return self.memory.can_admit(
            num_tokens, speculative=self.speculative, tokens=self._cacheable(tokens), final=final
        )

    def _final(self, seq: NewSequence) -> int:
        """The most positions ``seq`` can reach: its prompt, its ``max_new_tokens`` and one round's
        drafts (the memory's hint for what to keep room for)."""
        prompt = len(seq.token_ids) if seq.num_prompt_tokens is None else seq.num_prompt_tokens
        return prompt + seq.params.max_new_tokens + self.draft_tokens

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
            if not self.can_admit(len(seq.token_ids), seq.token_ids, self._final(seq)):
                break
            try:
                cached[seq.request_id] = self._admit_one(seq)
            except Exception as exc:  # this request's admission, this request's failure
                log.error("executor.request_failed", request_id=seq.request_id, step="admit",
                          error=_reason(exc))
                self.failed_admissions[seq.request_id] = _reason(exc)
            admitted.append(seq.request_id)
        return AdmitResult(tuple(admitted), {rid: n for rid, n in cached.items() if n})

    def _admit_one(self, seq: NewSequence) -> int:
        """Allocate and register one request; returns its positions found in the prefix cache. All or
        nothing: on an error its row goes back before the error propagates."""
        tokens = self._cacheable(seq.token_ids)
        row = self.memory.admit(
            len(seq.token_ids), speculative=self.speculative, tokens=tokens, final=self._final(seq)
        )
        try:
            new = self.requests.register(seq, row)
            self.mtp.on_admit(new, self.memory, self._draft_extend)
            new.prefilled = self.memory.length(row)
        except BaseException:
            self.requests.drop(seq.request_id, keep_sampling_state=True)  # (a kept generator stays)
            self.memory.release(row)
            raise
        return new.prefilled

    @torch.inference_mode()
    def prefill_chunks(self, chunks: Seq[PrefillChunk]) -> PrefillResult:
        """One forward over a chunk of each request's prompt (a failing forward is bisected). A
        request whose chunk ends its prompt samples its first token, draft-extends (speculative; the
        MTP rows of earlier chunks are written with their chunk) and starts staging."""
        items = self.requests.chunk_items(chunks)
        before = self.memory.transfer_totals().prefill
        ran, failed = isolate(items, self._prefill_forward, "prefill")
        self.prefill_counters.record(items, self.memory.transfer_totals().prefill, before)
        return self._finish_prefill(ran, {**failed, **self.requests.unadmitted(chunks)})

    def _finish_prefill(self, ran: list[PrefillOut], failed: dict[str, str]) -> PrefillResult:
        mtp, extend = self._ledger(), self._draft_extend
        return finish_prefill(ran, failed, self.memory, mtp, extend, self.plan.max_context_len)

    # --- forwards (``pipeline/forward.py``) ------------------------------------------------------------

    def _forwards(self) -> Forwards:
        return Forwards(
            self.model, self.memory, self.device, self.trace, self._labels(), self.speculative,
            graphs=self.graphs,
        )

    def _prefill_forward(self, items: list[Chunk]) -> list[PrefillOut]:
        return self._forwards().prefill(items)

    def _decode_forward(self, seqs: list[Sequence]) -> list[DecodeOut]:
        return self._forwards().decode(seqs)

    def _mixed_forward(self, items: list) -> list:
        """Decode items (``Sequence``) and prefill items (``Chunk``) in one forward, decode first; a
        part of a bisected mixed batch that holds one kind runs as that kind's forward."""
        seqs = [x for x in items if isinstance(x, Sequence)]
        chunks = [x for x in items if not isinstance(x, Sequence)]
        if not chunks:
            return self._decode_forward(seqs)
        if not seqs:
            return self._prefill_forward(chunks)
        return self._forwards().mixed(seqs, chunks)

    def _ledger(self) -> MtpLedger | None:
        """The MTP ledger where plain steps and prefills leave MTP rows behind (speculative mode)."""
        return self.mtp if self.speculative else None

    @torch.inference_mode()
    def _draft_extend(self, inputs: list[ExtendInput]) -> list[DraftState | None]:
        """The MTP layer's draft extend over ``inputs`` (the ledger's ``extend``)."""
        return draft_extend(self.model, self.memory, inputs)

    def collect_ready(self, request_ids: list[str] | None = None) -> list[str]:
        """Requests (of ``request_ids``; all when None) whose prompt KV reached host and that now own
        their device buffer (FIFO)."""
        rows = None if request_ids is None else [self.seqs[r].row for r in request_ids if r in self.seqs]
        for rid in request_ids or []:
            seq = self.seqs.get(rid)
            if seq is None or seq.prefilled < len(seq.token_ids):
                continue
            if self.memory.residency(seq.row) is Residency.PREFILL:
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
                self.memory.ensure_capacity(
                    self.seqs[rid].row, new_tokens=new_tokens, speculative=speculative
                )
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
        ran, failed = isolate(seqs, self._decode_forward, "decode")
        return self._finish_decode(ran, failed, refused)

    def _finish_decode(
        self, ran: list[DecodeOut], failed: dict[str, str], refused: tuple[str, ...]
    ) -> StepResult:
        return finish_decode(ran, failed, refused, self.memory, self._ledger(), self._draft_extend)

    # --- a mixed step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def _mixed_step(self, command: Mixed, idle: bool) -> MixedResult:
        """A ``Mixed`` command: a decode step and a prefill forward of chunks in one model forward
        (``pipeline/memory/mixed.py``), the decode tokens first. A failing forward is bisected over
        both kinds of request together, so a request that fails, fails alone. Each part's outcome
        carries the shared forward's seconds, its own swap-in counts and whether the forward really
        carried both (no decode request may have had room). A chunk that does not continue its
        prompt fails its own command alone: the parts then run one after the other. The chunks'
        finishing failing as a whole fails their part only; a forward failing as a whole raises
        (both parts fail: ``scheduler.split``)."""
        decode, prefill = command.decode, command.prefill
        try:
            items = self.requests.chunk_items(prefill.chunks)  # checked before anything is reserved
        except Exception:
            return MixedResult(self.run(decode, idle=idle), self.run(prefill, idle=idle))
        start, before = time.perf_counter(), self.memory.transfer_totals()
        runnable, refused = self.reserve(list(decode.request_ids), new_tokens=1, speculative=False)
        seqs: list[Sequence] = [self.seqs[rid] for rid in runnable]
        ran, failed = isolate([*seqs, *items], self._mixed_forward, "mixed step")
        shared = bool(seqs) and bool(items)
        if items:
            after = self.memory.transfer_totals().prefill
            self.prefill_counters.record(items, after, before.prefill, mixed=shared)
        decoded = [r for r in ran if isinstance(r[0], Sequence)]
        step = self._finish_decode(decoded, {r: w for r, w in failed.items() if r in runnable}, refused)
        chunk_failed = {r: w for r, w in failed.items() if r not in runnable}
        chunk_failed |= self.requests.unadmitted(prefill.chunks)
        error = None
        try:
            chunks = self._finish_prefill([r for r in ran if not isinstance(r[0], Sequence)], chunk_failed)
        except Exception as exc:  # the chunks' commit or staging: their command fails, not the decode step
            log.error("executor.command_failed", command="Prefill", mixed=True, exc_info=True)
            chunks, error = None, _reason(exc)
        seconds, now = time.perf_counter() - start, self.memory.transfer_totals()
        return MixedResult(
            Outcome(step, _swaps_between(before.swap_in, now.swap_in), True, None, seconds, mixed=shared),
            Outcome(chunks, _swaps_between(before.prefill, now.prefill), True, error, seconds, mixed=shared),
        )

    # --- a speculative round ------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, request_ids: list[str]) -> StepResult:
        """Chain drafting, after each request's MTP layer catches up over its plain steps
        (``batch_round.draft_round``); the round's room must have been reserved (``reserve``)."""
        assert self.speculative, "draft() needs a speculative config"
        seqs = [self.seqs[rid] for rid in request_ids]
        failed = batch_round.draft_round(self.model, self.memory, seqs, self.num_steps, self.mtp,
                                         self._draft_extend)
        return StepResult({}, failed=failed)

    @torch.inference_mode()
    def verify(self, request_ids: list[str]) -> StepResult:
        """One target forward over ``[bonus, d_1..d_k]`` of every request, acceptance, finalize, and
        the draft extend over the accepted tokens (``batch_round.verify``)."""
        assert self.speculative and self.spec_counters is not None, "verify() needs a speculative config"
        if not request_ids:
            return StepResult({})
        seqs = [self.seqs[rid] for rid in request_ids]
        done = batch_round.verify(self.model, self.memory, seqs, self.draft_tokens, trace=self.trace,
                                  labels=self._labels())
        for accepted in done.accepted.values():
            self.spec_counters.record(accepted)
        return StepResult(done.tokens, accepted=done.accepted, failed=done.failed, logprobs=done.logprobs)

    # --- ending ----------------------------------------------------------------------------------------

    def release(self, request_id: str, *, keep_sampling_state: bool = False, cache: bool = True) -> None:
        """Free everything the request owns; safe in every state (staging included). With
        ``keep_sampling_state`` (a retraction) its generator waits for its re-admission; with
        ``cache`` (and the prefix cache on) its computed full pages stay cached.

        Never raises and never keeps memory: what goes wrong while its pages are prepared for the
        cache leaves them uncached (logged), and the memory's ``release`` frees the row whatever
        happens on its way."""
        seq = self.requests.drop(request_id, keep_sampling_state=keep_sampling_state)
        if seq is None:
            return
        tokens = None
        try:
            # (it draws nothing from the generator a retracted request keeps)
            if cache and self.config.prefix_cache:
                tokens = self.mtp.leave(seq, self.memory, self._draft_extend)
        except Exception:
            log.error("executor.release_uncached", request_id=request_id, exc_info=True)
            tokens = None
        self.memory.release(seq.row, tokens=tokens)
        self.mtp.left(seq, self.memory)

    def _catch_up_for_cache(self, seqs: list[Sequence]) -> None:
        """Requests leaving together to the prefix cache: their MTP rows written in one draft extend,
        or deferred to the cache (``MtpLedger.before_leaving``)."""
        if self.config.prefix_cache:
            self.mtp.before_leaving(seqs, self.memory, self._draft_extend)

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
            self.mtp.forget(request_id)
            seq = self.requests.drop(request_id, keep_sampling_state=keep_sampling_state)
            if seq is not None:
                self.memory.release(seq.row)

    def close(self) -> None:
        for rid in list(self.seqs):
            self.release(rid)
        self.failed_admissions.clear()
        self.requests.sampling_state.clear()
        self.memory.close()
        if self.trace is not None:
            self.trace.close()

    # --- statistics and checks --------------------------------------------------------------------

    def check_integrity(self, *, data: bool = True, states: dict[str, State] | None = None) -> None:
        """The memory's invariants, the executor's rows against the memory's, and (``states``: each
        live request's lifecycle state) every row's residency against its request's state."""
        self.memory.check_integrity(data=data)
        self.requests.check_integrity(self.memory, states)
        self.mtp.check_integrity(set(self.seqs))

    def stats(self) -> dict[str, object]:
        """Every pool's free count and capacity, HiSparse transfer counters, speculative counters."""
        out: dict[str, object] = {
            "pools": self.memory.pools(),
            "hisparse": self.memory.counters_dict(),
            "speculative": None if self.spec_counters is None else self.spec_counters.as_dict(),
            "prefill": self.prefill_counters.as_dict(),
            "prefix_cache": self.memory.cache_stats(),
            "kv_cache": self.plan.device.kv_cache(),
            "live_requests": len(self.seqs),
            "staging_requests": len(self.memory.staging_rows()),
        }
        residency = self.memory.residency_stats()
        if residency is not None:  # HiSparse: rows by layout, demotions and promotions
            out["residency"] = residency
        return out

    def pool_counts(self) -> dict[str, int]:
        """Free counts of every pool (equal to their initial values when nothing is live). A release
        that faults set aside is finished first (``reclaim``), so a shutdown that runs no command
        after it still counts that memory free."""
        self.memory.reclaim()
        return self.memory.free_counts()

    def _labels(self) -> dict[int, str] | None:
        """Each live row's request id, for the top-k trace (None when nothing is traced)."""
        return dict(self._by_row) if self.trace is not None else None


def _summed(totals: TransferTotals) -> Transfers:
    """A command's transfers of both kinds: swap-ins and a prefill's loads."""
    (hits, misses, moved), (found, loaded, read) = totals.swap_in, totals.prefill
    return hits + found, misses + loaded, moved + read


def _swaps_between(before: Transfers, after: Transfers) -> SwapCounts:
    """The transfers between two readings."""
    return SwapCounts(*(a - b for a, b in zip(after, before))) if after != before else NO_SWAPS
