"""The OpenAI-compatible HTTP app over a running ``Engine``: ``create_app(engine)``.

::

    POST /v1/completions        text or token-id prompt -> completion (stream: server-sent events)
    POST /v1/chat/completions   messages -> chat template -> completion (stream: server-sent events)
    GET  /v1/models             the one model served
    GET  /health                200 when serving; 503 while the engine starts or the server drains
    GET  /metrics               Prometheus text format

The app runs on the engine's event loop (every endpoint is ``async``): it calls the engine directly,
nothing crosses a thread. Errors use OpenAI's body ``{"error": {"message", "type", "param",
"code"}}``: 400 for a request that cannot be served as sent (``param`` names the field), 500 for a
request that failed inside the engine (that request alone), 503 while not serving.
"""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any

import attrs
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from pipeline.errors import EngineClosed, RequestFailed
from pipeline.server.chat import render_chat
from pipeline.server.generation import ApiError, Generation, cancel_on_disconnect, sampling_params
from pipeline.server.metrics import ServerMetrics
from pipeline.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    _Generation,
)
from pipeline.server.sse import EventStream, chat_events, completion_events, error_detail, shutdown_abort
from pipeline.server.validation import describe_validation_error


@attrs.define(eq=False)
class ServerState:
    """What the endpoints share: the engine, the served name, the metrics, the requests in flight."""

    engine: Any
    model_name: str
    metrics: ServerMetrics
    created: int = attrs.field(factory=lambda: int(time.time()))
    draining: bool = False  # set once by ``drain``: new requests get 503
    aborting: bool = False  # drained with abort: a request accepted just before does not start either
    in_flight: dict[str, Generation] = attrs.field(factory=dict)

    @property
    def phase(self) -> str:
        """``starting`` (engine not entered yet), ``ready``, or ``draining``."""
        if self.draining:
            return "draining"
        try:
            self.engine.tokenizer  # noqa: B018 -- the cheapest public call that fails unless the engine runs
        except EngineClosed:
            return "starting"
        return "ready"

    def drain(self, *, abort: bool) -> None:
        """Stop taking requests; with ``abort``, abort every request in flight (their clients get an
        error: a 503 body, or an error event in their stream)."""
        self.draining = True
        self.aborting = abort
        if abort:
            self.abort_in_flight()

    def abort_in_flight(self) -> int:
        ids = list(self.in_flight)
        for request_id in ids:
            self.engine.abort(request_id)
        return len(ids)

    def check(self, body: _Generation) -> None:
        """``ApiError`` unless the server is ready and serves ``body.model``."""
        phase = self.phase
        if phase != "ready":
            raise ApiError(f"the server is {phase}", status=503, type="service_unavailable", code=phase)
        if body.model != self.model_name:
            raise ApiError(
                f"model: {body.model!r} is not served here (this server serves {self.model_name!r})",
                param="model",
                code="model_not_found",
            )

    def begin(
        self, body: _Generation, prompt_ids: list[int], *, prompt_field: str, prefix: str
    ) -> Generation:
        """Submit one checked request (``ApiError`` if it cannot be served)."""
        context = self.engine.config.max_context_len
        params = sampling_params(body, len(prompt_ids), context, prompt_field=prompt_field)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        gen = Generation.start(self, request_id, prompt_ids, params, prompt_field)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return gen


def _state(request: Request) -> ServerState:
    return request.app.state.hispec


async def _collect(gen: Generation, request: Request) -> str | None:
    """Run a non-streamed request to its end; its text, or None if the client went away first."""
    parts: list[str] = []
    try:
        async with (
            cancel_on_disconnect(request.receive, gen.disconnected) as watch,
            aclosing(gen.deltas()) as deltas,
        ):
            async for delta in deltas:
                parts.append(delta.text)
    except RequestFailed as exc:
        raise ApiError(
            error_detail(exc).message, status=500, type="internal_error", code="request_failed"
        ) from exc
    if watch.disconnected:
        return None
    if gen.outcome != "finished":
        raise shutdown_abort()
    return "".join(parts)


GONE = 499  # nginx's "client closed request": logged, never read by anyone
router = APIRouter()


@router.post("/v1/completions", response_model=Completion, responses={400: {"model": ErrorResponse}})
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    state.check(body)
    prompt = body.prompt
    prompt_ids = list(prompt) if isinstance(prompt, list) else state.engine.tokenizer.encode(prompt)
    gen = state.begin(body, prompt_ids, prompt_field="prompt", prefix="cmpl")
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    if body.stream:
        return EventStream(completion_events(gen, state.model_name, include_usage), gen.disconnected)
    text = await _collect(gen, request)
    if text is None:
        return Response(status_code=GONE)
    choice = CompletionChoice(text=text, finish_reason=gen.finish_reason)
    return _json(Completion(id=gen.request_id, model=state.model_name, choices=[choice], usage=gen.usage))


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses={400: {"model": ErrorResponse}})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    state.check(body)
    try:
        prompt_ids = render_chat(state.engine, body.messages)
    except Exception as exc:  # a chat template that cannot render this conversation
        raise ApiError(f"messages: the chat template failed: {exc}", param="messages") from exc
    gen = state.begin(body, prompt_ids, prompt_field="messages", prefix="chatcmpl")
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    if body.stream:
        return EventStream(chat_events(gen, state.model_name, include_usage), gen.disconnected)
    text = await _collect(gen, request)
    if text is None:
        return Response(status_code=GONE)
    choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=gen.finish_reason)
    return _json(ChatCompletion(id=gen.request_id, model=state.model_name, choices=[choice], usage=gen.usage))


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> Response:
    state = _state(request)
    card = ModelCard(
        id=state.model_name, created=state.created, max_model_len=state.engine.config.max_context_len
    )
    return _json(ModelList(data=[card]))


@router.get("/health")
async def health(request: Request) -> Response:
    phase = _state(request).phase
    return JSONResponse({"status": phase}, status_code=200 if phase == "ready" else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _json(body: Any, status: int = 200) -> Response:
    return Response(body.model_dump_json(), status_code=status, media_type="application/json")


def _error(detail: ErrorDetail, status: int) -> Response:
    return _json(ErrorResponse(error=detail), status)


async def _api_error(request: Request, exc: ApiError) -> Response:
    return _error(ErrorDetail(message=exc.message, type=exc.type, param=exc.param, code=exc.code), exc.status)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    message, param = describe_validation_error(exc.errors())
    return _error(ErrorDetail(message=message, type="invalid_request_error", param=param), 400)


async def _internal_error(request: Request, exc: Exception) -> Response:
    detail = error_detail(exc)
    return _error(ErrorDetail(message=detail.message, type="internal_error"), 500)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error(
        ErrorDetail(message=f"{request.method} {request.url.path}: {exc.detail}", type=kind), exc.status_code
    )


def create_app(engine: Any, *, served_model_name: str | None = None) -> FastAPI:
    """The app serving ``engine`` (entered already, or entered later: ``/health`` says 503 until then).

    ``served_model_name``: the name clients pass as ``model`` (default: ``engine.config.model``).
    The app's state (``app.state.hispec``, a ``ServerState``) lets the embedding code drain it.
    """
    app = FastAPI(title="hispec", summary="OpenAI-compatible API over the hispec engine")
    app.state.hispec = ServerState(
        engine, served_model_name or str(engine.config.model), ServerMetrics(engine)
    )
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(router)
    return app
