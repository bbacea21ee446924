"""The executor: the single owner of the model, the KV memory and every device command.

Mechanism only. Stages (or the synchronous driver) decide which requests go into which command; the
executor runs one command at a time and reports what happened. Its commands:

* ``prefill(sequences)``: admits what fits, runs the prompts in one flat forward, samples each first
  token, starts staging (and, in speculative mode, drafts over the prompt);
* ``collect_ready()``: requests whose staging finished, in FIFO order;
* ``decode(ids)``: one plain decode step for each request;
* ``draft(ids)`` / ``verify(ids)``: one speculative round (``pipeline/speculative``);
* ``release(id)``: every resource of a request goes back, in any state.

Each request samples with its own generator, so its tokens do not depend on its batch companions.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import structlog
import torch

from pipeline.config import EngineConfig, check_against_model, resolve_for_model
from pipeline.errors import ConfigError, RequestError
from pipeline.hisparse.coordinator import HiSparseCoordinator
from pipeline.hisparse.trace import TopKTrace
from pipeline.hisparse.transfer import TransferStream
from pipeline.memory.resident import ResidentMemory
from pipeline.model import DeepseekV32, load_model
from pipeline.model.checkpoint import parse_dtype
from pipeline.model.tokenizer import Tokenizer, tokenizer_for_model
from pipeline.sampling import SamplingParams, make_generator, sample
from pipeline.speculative.draft_state import DraftState
from pipeline.speculative.metrics import SpecCounters
from pipeline.speculative.rounds import ExtendInput, accept, draft_chain, draft_extend

log = structlog.get_logger(__name__)


@attrs.frozen
class NewSequence:
    """A request entering prefill."""

    request_id: str
    token_ids: tuple[int, ...]  # the prompt (after a retraction: prompt + tokens generated so far)
    params: SamplingParams


@attrs.frozen
class PrefillResult:
    first_tokens: dict[str, int]  # request id -> the token sampled after its prompt
    refused: tuple[str, ...]  # not admitted (memory): back to the queue


@attrs.frozen
class StepResult:
    tokens: dict[str, tuple[int, ...]]  # request id -> new output tokens this step, in order
    refused: tuple[str, ...] = ()  # could not step (memory): the caller retracts them
    accepted: dict[str, int] = attrs.Factory(dict)  # speculative: accepted drafts per request
    failed: dict[str, str] = attrs.Factory(dict)  # request id -> why it cannot continue


@attrs.define(eq=False)
class Sequence:
    """What the executor keeps per live request."""

    request_id: str
    row: int
    params: SamplingParams
    generator: torch.Generator | None
    next_token: int = -1  # sampled, its KV not computed yet (it sits at position = length)
    draft: DraftState | None = None  # speculative: the stash between steps


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
        self.device = torch.device(config.device)
        self.dtype = parse_dtype(config.dtype)
        self.model = (
            model if model is not None else load_model(config.model, dtype=self.dtype, device=self.device)
        )
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
        if config.hisparse is not None:
            streams = {"transfer": transfer} if transfer is not None else {}
            drafts = cfg.num_nextn_predict_layers if config.speculative is not None else 0
            self.memory: HiSparseCoordinator | ResidentMemory = HiSparseCoordinator(
                **memory_args, **streams, num_draft_layers=drafts
            )
        else:
            self.memory = ResidentMemory(**memory_args, num_mtp_layers=cfg.num_nextn_predict_layers)
        self.trace = TopKTrace(trace_path) if trace_path else None
        spec = config.speculative
        self.spec_counters = SpecCounters(spec.num_steps) if spec is not None else None
        self.seqs: dict[str, Sequence] = {}
        self._by_row: dict[int, str] = {}

    # --- commands ---------------------------------------------------------------------------------

    def validate(self, token_ids: list[int] | tuple[int, ...], params: SamplingParams) -> None:
        """Request-level checks (ARCHITECTURE §6); raises ``RequestError`` for this request only."""
        params.validate()
        if not token_ids:
            raise RequestError("prompt", token_ids, "must not be empty")
        vocab = self.model.cfg.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise RequestError("prompt", bad[:8], f"token ids must be ints in [0, {vocab})")
        limit = self.config.max_context_len
        if len(token_ids) >= limit:
            raise RequestError(
                "prompt",
                list(token_ids),
                f"length {len(token_ids)} leaves no room: max_context_len is {limit}",
            )

    def can_admit(self, num_tokens: int) -> bool:
        return self.memory.can_admit(num_tokens)

    @torch.inference_mode()
    def prefill(self, sequences: list[NewSequence]) -> PrefillResult:
        """Admit what fits (in order), run the admitted prompts in one forward, start staging."""
        admitted: list[tuple[NewSequence, object]] = []
        refused: list[str] = []
        for seq in sequences:
            if refused or not self.memory.can_admit(len(seq.token_ids)):
                refused.append(seq.request_id)
                continue
            admitted.append((seq, self.memory.admit(len(seq.token_ids))))
        if not admitted:
            return PrefillResult({}, tuple(refused))
        dev = self.device
        ids = torch.tensor([t for seq, _ in admitted for t in seq.token_ids], device=dev)
        positions = torch.cat([torch.arange(len(seq.token_ids), device=dev) for seq, _ in admitted])
        rows = torch.cat([torch.full((len(seq.token_ids),), got.row, device=dev) for seq, got in admitted])
        locs = torch.cat([got.locs for _, got in admitted])
        slots = torch.cat([got.slots for _, got in admitted])
        for seq, got in admitted:
            self._register(seq, got.row)
        backend = self.memory.backend(rows, positions, locs, slots, trace=self.trace, labels=self._labels())
        hidden = self.model(ids, positions, backend)  # [T, D]
        ends = torch.cumsum(torch.tensor([len(seq.token_ids) for seq, _ in admitted]), 0) - 1
        logits = self.model.logits(hidden[ends.to(dev)])  # [B, V]
        first: dict[str, int] = {}
        for i, (seq, _) in enumerate(admitted):
            state = self.seqs[seq.request_id]
            state.next_token = sample(logits[i], state.params, state.generator)
            first[seq.request_id] = state.next_token
        if self.config.speculative is not None:
            self._draft_extend_prompts(admitted, hidden, ends)
        for seq, got in admitted:
            self.memory.start_staging(got.row, len(seq.token_ids))
        return PrefillResult(first, tuple(refused))

    def _draft_extend_prompts(self, admitted, hidden: torch.Tensor, ends: torch.Tensor) -> None:
        """The MTP layer over each prompt: target hidden of position p with the token at p + 1."""
        starts = (ends - torch.tensor([len(seq.token_ids) for seq, _ in admitted]) + 1).tolist()
        inputs = []
        for (seq, got), start, end in zip(admitted, starts, ends.tolist()):
            state = self.seqs[seq.request_id]
            next_ids = (*seq.token_ids[1:], state.next_token)
            inputs.append(
                ExtendInput(got.row, 0, next_ids, hidden[start : end + 1], state.params, state.generator)
            )
        for (seq, _), draft in zip(admitted, draft_extend(self.model, self.memory, inputs)):
            self.seqs[seq.request_id].draft = draft

    def collect_ready(self) -> list[str]:
        """Requests whose prompt KV reached host and that now own a device buffer (FIFO)."""
        rows = self.memory.collect_ready(speculative=self.config.speculative is not None)
        return [self._by_row[row] for row in rows]

    def staging(self) -> list[str]:
        return [self._by_row[row] for row in self.memory.staging_rows()]

    def wait_staging(self) -> None:
        """Block until every staging copy in flight has landed."""
        self.memory.wait_staging()

    def can_step(self, request_id: str, new_tokens: int = 1) -> bool:
        row = self.seqs[request_id].row
        return self.memory.can_decode(
            row, new_tokens=new_tokens, speculative=self.config.speculative is not None
        )

    @torch.inference_mode()
    def decode(self, request_ids: list[str]) -> StepResult:
        """One plain decode step: each request's pending token gets its KV and a successor."""
        runnable, refused = self.reserve(request_ids, new_tokens=1, speculative=False)
        if not runnable:
            return StepResult({}, refused)
        seqs = [self.seqs[rid] for rid in runnable]
        row_list = [s.row for s in seqs]
        targets = self.memory.prepare_decode(row_list)
        dev = self.device
        rows = torch.tensor(row_list, device=dev)
        positions = torch.tensor([self.memory.length(r) for r in row_list], device=dev)
        ids = torch.tensor([s.next_token for s in seqs], device=dev)
        backend = self.memory.backend(
            rows, positions, targets.locs, targets.slots, steps=1, trace=self.trace, labels=self._labels()
        )
        logits = self.model.logits(self.model(ids, positions, backend))  # [B, V]
        self.memory.commit_decode(row_list, targets.slots)
        out: dict[str, tuple[int, ...]] = {}
        for i, seq in enumerate(seqs):
            seq.next_token = sample(logits[i], seq.params, seq.generator)
            out[seq.request_id] = (seq.next_token,)
        return StepResult(out, refused)

    def reserve(
        self, request_ids: list[str], *, new_tokens: int, speculative: bool
    ) -> tuple[list[str], tuple[str, ...]]:
        """Room for ``new_tokens`` more positions, request by request, each reservation counting
        against the next: (the requests that got it, the refused ones). Reserving again is a no-op,
        so a caller may reserve before ``decode``/``draft`` to learn the refusals first."""
        runnable: list[str] = []
        for rid in request_ids:
            if self.can_step(rid, new_tokens):
                self.memory.ensure_capacity(self.seqs[rid].row, new_tokens=new_tokens, speculative=speculative)
                runnable.append(rid)
        return runnable, tuple(rid for rid in request_ids if rid not in runnable)

    @property
    def num_draft_steps(self) -> int:
        spec = self.config.speculative
        return 0 if spec is None else spec.num_steps

    @torch.inference_mode()
    def draft(self, request_ids: list[str]) -> StepResult:
        """Chain drafting: each request's one proposal becomes ``num_steps`` proposals."""
        spec = self.config.speculative
        assert spec is not None, "draft() needs a speculative config"
        d = spec.draft_tokens
        runnable, refused = self.reserve(request_ids, new_tokens=d, speculative=True)
        if not runnable:
            return StepResult({}, refused)
        seqs = [self.seqs[rid] for rid in runnable]
        states = draft_chain(
            self.model,
            self.memory,
            [s.row for s in seqs],
            [s.draft for s in seqs],
            [s.params for s in seqs],
            [s.generator for s in seqs],
            spec.num_steps,
        )
        for seq, state in zip(seqs, states):
            seq.draft = state
        return StepResult({}, refused)

    @torch.inference_mode()
    def verify(self, request_ids: list[str]) -> StepResult:
        """One target forward over ``[bonus, d_1..d_k]`` of every request, acceptance, finalize, and
        the draft extend over the accepted tokens."""
        spec = self.config.speculative
        assert spec is not None, "verify() needs a speculative config"
        d = spec.draft_tokens
        if not request_ids:
            return StepResult({})
        seqs = [self.seqs[rid] for rid in request_ids]
        row_list = [s.row for s in seqs]
        lengths = [self.memory.length(r) for r in row_list]
        layout = self.memory.prepare_verify(row_list, d)
        dev = self.device
        ids = torch.tensor([t for s in seqs for t in (s.draft.bonus, *s.draft.drafts)], device=dev)
        positions = torch.cat([torch.arange(n, n + d) for n in lengths]).to(dev)
        rows = torch.tensor(row_list, device=dev).repeat_interleave(d)
        backend = self.memory.backend(
            rows,
            positions,
            layout.targets.locs,
            layout.targets.slots,
            steps=d,
            trace=self.trace,
            labels=self._labels(),
        )
        hidden = self.model(ids, positions, backend)  # [B * D, H]
        logits = self.model.logits(hidden).reshape(len(seqs), d, -1)
        decisions = [
            accept(list(s.draft.drafts), s.draft.draft_probs, logits[i], s.params, s.generator)
            for i, s in enumerate(seqs)
        ]
        failed_rows = set(self.memory.finalize_verify(row_list, [a + 1 for a, _ in decisions], layout))
        out, accepted, failed, extend = {}, {}, {}, []
        for i, (seq, (a, token)) in enumerate(zip(seqs, decisions)):
            if seq.row in failed_rows:
                failed[seq.request_id] = str(self.memory.take_failure(seq.row))
                continue
            new = (*seq.draft.drafts[:a], token)
            out[seq.request_id], accepted[seq.request_id] = new, a
            self.spec_counters.record(a)
            seq.next_token = token
            extend.append(
                ExtendInput(
                    seq.row, lengths[i], new, hidden[i * d : i * d + a + 1], seq.params, seq.generator
                )
            )
        if extend:
            live = [s for s in seqs if s.request_id in out]
            for seq, state in zip(live, draft_extend(self.model, self.memory, extend)):
                seq.draft = state
        return StepResult(out, accepted=accepted, failed=failed)

    def release(self, request_id: str) -> None:
        """Free everything the request owns; safe in every state (staging included)."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return
        self._by_row.pop(seq.row, None)
        self.memory.release(seq.row)

    def close(self) -> None:
        for rid in list(self.seqs):
            self.release(rid)
        self.memory.close()
        if self.trace is not None:
            self.trace.close()

    # --- figures and checks -----------------------------------------------------------------------

    def check_integrity(self, *, data: bool = True) -> None:
        self.memory.check_integrity(data=data)
        assert {s.row for s in self.seqs.values()} == set(self.memory.live_rows()), "executor rows disagree"

    def stats(self) -> dict[str, object]:
        """Every pool's free count and capacity, HiSparse transfer counters, speculative counters."""
        return {
            "pools": self.memory.pools(),
            "hisparse": self.memory.counters_dict(),
            "speculative": None if self.spec_counters is None else self.spec_counters.as_dict(),
            "live_requests": len(self.seqs),
            "staging_requests": len(self.memory.staging_rows()),
        }

    def pool_counts(self) -> dict[str, int]:
        """Free counts of every pool (equal to their initial values when nothing is live)."""
        return self.memory.free_counts()

    # --- helpers ----------------------------------------------------------------------------------

    def _register(self, seq: NewSequence, row: int) -> None:
        gen = make_generator(seq.params, self.config.seed, seq.request_id)
        self.seqs[seq.request_id] = Sequence(seq.request_id, row, seq.params, gen)
        self._by_row[row] = seq.request_id

    def _labels(self) -> dict[int, str] | None:
        return dict(self._by_row) if self.trace is not None else None
