"""The frozen contracts of every hop in the async engine.

Three kinds of hop, one section each below:

* stage -> executor actor: a *command* (what device work to run, by request id), answered by an
  ``Outcome`` (what happened). The executor's own result values (``PrefillResult``,
  ``StepResult``) travel inside the outcome unchanged.
* stage -> stage: a batch of requests changing hands. Ownership moves with the message: from the
  moment a stage receives a request, only that stage applies events to it, until it sends it on.
  ``Wake`` carries no request: it asks a stage to look at shared state again (memory freed, an
  abort requested, a consumer caught up).
* engine -> caller: ``RequestOutput`` deltas from ``Engine.generate`` and the ``GenerateResult`` of
  ``Engine.generate_text``.

Request objects ride inside frozen messages by reference: the message is immutable, the request is
an object with identity that only its owning stage changes, and only on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from pipeline.executor import NewSequence, PrefillResult, StepResult
    from pipeline.request import Request, RequestMetrics

# --- commands to the executor actor ------------------------------------------------------------


@attrs.frozen
class CanAdmit:
    """Query (changes nothing): would prompts of these lengths fit right now?"""

    num_tokens: tuple[int, ...]  # tokens each candidate prefills, in queue order


@attrs.frozen
class Prefill:
    """Admit what fits (in order), prefill it in one forward, start staging."""

    sequences: tuple[NewSequence, ...]  # the batch, in queue order


@attrs.frozen
class CollectReady:
    """Pop the requests whose staging copy landed and whose device buffer fits (FIFO).

    When no other command is waiting, the actor first waits for the copies in flight: the device
    has nothing else to do, and the answer is then final until memory changes."""


@attrs.frozen
class Decode:
    """One plain decode step over these requests."""

    request_ids: tuple[str, ...]  # the decode batch, join order


@attrs.frozen
class Draft:
    """Chain drafting (the MTP layer) for the requests that have room for a round's D positions.

    Memory check and drafting form one command, so no other command can take the memory in between.
    Between the two, the worker calls ``on_start`` on the event loop with the ids that will be drafted
    (the stage moves them to DRAFT there); the others come back in ``StepResult.refused``, still in
    DECODE, where a retraction is legal."""

    request_ids: tuple[str, ...]  # the runnable decode batch, join order
    on_start: Callable[[tuple[str, ...]], None]  # runs on the event loop before drafting starts


@attrs.frozen
class Verify:
    """Target verify, acceptance, finalize and draft extend for these requests."""

    request_ids: tuple[str, ...]  # drafted requests not aborted meanwhile


@attrs.frozen
class Release:
    """Give back everything these requests own, in whatever state they are (idempotent)."""

    request_ids: tuple[str, ...]


Command = CanAdmit | Prefill | CollectReady | Decode | Draft | Verify | Release

# --- what the executor actor answers -----------------------------------------------------------


@attrs.frozen
class AdmitAnswer:
    fits: tuple[bool, ...]  # one per ``CanAdmit.num_tokens`` entry, judged on the same free memory
    free_rows: int  # request rows free now (each admitted request takes one)


@attrs.frozen
class ReadyAnswer:
    ready: tuple[str, ...]  # left staging, own a device buffer now (FIFO order)
    staging: tuple[str, ...]  # still staging after this call
    waited: bool  # True: copies in flight were waited for, so whoever is still staging waits for memory


@attrs.frozen
class StepFigures:
    """HiSparse swap-in totals of one command, summed over layers (zeros without HiSparse)."""

    hits: int  # top-k entries served from the device buffers
    misses: int  # rows loaded host -> device
    h2d_bytes: int  # bytes those loads moved


if TYPE_CHECKING:
    Result = AdmitAnswer | ReadyAnswer | PrefillResult | StepResult | None


@attrs.frozen
class Outcome:
    """What one command did."""

    result: Result  # the command's answer; None for ``Release`` and when ``error`` is set
    figures: StepFigures  # swap-in work this command did
    changed: bool  # memory or request state changed (waiting stages should look again)
    error: str | None = None  # the command raised: exception type and message; nothing is known about its effect
    seconds: float = 0.0  # wall time of the command in the worker thread


# --- between stages ------------------------------------------------------------------------------


@attrs.frozen
class Submit:
    """A new request for the admission queue (sent by ``Engine.generate``)."""

    request: Request  # QUEUED, registered with the engine


@attrs.frozen
class PrefillBatch:
    """Admission -> prefill: requests just admitted (state PREFILL)."""

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
    """Look at shared state again; carries no request. Dropped when the inbox is full (the stage then
    has other messages to read and looks again after each of them)."""

    reason: str  # "memory", "abort", "consumer" or "prefill-done": for the log only


StageMessage = Submit | PrefillBatch | Staged | Ready | Wake

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


@attrs.frozen
class GenerateResult:
    """The whole output of one request (``Engine.generate_text``)."""

    request_id: str
    text: str  # output text, cut before a stop string
    token_ids: tuple[int, ...]  # every output token (EOS included when it ended the request)
    finish_reason: str  # "stop" | "length" | "abort"
    metrics: RequestMetrics  # queue time, TTFT, ITL, e2e latency, retractions, speculative counters
