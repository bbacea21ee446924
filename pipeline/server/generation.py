"""One HTTP request's run through the engine: its sampling parameters, its deltas, its end.

``Generation`` wraps ``engine.generate``: it keeps the request in the server's in-flight table while
it runs, feeds the metrics, and logs one ``server.request_ended`` line with the request's outcome:

* ``finished``: it ended with ``stop`` or ``length``;
* ``disconnected``: its client went away first; the request was aborted in the engine at once;
* ``aborted``: the server aborted it (shutdown with ``--on-exit abort``), or another choice of the
  same API request failed;
* ``failed``: it failed inside the engine (the others go on).

``Choices`` holds the ``n`` generations of one API request (one engine request per choice, all on
the same prompt) and merges their deltas, tagged with the choice's index, as they come.

Sampling fields a request leaves unset take the checkpoint's defaults (its generation_config.json,
``engine.generation_defaults``), then OpenAI's.

``cancel_on_disconnect`` watches the ASGI ``receive`` channel for ``http.disconnect`` while a
response is being produced, streaming or not, and cancels the work when it comes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing, asynccontextmanager, suppress
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import attrs
import structlog

from pipeline.errors import EngineClosed, RequestError, RequestFailed
from pipeline.sampling import SamplingParams
from pipeline.server.protocol import CompletionRequest, PromptTokensDetails, Usage, _Generation

if TYPE_CHECKING:
    from pipeline.engine import RequestStream
    from pipeline.messages import RequestOutput

log = structlog.get_logger("hispec.server")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
FINISHED_REASONS = ("stop", "length")
ABORTED_MESSAGE = "the request was aborted: the server is shutting down"
# engine field -> request field, where they differ
FIELD_NAMES = {"max_new_tokens": "max_tokens"}
# request field -> its value when neither the request nor the checkpoint (``engine.generation_defaults``,
# the same key) sets it: OpenAI's, or the neutral one
FALLBACK = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}


class ApiError(Exception):
    """An error answered with OpenAI's error body; ``param`` names the request field at fault."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code


def sampling_params(
    body: _Generation,
    num_prompt_tokens: int,
    max_context_len: int,
    *,
    prompt_field: str,
    defaults: Mapping[str, Any] | None = None,
) -> SamplingParams:
    """The engine's ``SamplingParams`` for ``body``; ``ApiError`` naming the field if it cannot be served.

    A field the request leaves unset takes ``defaults`` (the checkpoint's generation defaults), then
    OpenAI's value; ``max_tokens`` unset: the checkpoint's ``max_new_tokens``, else 16 for
    completions and the rest of the context for chat, capped at the room the prompt leaves."""
    defaults = defaults or {}
    room = max_context_len - num_prompt_tokens
    if room <= 0:
        raise ApiError(
            f"{prompt_field}: the prompt is {num_prompt_tokens} tokens; the context is {max_context_len} "
            "tokens (prompt plus output), which leaves no room for output",
            param=prompt_field,
            code="context_length_exceeded",
        )
    max_field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if max_tokens is None:
        default = defaults.get("max_new_tokens")
        if default is None:
            default = COMPLETION_DEFAULT_MAX_TOKENS if isinstance(body, CompletionRequest) else room
        max_tokens = min(int(default), room)
    elif max_tokens > room:
        raise ApiError(
            f"{max_field}={max_tokens}: the prompt is {num_prompt_tokens} tokens and the context "
            f"{max_context_len} tokens, so at most {room} output tokens fit",
            param=max_field,
            code="context_length_exceeded",
        )
    if body.min_tokens > max_tokens:
        raise ApiError(
            f"min_tokens={body.min_tokens}: more than the {max_tokens} output tokens the request may "
            f"have ({max_field})",
            param="min_tokens",
        )
    chosen = {
        field: value if (value := getattr(body, field)) is not None else defaults.get(field, fallback)
        for field, fallback in FALLBACK.items()
    }
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=float(chosen["temperature"]),
        top_p=float(chosen["top_p"]),
        top_k=max(int(chosen["top_k"]), 0),  # -1 and 0: no limit
        stop=body.stop_strings(),
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=float(chosen["repetition_penalty"]),
        logit_bias=body.token_biases(),
        min_tokens=body.min_tokens,
        logprobs=body.logprobs_asked(),
    )


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: with a seed, choice i samples with ``seed + i`` (so it equals a
    request of its own with that seed); without, each derives its own from its request id."""
    if params.seed is None or index == 0:
        return params
    return attrs.evolve(params, seed=params.seed + index)


def usage(num_prompt_tokens: int, num_output_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_output_tokens,
        total_tokens=num_prompt_tokens + num_output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class ServerState(Protocol):
    """What a generation uses of the app's shared state (``pipeline.server.app.ServerState``)."""

    engine: Any
    metrics: Any  # ServerMetrics
    aborting: bool
    in_flight: dict[str, Generation]


@attrs.define(eq=False)
class Generation:
    """One request in the engine, as the server runs it; build with ``Generation.start``."""

    state: ServerState
    request_id: str
    prompt_ids: list[int]
    prompt_field: str  # "prompt" or "messages": the field an error about the prompt names
    _stream: RequestStream
    outcome: str = "pending"  # -> finished | disconnected | aborted | failed
    finish_reason: str | None = None
    num_output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (0 until the engine reports them)
    started: float = attrs.field(factory=time.monotonic)

    @classmethod
    def start(
        cls,
        state: ServerState,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt_field: str,
    ) -> Generation:
        """Hand the request to the engine; ``ApiError`` (400, or 503 while the engine is down) if refused."""
        try:
            stream = state.engine.generate(prompt_ids, params, request_id=request_id)
        except RequestError as exc:
            field = FIELD_NAMES.get(exc.field, prompt_field if exc.field == "prompt" else exc.field)
            raise ApiError(f"{field}: {exc.rule}", param=field) from exc
        except EngineClosed as exc:
            raise ApiError("the engine is not running", status=503, type="service_unavailable") from exc
        return cls(state, request_id, prompt_ids, prompt_field, stream)

    @property
    def usage(self) -> Usage:
        return usage(len(self.prompt_ids), self.num_output_tokens, self.cached_tokens)

    def disconnected(self) -> None:
        """The client went away: abort the request in the engine now (its memory is released)."""
        if self.outcome != "pending":
            return
        self.outcome = "disconnected"
        self.state.metrics.disconnects.inc()
        self.state.engine.abort(self.request_id)

    async def deltas(self) -> AsyncGenerator[RequestOutput]:
        """The engine's deltas for this request. Raises ``ApiError`` (503) if the engine refuses the
        submission, and ``RequestFailed`` if the request fails."""
        metrics = self.state.metrics
        if self.state.aborting:  # accepted, then the server began an aborting drain before it started
            self.outcome = "aborted"
            self._log_end()
            raise ApiError(ABORTED_MESSAGE, status=503, type="service_unavailable", code="aborted")
        self.state.in_flight[self.request_id] = self
        last_tokens_at: float | None = None
        try:
            async with aclosing(self._stream) as stream:
                async for delta in stream:
                    if not (delta.token_ids or delta.text or delta.finished):
                        continue
                    if delta.token_ids:
                        now = time.monotonic()
                        if last_tokens_at is not None:
                            metrics.observe_delta(now - last_tokens_at, len(delta.token_ids))
                        last_tokens_at = now
                        self.num_output_tokens += len(delta.token_ids)
                    if delta.finished:
                        self._finish(delta)
                    yield delta
        except EngineClosed as exc:
            self.outcome = "aborted"
            raise ApiError("the server is shutting down", status=503, type="service_unavailable") from exc
        except RequestFailed as exc:
            self.outcome = "failed"
            self.finish_reason = exc.reason
            raise
        except Exception as exc:  # the engine itself failed (every live request ends)
            self.outcome = "failed"
            self.finish_reason = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.state.in_flight.pop(self.request_id, None)
            if self.outcome == "pending":  # closed before its end: the client went away
                self.outcome = "disconnected"
            self._log_end()

    def _finish(self, delta: RequestOutput) -> None:
        self.finish_reason = delta.finish_reason
        if delta.finish_reason in FINISHED_REASONS:
            self.outcome = "finished"
            if delta.metrics is not None:
                self.state.metrics.observe_finished(delta.metrics)
                # after a retraction the latest prefill also covered output tokens: count the prompt's
                self.cached_tokens = min(delta.metrics.cached_tokens, len(self.prompt_ids))
        elif self.outcome == "pending":
            self.outcome = "aborted"

    def _log_end(self) -> None:
        log.info(
            "server.request_ended",
            request_id=self.request_id,
            outcome=self.outcome,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            output_tokens=self.num_output_tokens,
            seconds=round(time.monotonic() - self.started, 6),
        )


@attrs.define(eq=False)
class Choices:
    """The ``n`` generations of one API request (one engine request per choice, the same prompt)."""

    response_id: str
    prompt_ids: list[int]
    gens: list[Generation]

    @classmethod
    def start(
        cls,
        state: ServerState,
        response_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt_field: str,
        n: int,
    ) -> Choices:
        """Hand the ``n`` requests to the engine (``ApiError`` if refused); a single choice's request
        id is ``response_id``, choice i's of several ``{response_id}-{i}``."""
        gens = [
            Generation.start(
                state,
                response_id if n == 1 else f"{response_id}-{i}",
                prompt_ids,
                choice_params(params, i),
                prompt_field,
            )
            for i in range(n)
        ]
        return cls(response_id, prompt_ids, gens)

    @property
    def usage(self) -> Usage:
        """The prompt counted once, the output tokens of every choice; ``cached_tokens``: the prompt
        tokens every choice found in the prefix cache (the fewest any one found)."""
        return usage(
            len(self.prompt_ids),
            sum(g.num_output_tokens for g in self.gens),
            min(g.cached_tokens for g in self.gens),
        )

    @property
    def finished(self) -> bool:
        return all(g.outcome == "finished" for g in self.gens)

    def disconnected(self) -> None:
        """The client went away: abort every choice's request."""
        for gen in self.gens:
            gen.disconnected()

    async def _share_prompt(self) -> None:
        """Several choices of one prompt compute it once: a short request of the prompt runs to its
        end first, which leaves the prompt's full pages to the prefix cache, and every choice then
        shares them instead of computing the prompt again (SGLang runs ``n`` the same way). It
        decodes one step: a request that ends at its prefill leaves nothing to the cache under
        HiSparse. Pages enter the cache only when a request ends, so choices submitted together
        would each compute the whole prompt. If it fails, the choices compute the prompt themselves."""
        engine = self.gens[0].state.engine
        config = engine.config
        if not config.prefix_cache or len(self.prompt_ids) <= config.page_size:
            return  # nothing the cache could share
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        try:
            await engine.generate_text(self.prompt_ids, params, request_id=f"{self.response_id}-prompt")
        except (RequestFailed, RequestError) as exc:
            log.warning("server.prompt_not_shared", request_id=self.response_id, error=str(exc))

    @asynccontextmanager
    async def outputs(self) -> AsyncIterator[AsyncIterator[tuple[int, RequestOutput]]]:
        """Every choice's deltas as ``(index, delta)``, in the order they come. Reading raises the
        first error any choice raises (``Generation.deltas``); leaving the block before every choice
        ended (that error, a disconnect) aborts the others."""
        if len(self.gens) > 1:
            await self._share_prompt()
        send, receive = anyio.create_memory_object_stream[tuple[int, Any, BaseException | None]]()
        try:
            async with anyio.create_task_group() as tg:
                with send:
                    for index, gen in enumerate(self.gens):
                        tg.start_soon(_pump, index, gen, send.clone(), name=f"hispec-{gen.request_id}")
                try:
                    async with aclosing(_merged(receive)) as merged:
                        yield merged
                finally:
                    for gen in self.gens:
                        if gen.outcome == "pending":  # the block ended early: it goes too
                            gen.outcome = "aborted"
                    tg.cancel_scope.cancel()
                    receive.close()
        except BaseExceptionGroup as group:  # the block's own error, wrapped by the task group
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise


async def _pump(index: int, gen: Generation, send: Any) -> None:
    """One choice's deltas into the shared stream; its error too, as the last item."""
    with send:
        try:
            async with aclosing(gen.deltas()) as deltas:
                async for delta in deltas:
                    await send.send((index, delta, None))
        except Exception as exc:
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):  # the reader has left
                await send.send((index, None, exc))


async def _merged(receive: Any) -> AsyncGenerator[tuple[int, RequestOutput]]:
    async for index, delta, error in receive:
        if error is not None:
            raise error
        yield index, delta


class Watch:
    """Whether the client disconnected while the watched block ran."""

    disconnected = False


@asynccontextmanager
async def cancel_on_disconnect(
    receive: Callable[[], Any], on_disconnect: Callable[[], None]
) -> AsyncIterator[Watch]:
    """Run the block; if the client disconnects first, call ``on_disconnect()`` and cancel the block.

    The request body must have been read already: ``receive`` then only ever answers
    ``http.disconnect`` (the client closed the connection, or the response is complete)."""
    watch = Watch()
    try:
        async with anyio.create_task_group() as tg:

            async def wait_for_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                watch.disconnected = True
                on_disconnect()
                tg.cancel_scope.cancel()

            tg.start_soon(wait_for_disconnect)
            try:
                yield watch
            finally:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # the block's own error, wrapped by the task group
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
