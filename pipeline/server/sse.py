"""Server-sent events in OpenAI's chunk format.

A streamed completion is a sequence of ``data: {chunk}`` events, one per engine delta, each choice's
last carrying its ``finish_reason``. With ``n`` > 1 the choices' chunks interleave, each tagged with
its ``index``; a chunk carries the logprobs of its tokens when the request asked for them. With
``stream_options.include_usage`` one more chunk with no choices carries the usage; ``data: [DONE]``
ends the stream. An error after the stream has started (the
request failed in the engine, or the server aborted it on shutdown) is sent as
``data: {"error": {...}}`` before ``[DONE]``, which the official clients raise as an error. An
internal error says ``internal error (request id: ...)`` and nothing more: what went wrong is logged
under that id (the engine's reason in ``server.request_ended``, an unexpected error with its
traceback in ``server.internal_error``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing

from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pipeline.errors import RequestFailed
from pipeline.messages import RequestOutput
from pipeline.server.generation import ABORTED_MESSAGE, ApiError, Choices, cancel_on_disconnect
from pipeline.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from pipeline.server.middleware import internal_error_message, log_internal_error
from pipeline.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    ErrorDetail,
    ErrorResponse,
    api_finish_reason,
)

DONE = b"data: [DONE]\n\n"


def event(body: BaseModel) -> bytes:
    return b"data: " + body.model_dump_json().encode() + b"\n\n"


def error_event(exc: Exception, request_id: str) -> bytes:
    return event(ErrorResponse(error=error_detail(exc, request_id)))


def error_detail(exc: Exception, request_id: str) -> ErrorDetail:
    """OpenAI's error fields for an error that ended a request after it was accepted (``request_id``:
    the response's id). An internal error names the request and nothing else; an unexpected one is
    logged here (``server.internal_error``, with its traceback)."""
    if isinstance(exc, ApiError):
        return ErrorDetail(message=exc.message, type=exc.type, param=exc.param, code=exc.code)
    if isinstance(exc, RequestFailed):  # its reason is in the log (server.request_ended)
        return ErrorDetail(
            message=internal_error_message(exc.request_id), type="internal_error", code="request_failed"
        )
    log_internal_error(exc, request_id)
    return ErrorDetail(message=internal_error_message(request_id), type="internal_error")


def shutdown_abort() -> ApiError:
    return ApiError(ABORTED_MESSAGE, status=503, type="service_unavailable", code="aborted")


Outputs = AsyncIterator[tuple[int, RequestOutput]]  # ``Choices.outputs()``: (choice index, delta)


async def completion_events(
    outputs: Outputs,
    choices: Choices,
    model: str,
    include_usage: bool,
    *,
    echo: str | None = None,
    texts: TokenTexts | None = None,
) -> AsyncGenerator[bytes]:
    """A completion's chunks: one per delta of each choice (tagged with its ``index``); ``echo``: the
    prompt's text, first, as each choice's first chunk; ``texts``: the request asked for logprobs."""
    created = int(time.time())
    offsets = [len(echo or "")] * len(choices.gens)

    def chunk(choice: CompletionChoice | None) -> bytes:
        listed = [] if choice is None else [choice]
        usage = choices.usage if choice is None else None
        return event(
            Completion(id=choices.response_id, created=created, model=model, choices=listed, usage=usage)
        )

    try:
        if echo is not None:
            for index in range(len(choices.gens)):
                yield chunk(CompletionChoice(index=index, text=echo, finish_reason=None))
        async for index, delta in outputs:
            if delta.finished and choices.gens[index].outcome != "finished":
                raise shutdown_abort()
            logprobs = None
            if texts is not None and delta.logprobs is not None:
                logprobs, offsets[index] = completion_logprobs(delta.logprobs, texts, offsets[index])
            reason = api_finish_reason(delta.finish_reason) if delta.finished else None
            yield chunk(
                CompletionChoice(index=index, text=delta.text, logprobs=logprobs, finish_reason=reason)
            )
        if include_usage:
            yield chunk(None)
    except Exception as exc:  # after the stream began, an error can only be reported in it
        yield error_event(exc, choices.response_id)
    yield DONE


async def chat_events(
    outputs: Outputs, choices: Choices, model: str, include_usage: bool, *, texts: TokenTexts | None = None
) -> AsyncGenerator[bytes]:
    """A chat completion's chunks: each choice's role first, then one per delta of each choice
    (tagged with its ``index``); ``texts``: the request asked for logprobs."""
    created = int(time.time())

    def chunk(choice: ChatChunkChoice | None) -> bytes:
        listed = [] if choice is None else [choice]
        usage = choices.usage if choice is None else None
        return event(
            ChatCompletionChunk(
                id=choices.response_id, created=created, model=model, choices=listed, usage=usage
            )
        )

    try:
        for index in range(len(choices.gens)):
            yield chunk(ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content="")))
        async for index, delta in outputs:
            if delta.finished and choices.gens[index].outcome != "finished":
                raise shutdown_abort()
            logprobs = None
            if texts is not None and delta.logprobs is not None:
                logprobs = chat_logprobs(delta.logprobs, texts)
            reason = api_finish_reason(delta.finish_reason) if delta.finished else None
            yield chunk(
                ChatChunkChoice(
                    index=index, delta=ChatDelta(content=delta.text), logprobs=logprobs, finish_reason=reason
                )
            )
        if include_usage:
            yield chunk(None)
    except Exception as exc:  # after the stream began, an error can only be reported in it
        yield error_event(exc, choices.response_id)
    yield DONE


class EventStream(Response):
    """A ``text/event-stream`` response: ``render(outputs)``'s events over the merged deltas of
    ``choices``. It cancels them (and so aborts every choice's request in the engine) the moment the
    client disconnects, whatever the requests are doing then."""

    media_type = "text/event-stream"

    def __init__(self, choices: Choices, render: Callable[[Outputs], AsyncGenerator[bytes]]) -> None:
        self.choices = choices
        self.render_events = render
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async with (
            cancel_on_disconnect(receive, self.choices.disconnected) as watch,
            self.choices.outputs() as outputs,
            aclosing(self.render_events(outputs)) as events,
        ):
            async for data in events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
        if not watch.disconnected:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
