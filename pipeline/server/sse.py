"""Server-sent events in OpenAI's chunk format.

A streamed completion is a sequence of ``data: {chunk}`` events, one per engine delta, the last
carrying ``finish_reason``; with ``stream_options.include_usage`` one more chunk with no choices
carries the usage; ``data: [DONE]`` ends the stream. An error after the stream has started (the
request failed in the engine, or the server aborted it on shutdown) is sent as
``data: {"error": {...}}`` before ``[DONE]``, which the official clients raise as an error.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pipeline.errors import RequestFailed
from pipeline.server.generation import ABORTED_MESSAGE, ApiError, Generation, cancel_on_disconnect
from pipeline.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    ErrorDetail,
    ErrorResponse,
)

DONE = b"data: [DONE]\n\n"


def event(body: BaseModel) -> bytes:
    return b"data: " + body.model_dump_json().encode() + b"\n\n"


def error_event(exc: Exception) -> bytes:
    return event(ErrorResponse(error=error_detail(exc)))


def error_detail(exc: Exception) -> ErrorDetail:
    """OpenAI's error fields for an error that ended a request after it was accepted."""
    if isinstance(exc, ApiError):
        return ErrorDetail(message=exc.message, type=exc.type, param=exc.param, code=exc.code)
    if isinstance(exc, RequestFailed):
        return ErrorDetail(
            message=f"the request failed inside the engine: {exc.reason}",
            type="internal_error",
            code="request_failed",
        )
    return ErrorDetail(message=f"internal error: {type(exc).__name__}: {exc}", type="internal_error")


def shutdown_abort() -> ApiError:
    return ApiError(ABORTED_MESSAGE, status=503, type="service_unavailable", code="aborted")


async def completion_events(gen: Generation, model: str, include_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    try:
        async with aclosing(gen.deltas()) as deltas:
            async for delta in deltas:
                if delta.finished and gen.outcome != "finished":
                    raise shutdown_abort()
                reason = delta.finish_reason if delta.finished else None
                choice = CompletionChoice(text=delta.text, finish_reason=reason)
                yield event(Completion(id=gen.request_id, created=created, model=model, choices=[choice]))
        if include_usage:
            yield event(
                Completion(id=gen.request_id, created=created, model=model, choices=[], usage=gen.usage)
            )
    except Exception as exc:  # after the stream began, an error can only be reported in it
        yield error_event(exc)
    yield DONE


async def chat_events(gen: Generation, model: str, include_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(delta: ChatDelta, finish_reason: str | None = None) -> bytes:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return event(ChatCompletionChunk(id=gen.request_id, created=created, model=model, choices=[choice]))

    try:
        yield chunk(ChatDelta(role="assistant", content=""))
        async with aclosing(gen.deltas()) as deltas:
            async for delta in deltas:
                if delta.finished and gen.outcome != "finished":
                    raise shutdown_abort()
                yield chunk(ChatDelta(content=delta.text), delta.finish_reason if delta.finished else None)
        if include_usage:
            yield event(
                ChatCompletionChunk(
                    id=gen.request_id, created=created, model=model, choices=[], usage=gen.usage
                )
            )
    except Exception as exc:  # after the stream began, an error can only be reported in it
        yield error_event(exc)
    yield DONE


class EventStream(Response):
    """A ``text/event-stream`` response that cancels its events (and so aborts the request in the
    engine) the moment the client disconnects, whatever the request is doing then."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None]) -> None:
        self.events = events
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async with (
            cancel_on_disconnect(receive, self.on_disconnect) as watch,
            aclosing(self.events) as events,
        ):
            async for data in events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
        if not watch.disconnected:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
