"""The frozen contracts of every hop: commands to the executor, their results, stage hand-offs, deltas.

Four kinds of value, one section each below:

* scheduling core -> executor: a *command* (what device work to run, by request id). Both drivers send
  the same commands (the synchronous driver calls ``Executor.run`` directly, the async engine through
  the executor actor), so the device sees one protocol.
* executor -> scheduling core: an ``Outcome`` wrapping the command's *result*. A ``Mixed`` command
  (a decode step and a prefill chunk in one forward) answers each of its two parts in its result.
* stage -> stage (async engine only): requests changing hands. Ownership moves with the message: from
  the moment a stage receives a request, only that stage applies events to it, until it sends it on.
  ``Wake`` carries no request: it asks a stage to look at shared state again.
* engine -> caller: ``RequestOutput`` deltas from ``Engine.generate`` and the ``GenerateResult`` of
  ``Engine.generate_text``.

Request objects ride inside stage messages by reference: the message is immutable, the request is an
object with identity that only its owning stage changes, and only on the event loop. Commands carry
request ids and plain values only, so they can be copied to another process unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import attrs

# a token's log-probabilities: a value of the sampling module, carried by results and deltas
from pipeline.sampling import TokenLogprob

if TYPE_CHECKING:
    from pipeline.request import Request, RequestMetrics
    from pipeline.sampling import SamplingParams
    from statemachines.request import Demoted, Promoted

_R = TypeVar("_R")


# --- commands ------------------------------------------------------------------------------------


@attrs.frozen
class NewSequence:
    """A request entering prefill."""

    request_id: str
    token_ids: tuple[int, ...]  # the prompt (after a retraction: prompt + tokens generated so far)
    params: SamplingParams
    # how many of ``token_ids`` are the prompt (the rest: output before a retraction, which the
    # logit adjustments count as output); None: all of them
    num_prompt_tokens: int | None = None


@attrs.frozen
class Admit:
    """Take the longest prefix of ``sequences`` that fits memory *together*, and allocate it.

    What an admitted request holds from here on covers everything it needs to reach decode (its
    prompt's device slots, locations and host copy, and the device buffer it gets when staging ends),
    so staging can always finish. Requests not taken change nothing and stay queued."""

    sequences: tuple[NewSequence, ...]  # queue order; the prefill token budget is already applied


@attrs.frozen
class PrefillChunk:
    """Positions ``[start, end)`` of an admitted request's prompt (``start``: what is computed)."""

    request_id: str
    start: int
    end: int


@attrs.frozen
class Prefill:
    """One prefill forward over a chunk of each request's prompt. A request whose chunk ends its
    prompt samples its first token and starts staging; the others stay in prefill."""

    chunks: tuple[PrefillChunk, ...]  # admitted requests, in queue order

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(c.request_id for c in self.chunks)


@attrs.frozen
class CollectReady:
    """Requests among ``request_ids`` whose staging copy landed: each gets its device buffer (FIFO).

    When the executor has nothing else queued, it first waits for the copies in flight."""

    request_ids: tuple[str, ...]  # the caller's staging requests


@attrs.frozen
class Decode:
    """One plain decode step; a request whose memory cannot grow comes back refused."""

    request_ids: tuple[str, ...]  # the decode batch, join order


@attrs.frozen
class Reserve:
    """Room for ``new_tokens`` more positions per request, in order, each counting against the next.

    The speculative round reserves here, once; ``Draft`` and ``Verify`` then never run out."""

    request_ids: tuple[str, ...]
    new_tokens: int  # D, the tokens a round may add


@attrs.frozen
class Draft:
    """Chain drafting with the MTP layer (room already reserved)."""

    request_ids: tuple[str, ...]


@attrs.frozen
class Verify:
    """Target verify, acceptance, finalize and draft extend."""

    request_ids: tuple[str, ...]  # drafted requests not aborted meanwhile


@attrs.frozen
class Release:
    """Give back everything these requests own, in whatever state they are (idempotent, never raises)."""

    request_ids: tuple[str, ...]
    # retraction: keep each request's sampling generator for its re-admission (its random stream goes on)
    keep_sampling_state: bool = False
    # leave the requests' computed pages to the prefix cache (False for a request that failed: its
    # memory is not trusted)
    cache: bool = True


@attrs.frozen
class FlushCache:
    """Evict every prefix-cache page that no live request shares."""


@attrs.frozen
class Mixed:
    """A ``Decode`` and a ``Prefill`` in one model forward (a *mixed step*): the decode tokens, then
    the chunks' tokens, attention per segment. The scheduling core forms it (``scheduler.mix``) from
    two parts' commands; its ``MixedResult`` answers each part as if its command had run alone."""

    decode: Decode
    prefill: Prefill


Command = Admit | Prefill | CollectReady | Decode | Reserve | Draft | Verify | Release | FlushCache | Mixed

# --- results -------------------------------------------------------------------------------------


@attrs.frozen
class AdmitResult:
    admitted: tuple[str, ...]  # a prefix of the candidates, in order; they own memory now
    # request id -> leading prompt tokens found in the prefix cache (their KV is shared, not computed)
    cached: dict[str, int] = attrs.Factory(dict)


@attrs.frozen
class PrefillResult:
    first_tokens: dict[str, int]  # request id -> the token sampled after its prompt (its last chunk ran)
    failed: dict[str, str] = attrs.Factory(dict)  # request id -> why it cannot continue (others unaffected)
    # request id -> its first token's log-probabilities (requests that ask for them)
    logprobs: dict[str, TokenLogprob] = attrs.Factory(dict)


@attrs.frozen
class ReadyResult:
    ready: tuple[str, ...]  # left staging, own a device buffer now (FIFO order)
    waited: bool  # True: the copies in flight were waited for, so this answer holds until memory changes
    failed: dict[str, str] = attrs.Factory(dict)  # request id -> why its staging copy failed


@attrs.frozen
class RoomResult:
    runnable: tuple[str, ...]  # got the room, in order
    refused: tuple[str, ...]  # memory is short: the caller retracts them


@attrs.frozen
class StepResult:
    tokens: dict[str, tuple[int, ...]]  # request id -> new output tokens this step, in order
    refused: tuple[str, ...] = ()  # could not step (memory): the caller retracts them
    accepted: dict[str, int] = attrs.Factory(dict)  # speculative: accepted drafts per request
    failed: dict[str, str] = attrs.Factory(dict)  # request id -> why it cannot continue (others unaffected)
    # request id -> one entry per token of ``tokens`` (requests that ask for log-probabilities)
    logprobs: dict[str, tuple[TokenLogprob, ...]] = attrs.Factory(dict)


@attrs.frozen
class SwapCounts:
    """HiSparse swap-in totals of one command, summed over layers (zeros without HiSparse)."""

    hits: int  # top-k entries served from the device buffers
    misses: int  # rows loaded host -> device
    h2d_bytes: int  # bytes those loads moved


NO_SWAPS = SwapCounts(0, 0, 0)


@attrs.frozen
class MixedResult:
    """Each part of a ``Mixed`` command answered on its own: its result, its own swap-in counts,
    its own error (the chunks' finishing may fail while the decode step stands). Both carry the
    shared forward's ``seconds`` and say ``mixed`` when the forward really carried both parts."""

    decode: Outcome
    prefill: Outcome


# int: the prefix-cache pages a ``FlushCache`` evicted
Result = AdmitResult | PrefillResult | ReadyResult | RoomResult | StepResult | MixedResult | int | None


@attrs.frozen
class Outcome:
    """What one command did."""

    result: Result  # the command's answer; None for ``Release`` and when ``error`` is set
    swaps: SwapCounts = NO_SWAPS  # swap-in work this command did
    changed: bool = False  # memory or request state changed (stages waiting for memory look again)
    error: str | None = None  # the command raised outside any one request: exception type and message
    seconds: float = 0.0  # wall time of the command
    # a part of a ``Mixed`` command whose forward carried both parts: ``seconds`` is the shared
    # forward's
    mixed: bool = False
    # dynamic residency: (request id, ``Demoted`` / ``Promoted``) of the layout changes since the last
    # decode command's outcome, in order, for the decode part to apply (on its commands' outcomes only)
    residency: tuple[tuple[str, Demoted | Promoted], ...] = ()

    def result_as(self, kind: type[_R]) -> _R:
        """``result``, checked to be a ``kind``: the result type of the command answered (a command
        that did not fail answers with its own type, e.g. ``Decode`` with a ``StepResult``)."""
        if not isinstance(self.result, kind):
            raise TypeError(f"expected a {kind.__name__} result, got {self.result!r} (error: {self.error})")
        return self.result


# --- between stages (async engine) ----------------------------------------------------------------


@attrs.frozen
class Submit:
    """A new request for the admission queue (sent by ``Engine.generate``)."""

    request: Request  # QUEUED, registered with the engine


@attrs.frozen
class Requeue:
    """Decode -> admission: requests retracted under memory pressure (QUEUED, output kept)."""

    requests: tuple[Request, ...]  # in the order they go back to the front of the queue


@attrs.frozen
class PrefillBatch:
    """Admission -> prefill: requests just admitted (state PREFILL, memory allocated)."""

    requests: tuple[Request, ...]  # queue order


@attrs.frozen
class Staged:
    """Prefill -> staging: requests whose prompt KV is on its way to the host pool (STAGING)."""

    requests: tuple[Request, ...]


@attrs.frozen
class Ready:
    """Staging -> decode: requests that own a device buffer (READY), to join the running batch."""

    requests: tuple[Request, ...]  # FIFO order of their staging


@attrs.frozen
class Wake:
    """Look at shared state again; carries no request. At most one is outstanding per stage."""

    reason: str  # "memory", "abort" or "consumer": for the log only


StageMessage = Submit | Requeue | PrefillBatch | Staged | Ready | Wake

# --- to the caller -------------------------------------------------------------------------------


@attrs.frozen
class RequestOutput:
    """One delta of a streamed request (vLLM's DELTA convention): what is new since the last one.

    Deltas coalesce: a consumer that reads slowly gets one delta covering every step it missed.
    Concatenating the ``text`` of all deltas gives the final text; the ``token_ids`` likewise.
    """

    request_id: str
    text: str  # new text (complete UTF-8 characters; text that may still become a stop string is held back)
    token_ids: tuple[int, ...]  # new output token ids, in order
    finished: bool  # True on the last delta only
    finish_reason: str | None  # "stop" | "length" | "abort" on the last delta, else None
    metrics: RequestMetrics | None  # timings and counters, on the last delta only
    # one per entry of ``token_ids`` when the request asked (``SamplingParams.logprobs``), else None
    logprobs: tuple[TokenLogprob, ...] | None = None


@attrs.frozen
class GenerateResult:
    """The whole output of one request (``Engine.generate_text``)."""

    request_id: str
    text: str  # output text, cut before a stop string
    token_ids: tuple[int, ...]  # every output token (EOS included when it ended the request)
    finish_reason: str  # "stop" | "length" | "abort"
    metrics: RequestMetrics  # queue time, TTFT, ITL, e2e latency, retractions, speculative counters
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per output token when asked, else None
