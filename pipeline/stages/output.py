"""The caller's side of a request: undelivered output, coalesced into one delta per read.

Backpressure choice. Stages never wait for a consumer: after changing a request they call
``notify()``, which only sets an event. The request itself (its ``output_ids`` and text) is the
accumulation of everything produced, so the buffer keeps no queue of deltas: a reader takes
whatever is new since its previous read as one delta. A slow consumer therefore costs no memory
beyond the request's own output and never blocks the decode stage or other requests.

``generate_text`` reads once, at the end: its buffer is woken only when the request ends.

Optionally (``Engine(max_undelivered_tokens=N)``) a streamed request whose consumer is N tokens behind is
*parked*: it keeps its memory and stays in its batch but is not stepped until the consumer catches
up. That is backpressure on that request alone.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import attrs

from pipeline.errors import RequestFailed
from pipeline.messages import RequestOutput
from pipeline.request import Request
from statemachines.request import State


@attrs.define(eq=False)
class OutputBuffer:
    """What one consumer has received of ``request``, and the event that wakes it."""

    request: Request
    on_read: Callable[[], None] = lambda: None  # called after each read (wakes a parked request's stage)
    # the reader wants the whole output at the end only (generate_text): woken once, never parked
    whole: bool = False
    sent_tokens: int = 0  # output tokens already delivered
    sent_text: str = ""  # text already delivered (a prefix of the final text)
    final_sent: bool = False
    _event: anyio.Event = attrs.field(factory=anyio.Event)

    @property
    def undelivered(self) -> int:
        return len(self.request.output_ids) - self.sent_tokens

    def notify(self) -> None:
        """The request changed (new tokens or an end); never blocks."""
        if not self.whole or self.request.is_finished:
            self._event.set()

    def has_news(self) -> bool:
        ended = self.request.is_finished and not self.final_sent
        return ended if self.whole else ended or self.undelivered > 0

    async def next(self) -> RequestOutput:
        """The next coalesced delta; raises ``RequestFailed`` if the request failed."""
        while not self.has_news():
            self._event = anyio.Event()  # re-armed before waiting; notify() cannot slip in between
            await self._event.wait()
        return self.take()

    def take(self) -> RequestOutput:
        req = self.request
        if req.state is State.FAILED:
            self.final_sent = True
            why = req.error or req.finish_reason or "error"
            raise RequestFailed(req.request_id, why, tuple(req.output_ids))
        finished = req.is_finished
        visible = req.text if finished else self._settled_text()
        text = visible[len(self.sent_text) :] if visible.startswith(self.sent_text) else ""
        if len(visible) > len(self.sent_text):
            self.sent_text = visible
        tokens = tuple(req.output_ids[self.sent_tokens :])
        logprobs = None if req.output_logprobs is None else tuple(req.output_logprobs[self.sent_tokens :])
        self.sent_tokens = len(req.output_ids)
        self.final_sent = finished
        self.on_read()
        return RequestOutput(
            request_id=req.request_id,
            text=text,
            token_ids=tokens,
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            metrics=req.metrics if finished else None,
            logprobs=logprobs,
        )

    def _settled_text(self) -> str:
        """Text that can no longer change: the request's settled text (its incremental
        detokenizer's), minus a tail that could still grow into a stop string (that tail is cut if
        the stop string completes)."""
        text = self.request.text
        stop = self.request.params.stop
        hold = max((len(s) for s in stop), default=1) - 1
        return text[: len(text) - hold] if hold > 0 else text
