"""A request as the stages see it: ids, sampling parameters, its lifecycle state, its output.

The state changes only through ``Request.apply(event)``, which runs ``statemachines.advance`` and
writes one structured log event bound to the request id. Finish rules (EOS, stop strings, token and
context limits) live here, so the synchronous driver and the async stages end requests identically.
"""

from __future__ import annotations

import time

import attrs
import structlog

from pipeline.detokenizer import IncrementalDetokenizer
from pipeline.logs import info_enabled, request_context
from pipeline.model.tokenizer import Tokenizer
from pipeline.sampling import SamplingParams, TokenLogprob
from pipeline.speculative.metrics import SpecCounters
from statemachines.request import TERMINAL, Crashed, Event, State, advance

log = structlog.get_logger("hispec.lifecycle")


@attrs.define(eq=False)
class RequestMetrics:
    """Timestamps (monotonic seconds) and counters of one request, vLLM/SGLang names."""

    arrival_time: float = attrs.Factory(time.monotonic)
    scheduled_time: float | None = None  # admitted into a prefill
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_retractions: int = 0
    # leading tokens of the latest prefill found in the prefix cache (their KV was shared, not computed)
    cached_tokens: int = 0
    # speculative decoding (SGLang meta_info / vLLM SpecDecodingStats); None without speculation
    spec: SpecCounters | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latency(self) -> float | None:
        """Mean seconds between output tokens after the first."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def spec_accept_length(self) -> float | None:
        """Tokens committed per verify round, the bonus token included."""
        return None if self.spec is None else self.spec.accept_length

    @property
    def spec_accept_rate(self) -> float | None:
        """Accepted drafts / proposed drafts, the bonus token excluded."""
        return None if self.spec is None else self.spec.accept_rate

    def as_dict(self) -> dict[str, object]:
        data = attrs.asdict(self, filter=lambda a, _: a.name != "spec")
        for name in ("queue_time", "time_to_first_token", "inter_token_latency", "e2e_latency"):
            data[name] = getattr(self, name)
        data["spec"] = None if self.spec is None else self.spec.as_dict()
        return data


@attrs.define(eq=False)
class Request:
    """One request's identity, parameters, lifecycle and output."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    tokenizer: Tokenizer
    max_context_len: int
    state: State = State.QUEUED
    output_ids: list[int] = attrs.Factory(list)
    # one per output id when the request asks for log-probabilities (``SamplingParams.logprobs``)
    output_logprobs: list[TokenLogprob] | None = None
    # set only by the terminal event (``apply``): "stop" | "length" | "abort" | "error"
    finish_reason: str | None = None
    error: str | None = None  # a crash's reason
    metrics: RequestMetrics = attrs.Factory(RequestMetrics)
    _text: str = ""  # settled output text so far (incremental detokenizer), stop strings cut away
    _detok: IncrementalDetokenizer = attrs.field(init=False)
    # ids that end the request (kept in output_ids, not in text)
    _end_ids: frozenset[int] = attrs.field(init=False)
    _stopped: bool = attrs.field(init=False, default=False)  # a stop string matched: the text is final

    def __attrs_post_init__(self) -> None:
        self.metrics.num_prompt_tokens = len(self.prompt_ids)
        if self.params.logprobs is not None and self.output_logprobs is None:
            self.output_logprobs = []
        self._detok = IncrementalDetokenizer(self.tokenizer)
        # as vLLM: ignore_eos ignores the model's end ids, never the request's own stop_token_ids
        model_ends = frozenset() if self.params.ignore_eos else self.tokenizer.eos_token_ids
        self._end_ids = model_ends | frozenset(self.params.stop_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state in TERMINAL

    @property
    def text(self) -> str:
        return self._text

    def apply(self, event: Event, stage: str | None = None, **figures: object) -> State:
        """Advance the lifecycle by ``event`` (raises ``IllegalTransition``, state unchanged).

        The terminal event is the one place that sets ``finish_reason`` (and ``error``): its
        ``reason``, ``"abort"`` for an abort, ``"error"`` for a crash. ``stage`` (the stage applying
        the event) and ``request_id`` are bound to every log line written meanwhile."""
        before = self.state
        self.state = advance(self.state, event)
        if self.state in TERMINAL:
            self.metrics.finished_time = time.monotonic()
            if isinstance(event, Crashed):
                self.finish_reason, self.error = "error", event.reason
            else:
                self.finish_reason = getattr(event, "reason", None) or self.state.value
        if not info_enabled():  # nothing would be written: spare the fields and the logger's bind
            return self.state
        fields = attrs.asdict(event) if attrs.has(type(event)) else {}
        if stage is not None:
            with request_context(self.request_id, stage):
                log.info(
                    event.name,
                    request_id=self.request_id,
                    from_state=before.value,
                    state=self.state.value,
                    **fields,
                    **figures,
                )
        else:
            log.info(
                event.name,
                request_id=self.request_id,
                from_state=before.value,
                state=self.state.value,
                **fields,
                **figures,
            )
        return self.state

    def record_verify(self, accepted: int, num_steps: int) -> None:
        """One verify round: ``accepted`` of ``num_steps`` drafts taken (the bonus token aside)."""
        if self.metrics.spec is None:
            self.metrics.spec = SpecCounters(num_steps)
        self.metrics.spec.record(accepted)

    @property
    def tokens_left(self) -> int:
        """The most tokens it may still produce (its ``max_new_tokens`` and context bounds)."""
        return min(
            self.params.max_new_tokens - len(self.output_ids),
            self.max_context_len - len(self.prompt_ids) - len(self.output_ids),
        )

    def known_tokens(self) -> tuple[int, ...]:
        """Prompt and output so far: what a re-admission after a retraction prefills."""
        return self.prompt_ids + tuple(self.output_ids)

    def append(
        self,
        tokens: tuple[int, ...] | list[int],
        now: float | None = None,
        logprobs: tuple[TokenLogprob, ...] | None = None,
    ) -> str | None:
        """Add newly committed tokens, one by one (with their ``logprobs``, one each, when the
        request asks for them); returns the finish reason if one of them ends the request (the
        tokens after it are dropped). The caller ends the request with the terminal event carrying
        that reason (``finish_reason`` is set there, not here)."""
        now = time.monotonic() if now is None else now
        keep = self.output_logprobs
        if keep is not None and (logprobs is None or len(logprobs) != len(tokens)):
            raise ValueError(
                f"request {self.request_id!r}: {len(tokens)} tokens came with "
                f"{0 if logprobs is None else len(logprobs)} log-probabilities"
            )
        for i, token in enumerate(tokens):
            self.output_ids.append(token)
            if keep is not None and logprobs is not None:  # (both or neither: checked above)
                keep.append(logprobs[i])
            self.metrics.num_generation_tokens += 1
            if self.metrics.first_token_time is None:
                self.metrics.first_token_time = now
            self.metrics.last_token_time = now
            if token in self._end_ids:
                return self._finish("stop")
            if self._hit_stop_string(self._detok.push((token,))) or self._stop_in_pending():
                return self._finish("stop")
            if len(self.output_ids) >= self.params.max_new_tokens:
                return self._finish("length")
            if len(self.prompt_ids) + len(self.output_ids) >= self.max_context_len:
                return self._finish("length")
        return None

    def _finish(self, reason: str) -> str:
        if not self._stopped and self._hit_stop_string(self._detok.finish()):  # flush what was held back
            reason = "stop"
        return reason  # the terminal event carrying it sets finish_reason

    def _stop_in_pending(self) -> bool:
        """A stop string completed by text still held back (byte pieces): ending here keeps it there."""
        if not self.params.stop:
            return False
        pending = self._detok.pending()
        return bool(pending) and any(s in self._text[-len(s) :] + pending for s in self.params.stop)

    def _hit_stop_string(self, delta: str) -> bool:
        """Add newly settled text; True (the text cut before it) when a stop string completes."""
        if self._stopped or not delta:
            return self._stopped
        before = len(self._text)
        self._text += delta
        stop = self.params.stop
        if not stop:
            return False
        start = max(0, before - max(len(s) for s in stop) + 1)  # a new match ends inside the delta
        cut = [i for i in (self._text.find(s, start) for s in stop) if i >= 0]
        if not cut:
            return False
        self._text = self._text[: min(cut)]
        self._stopped = True
        return True
