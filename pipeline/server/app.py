"""The OpenAI-compatible HTTP app over a running ``Engine``: ``create_app(engine)``.

::

    POST /v1/completions        text or token-id prompt -> completion (stream: server-sent events)
    POST /v1/chat/completions   messages -> chat template -> completion (stream: server-sent events)
    GET  /v1/models             the one model served
    GET  /v1/models/{id}        its card (404 for another id)
    POST /tokenize              a prompt, or messages through the chat template -> token ids
    POST /detokenize            token ids -> text
    GET  /health                200 when serving; 503 while the engine starts or the server drains
    GET  /metrics               Prometheus text format
    GET  /version               hispec's version

The app runs on the engine's event loop (every endpoint is ``async``): it calls the engine directly.
Only a long prompt crosses a thread: it is tokenized off the loop (``pipeline.server.prompts``),
after a length bound has refused one that cannot fit. Errors use OpenAI's body ``{"error":
{"message", "type", "param", "code"}}``: 400 for a request that cannot be served as sent (``param``
names the field), 401 without the API key (when the app has one), 404 for an unknown path or model,
413 for a body over the limit, 500 for a request that failed inside the engine, or an unexpected
error (that request alone; the body names its id, the log has the rest), 503 while not serving.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, cast

import attrs
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from pipeline.errors import EngineClosed, RequestFailed
from pipeline.server import prompts
from pipeline.server.generation import (
    ApiError,
    Choices,
    Generation,
    cancel_on_disconnect,
    sampling_params,
)
from pipeline.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from pipeline.server.metrics import ServerMetrics
from pipeline.server.middleware import (
    AccessLog,
    ApiKeyCheck,
    BodyLimit,
    InternalErrors,
    internal_error_message,
    log_internal_error,
)
from pipeline.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    _Generation,
    api_finish_reason,
    ended_finish_reason,
)
from pipeline.server.sse import EventStream, chat_events, completion_events, error_detail, shutdown_abort
from pipeline.server.validation import describe_validation_error

if TYPE_CHECKING:
    from pipeline.messages import RequestOutput, TokenLogprob


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
    _token_texts: TokenTexts | None = None

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

    def require_ready(self) -> None:
        """``ApiError`` (503) unless the server is ready."""
        phase = self.phase
        if phase != "ready":
            raise ApiError(f"the server is {phase}", status=503, type="service_unavailable", code=phase)

    def check(self, body: _Generation | TokenizeRequest | DetokenizeRequest) -> None:
        """``ApiError`` unless the server is ready and serves ``body.model`` (optional where None)."""
        self.require_ready()
        if body.model is not None and body.model != self.model_name:
            raise ApiError(
                f"model: {body.model!r} is not served here (this server serves {self.model_name!r})",
                param="model",
                code="model_not_found",
            )

    def card(self) -> ModelCard:
        return ModelCard(
            id=self.model_name, created=self.created, max_model_len=self.engine.plan.max_context_len
        )

    def token_texts(self) -> TokenTexts:
        """Each token id's text, decoded once (built on first use: the engine's tokenizer)."""
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.engine.tokenizer.decode)
        return self._token_texts

    async def encode(self, prompt: str | list[int], *, room: int = 1) -> list[int]:
        """A completion prompt's token ids (``ApiError`` naming ``prompt`` for text that cannot be
        encoded, or that certainly leaves less than ``room`` tokens of the context)."""
        context = self.engine.plan.max_context_len
        return await prompts.encode_text(self.engine.tokenizer, prompt, context, room=room)

    async def render(
        self, messages: list[ChatMessage], *, add_generation_prompt: bool = True, room: int = 1
    ) -> list[int]:
        """A conversation's prompt token ids (``ApiError`` naming ``messages``)."""
        context = self.engine.plan.max_context_len
        try:
            return await prompts.encode_chat(
                self.engine, messages, context, room=room, add_generation_prompt=add_generation_prompt
            )
        except ApiError:
            raise
        except Exception as exc:  # a chat template that cannot render this conversation
            raise ApiError(f"messages: the chat template failed: {exc}", param="messages") from exc

    def begin(self, body: _Generation, prompt_ids: list[int], *, prompt_field: str, prefix: str) -> Choices:
        """Submit one checked request's ``n`` choices (``ApiError`` if it cannot be served)."""
        context = self.engine.plan.max_context_len
        params = sampling_params(
            body,
            len(prompt_ids),
            context,
            prompt_field=prompt_field,
            defaults=self.engine.generation_defaults,
        )
        choices = Choices.start(
            self, f"{prefix}-{uuid.uuid4().hex}", prompt_ids, params, prompt_field, body.n
        )
        self.metrics.prompt_tokens.inc(len(prompt_ids) * body.n)
        return choices


def _state(request: Request) -> ServerState:
    return request.app.state.hispec


@attrs.define
class Collected:
    """One choice of a non-streamed response, as its deltas come."""

    text: list[str] = attrs.Factory(list)
    logprobs: list[TokenLogprob] = attrs.Factory(list)

    def add(self, delta: RequestOutput) -> None:
        self.text.append(delta.text)
        if delta.logprobs is not None:
            self.logprobs.extend(delta.logprobs)


async def _collect(choices: Choices, request: Request) -> list[Collected] | None:
    """Run a non-streamed request's choices to their end; None if the client went away first."""
    collected = [Collected() for _ in choices.gens]
    try:
        async with (
            cancel_on_disconnect(request.receive, choices.disconnected) as watch,
            choices.outputs() as outputs,
        ):
            async for index, delta in outputs:
                collected[index].add(delta)
    except RequestFailed as exc:  # its reason is in the log (server.request_ended)
        detail = error_detail(exc, choices.response_id)
        raise ApiError(detail.message, status=500, type=detail.type, code=detail.code) from exc
    if watch.disconnected:
        return None
    if not choices.finished:
        raise shutdown_abort()
    return collected


GONE = 499  # nginx's "client closed request": logged, never read by anyone
router = APIRouter()


@router.post("/v1/completions", response_model=Completion, responses={400: {"model": ErrorResponse}})
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    state.check(body)
    # the validator unwrapped a batch of one
    prompt_ids = await state.encode(cast(str | list[int], body.prompt))
    choices = state.begin(body, prompt_ids, prompt_field="prompt", prefix="cmpl")
    echo = None
    if body.echo:
        echo = body.prompt if isinstance(body.prompt, str) else state.engine.tokenizer.decode(prompt_ids)
    texts = None if body.logprobs is None else state.token_texts()
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    if body.stream:
        return EventStream(
            choices,
            lambda outputs: completion_events(
                outputs, choices, state.model_name, include_usage, echo=echo, texts=texts
            ),
        )
    collected = await _collect(choices, request)
    if collected is None:
        return Response(status_code=GONE)
    listed = []
    for index, (gen, got) in enumerate(zip(choices.gens, collected, strict=True)):
        logprobs = None if texts is None else completion_logprobs(got.logprobs, texts, len(echo or ""))[0]
        text = (echo or "") + "".join(got.text)
        listed.append(
            CompletionChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=api_finish_reason(gen.finish_reason)
            )
        )
    return _json(
        Completion(id=choices.response_id, model=state.model_name, choices=listed, usage=choices.usage)
    )


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses={400: {"model": ErrorResponse}})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    state.check(body)
    prompt_ids = await state.render(body.messages)
    choices = state.begin(body, prompt_ids, prompt_field="messages", prefix="chatcmpl")
    texts = state.token_texts() if body.logprobs else None
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    if body.stream:
        return EventStream(
            choices,
            lambda outputs: chat_events(outputs, choices, state.model_name, include_usage, texts=texts),
        )
    collected = await _collect(choices, request)
    if collected is None:
        return Response(status_code=GONE)
    listed = [
        ChatChoice(
            index=index,
            message=AssistantMessage(content="".join(got.text)),
            logprobs=None if texts is None else chat_logprobs(got.logprobs, texts),
            finish_reason=ended_finish_reason(gen.finish_reason),
        )
        for index, (gen, got) in enumerate(zip(choices.gens, collected, strict=True))
    ]
    return _json(
        ChatCompletion(id=choices.response_id, model=state.model_name, choices=listed, usage=choices.usage)
    )


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> Response:
    return _json(ModelList(data=[_state(request).card()]))


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
async def model(model_id: str, request: Request) -> Response:
    state = _state(request)
    if model_id != state.model_name:
        raise ApiError(
            f"model: {model_id!r} does not exist (this server serves {state.model_name!r})",
            param="model",
            status=404,
            code="model_not_found",
        )
    return _json(state.card())


@router.post("/tokenize", response_model=TokenizeResponse, responses={400: {"model": ErrorResponse}})
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    """vLLM's: the token ids of a ``prompt`` (as /v1/completions encodes it), or of ``messages`` (as
    /v1/chat/completions renders them)."""
    state = _state(request)
    state.check(body)
    if body.messages is not None:  # room=0: refused only if it cannot fit the context at all
        tokens = await state.render(body.messages, add_generation_prompt=body.add_generation_prompt, room=0)
    elif body.prompt is not None:
        tokens = await state.encode(body.prompt, room=0)
    else:
        raise ApiError("prompt: give a prompt or messages", param="prompt")
    context = state.engine.plan.max_context_len
    return _json(TokenizeResponse(count=len(tokens), max_model_len=context, tokens=tokens))


@router.post("/detokenize", response_model=DetokenizeResponse, responses={400: {"model": ErrorResponse}})
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    state = _state(request)
    state.check(body)
    vocab = state.engine.tokenizer.vocab_size
    bad = [t for t in body.tokens if t >= vocab][:8]
    if bad:
        raise ApiError(f"tokens: ids must be in [0, {vocab}) (got {bad})", param="tokens")
    return _json(DetokenizeResponse(prompt=await prompts.decode_tokens(state.engine.tokenizer, body.tokens)))


@router.get("/health")
async def health(request: Request) -> Response:
    """The phase; with data-parallel replicas, each one's status too (503 once none serves)."""
    state = _state(request)
    phase = state.phase
    body: dict[str, Any] = {"status": phase}
    replica_status = getattr(state.engine, "replica_status", None)  # a ReplicatedEngine
    serving = phase == "ready"
    if replica_status is not None and phase == "ready":
        body["replicas"] = replica_status()
        serving = "serving" in body["replicas"].values()
    return JSONResponse(body, status_code=200 if serving else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    refresh = getattr(state.engine, "refresh_stats", None)  # a ReplicatedEngine: figures from its replicas
    if refresh is not None and state.phase != "starting":
        await refresh()
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/version", response_model=VersionResponse)
async def version() -> Response:
    from pipeline.cli import version

    return _json(VersionResponse(version=version()))


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
    """An error no middleware caught (``InternalErrors`` catches the endpoints' own)."""
    request_id = f"req-{uuid.uuid4().hex}"
    log_internal_error(exc, request_id, method=request.method, path=request.url.path)
    return _error(ErrorDetail(message=internal_error_message(request_id), type="internal_error"), 500)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error(
        ErrorDetail(message=f"{request.method} {request.url.path}: {exc.detail}", type=kind), exc.status_code
    )


DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


def create_app(
    engine: Any,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    access_log: bool = True,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The app serving ``engine`` (entered already, or entered later: ``/health`` says 503 until then).

    ``served_model_name``: the name clients pass as ``model`` (default: ``engine.config.model``).
    ``api_key``: every ``/v1`` route, ``/tokenize`` and ``/detokenize`` then need the header
    ``Authorization: Bearer <api_key>`` (401 otherwise). ``access_log``: one ``server.access`` log
    line (info) per request. ``max_request_bytes``: a larger request body is a 413 (None: no limit).
    The app's state (``app.state.hispec``, a ``ServerState``) lets the embedding code drain it.
    """
    app = FastAPI(title="hispec", summary="OpenAI-compatible API over the hispec engine")
    app.state.hispec = ServerState(
        engine, served_model_name or str(engine.config.model), ServerMetrics(engine)
    )
    # Starlette types a handler as taking any Exception; it calls each with the class it is registered for
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(router)
    app.add_middleware(InternalErrors)  # innermost: the endpoints' unexpected errors
    if max_request_bytes is not None:
        app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyCheck, api_key=api_key)  # outside the body limit: checked first
    if access_log:
        app.add_middleware(AccessLog)  # added last: outermost, so it sees the 401s and 413s too
    return app
