"""The async engine: the public API over the actor pipeline.

::

    generate() --Submit--> [admission] --PrefillBatch--> [prefill] --Staged--> [staging] --Ready--> [decode]
                               |  ^                          |                     |                   |
                               |  +---- requeue (retracted) -+---------------------+-------------------+
                               v                             v                     v                   v
                          [executor actor: the Executor, one command at a time, in a worker thread]
                                                                        deltas --> OutputBuffer --> caller

Every task lives in one task group owned by the engine (entered in ``__aenter__``, left in
``__aexit__``). Streams between stages are bounded; the feedback edges (retraction to the queue,
wake-ups after memory changes, aborts, a consumer catching up) never block: they are synchronous
calls into the upstream stage's core plus a ``Wake`` that is dropped when the inbox is full.

Shutdown: leaving the ``async with`` block aborts every request still in flight (``on_exit="abort"``,
the default) or lets them finish (``on_exit="finish"``), waits until none is live (all memory is
back), then closes the engine's send ends: admission's inbox ends, admission closes its outbound
stream, and so on down the pipeline; the executor actor ends when the last stage has closed its
handle, and the executor is closed.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Literal

import anyio
import structlog

from pipeline.config import EngineConfig, check_engine_options
from pipeline.errors import EngineClosed, EngineError, RequestError
from pipeline.logs import SUBMITTED
from pipeline.messages import FlushCache, GenerateResult, RequestOutput
from statemachines.request import AbortRequested, Crashed

if TYPE_CHECKING:
    from pipeline.executor_interface import CommandExecutor
    from pipeline.model import DeepseekV32
    from pipeline.model.tokenizer import Messages, Tokenizer
    from pipeline.request import Request
    from pipeline.sampling import SamplingParams
    from pipeline.stages.context import Registry, StageContext
    from pipeline.stages.wiring import Pipeline
    from pipeline.startup import EnginePlan

log = structlog.get_logger("hispec.engine")

# leaving the engine with on_exit="abort": how long the stages get to end what is live before the
# engine stops them and ends it itself (a step or two is enough; this bounds a stuck command)
_WIND_DOWN_S = 30.0


# a text prompt (or a conversation) of more characters than this is encoded in a worker thread, off the
# caller's event loop (a tokenizer holds the loop for as long as it encodes); a shorter one where it is given
OFF_LOOP_CHARS = 1024

_frozen_by = 0  # running engines that froze the collector (``EngineConfig.freeze_gc``)
_closed_since_collect = False  # an engine has closed since the last collection before a freeze


def _freeze_gc() -> None:
    global _frozen_by, _closed_since_collect
    if _frozen_by == 0 and _closed_since_collect:
        # what an engine that closed since left behind, or the application, may hold reference
        # cycles that only a collection frees (a prefix cache's pages, a transfer stream's thread
        # pool): frozen with the rest, it would stay for this engine's whole run, one more lot for
        # every engine started after another
        gc.collect()
        _closed_since_collect = False
    gc.freeze()  # also what became long-lived since another engine froze
    _frozen_by += 1


def _unfreeze_gc() -> None:
    global _frozen_by
    _frozen_by -= 1
    if _frozen_by == 0:
        gc.unfreeze()


def _engine_closed() -> None:
    global _closed_since_collect
    _closed_since_collect = True


def _close_taken(executors: list[CommandExecutor]) -> None:
    """Close the one executor in ``executors``, taking it out of the list first. An anyio worker
    thread holds the function it ran and its arguments until just after the caller has resumed: given
    ``executor.close`` it would keep the executor and its pools alive past the engine's exit, for as
    long as a loaded machine leaves that thread waiting for the GIL."""
    executors.pop().close()


class Engine:
    """Serves requests concurrently; use as ``async with Engine(config) as engine: ...``.

    ``model`` replaces loading ``config.model`` (tests inject a random tiny model); ``tokenizer``
    replaces the checkpoint's, ``config.tokenizer`` and ``config.chat_template`` included (with an
    injected model and none given: ``config.tokenizer``'s, else the byte-level tokenizer).
    ``generation_defaults``: the sampling defaults of the checkpoint's ``generation_config.json``,
    which a request given no ``SamplingParams`` samples with (``default_sampling_params``).
    ``max_prefill_tokens``: prompt tokens one admission turn takes in (their prefill forwards carry
    ``EngineConfig.prefill_batch_tokens`` each). ``max_undelivered_tokens``: park a
    request whose consumer is that many tokens behind (None: never; deltas coalesce instead).
    ``on_exit``: what leaving the block does to requests in flight, ``"abort"`` or ``"finish"``.
    ``trace_path``: record every top-k selection for offline cache-policy replay.
    ``prefill_pacing``: while requests decode, keep each prefill chunk to about one decode step's
    device time (``PrefillPace``; in a mixed step, ``EngineConfig.mixed_steps``, about half a decode
    step's on top of the step): the running requests' inter-token latency stays below two decode
    steps, but a long prompt takes longer to its first token and prompts arriving in numbers get
    through prefill more slowly (throughput). With nothing decoding (a request served alone) chunks
    are ``chunked_prefill_tokens``, so what a lone request computes does not depend on timing.
    False (default): chunks of ``chunked_prefill_tokens`` always, riding on the decode steps
    (``mixed_steps``), as vLLM's token budget does.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        model: DeepseekV32 | None = None,
        tokenizer: Tokenizer | None = None,
        max_prefill_tokens: int = 8192,
        max_undelivered_tokens: int | None = None,
        on_exit: Literal["abort", "finish"] = "abort",
        trace_path: str | None = None,
        queue_size: int = 64,
        prefill_pacing: bool = False,
    ) -> None:
        check_engine_options(  # ConfigError naming the argument
            config,
            prefill_pacing=prefill_pacing,
            max_prefill_tokens=max_prefill_tokens,
            max_undelivered_tokens=max_undelivered_tokens,
            on_exit=on_exit,
            trace_path=trace_path,
            queue_size=queue_size,
        )
        self.config = config
        self._model = model
        self._tokenizer = tokenizer
        self._max_prefill_tokens = max_prefill_tokens
        self._max_undelivered = max_undelivered_tokens
        self._on_exit = on_exit
        self._trace_path = trace_path
        self._queue_size = queue_size
        self._prefill_pacing = prefill_pacing
        self._ids = itertools.count()
        self.executor: CommandExecutor | None = None  # for tests and tools: never call it while it runs
        self.initial_pool_counts: dict[str, int] | None = None  # free counts before the first request
        self.final_pool_counts: dict[str, int] | None = None  # free counts after shutdown, before close
        self._running = False
        self._pipe: Pipeline | None = None  # the stages and their streams, built on entering
        self._froze_gc = False
        self._generation_defaults: dict[str, float | int] | None = None  # read at start (or when first asked)
        self._plan: EnginePlan | None = None  # what start-up derived from ``config``, once started

    # --- lifetime ---------------------------------------------------------------------------------
    #
    # ``EngineConfig.freeze_gc``: while an engine runs, the objects alive when it started (the model,
    # the modules of torch and of the application) sit in the collector's permanent generation
    # (``gc.freeze``), so that a full collection does not scan them between two decode steps; the
    # last such engine to close hands them back (``gc.unfreeze``). Freezing is a constant-time move
    # of the collector's lists. The first engine to freeze after another has closed collects first
    # (one full collection; docs/performance-notes.md has its cost): cyclic garbage left behind by
    # then would otherwise be frozen with the rest, and never freed while engines run.

    async def __aenter__(self) -> Engine:
        from pipeline.stages.wiring import build_pipeline

        self.executor = executor = await anyio.to_thread.run_sync(self._build_executor)
        self._plan = executor.plan
        self.initial_pool_counts = executor.pool_counts()
        try:
            self._pipe = pipe = build_pipeline(
                executor,
                queue_size=self._queue_size,
                max_prefill_tokens=self._max_prefill_tokens,
                prefill_pacing=self._prefill_pacing,
                max_undelivered_tokens=self._max_undelivered,
            )
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
        except BaseException:
            executor.close()
            _engine_closed()
            raise
        for name, runner in pipe.runners():
            self._tg.start_soon(runner, name=f"hispec-{name}")
        if self.config.freeze_gc:
            _freeze_gc()
            self._froze_gc = True
        self._running = True
        return self

    def _build_executor(self) -> CommandExecutor:
        from pipeline.executor import Executor
        from pipeline.preflight import check_device, check_model

        if self._model is not None:  # a built model, on a device that can be used (start-up checks the rest)
            check_device(self.config)
            check_model(self.config, self._model)
        # a bad generation_config.json fails before the weights load
        self._generation_defaults = self._read_generation_defaults()
        tokenizer = self._tokenizer if self._tokenizer is not None else self._configured_tokenizer()
        from pipeline.distributed.environment import launch_env

        launched = launch_env()  # torchrun's ranks: this process must be rank 0, the others follow
        if launched is not None or self.config.tensor_parallel_size > 1:  # rank 0; it starts the others
            from pipeline.distributed.executor import DistributedExecutor

            return DistributedExecutor(
                self.config, model=self._model, trace_path=self._trace_path, tokenizer=tokenizer,
                launch=launched,
            )  # fmt: skip
        return Executor(self.config, model=self._model, trace_path=self._trace_path, tokenizer=tokenizer)

    def _configured_tokenizer(self) -> Tokenizer | None:
        """The tokenizer ``config.tokenizer`` / ``config.chat_template`` ask for (None: neither is set,
        the executor loads the checkpoint's own)."""
        if self.config.tokenizer is None and self.config.chat_template is None:
            return None
        from pipeline.model.tokenizer import configured_tokenizer

        return configured_tokenizer(self.config, self._model)

    def _read_generation_defaults(self) -> dict[str, float | int]:
        if self._model is not None:  # an injected model has no checkpoint directory
            return {}
        from pipeline.model.config import resolve_model_dir
        from pipeline.model.generation_config import generation_defaults

        return generation_defaults(resolve_model_dir(self.config.model))

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool | None:
        self._running = False
        cancelled = exc_type is not None and issubclass(exc_type, anyio.get_cancelled_exc_class())
        stages_ok = self._started_pipe.all_running and not self._tg.cancel_scope.cancel_called
        suppressed = None
        try:
            if not cancelled and stages_ok:
                # the stages are alive: they end (or finish) what is live; aborting is bounded in time
                finish = self._on_exit == "finish" and exc_type is None
                with anyio.CancelScope(shield=True), anyio.move_on_after(None if finish else _WIND_DOWN_S):
                    await self._wind_down(finish=finish)
            self._started_pipe.close_entries()
            if self._registry.live:
                self._tg.cancel_scope.cancel()  # the stages did not empty the engine: stop them
            suppressed = await self._tg.__aexit__(exc_type, exc, tb)  # the stages end one by one
        finally:
            with anyio.CancelScope(shield=True):
                # a stage crashed: what was live fails; the caller cancelled or left: it is aborted
                lost = self._started_executor.lost  # a tensor-parallel rank that went away
                crash = None if stages_ok else f"the engine stopped: {lost or 'a stage raised'}"
                await self._stop_what_is_live(crash)
                await self._close_executor()
        return suppressed

    async def _stop_what_is_live(self, crash: str | None) -> None:
        """With every stage stopped (cancelled or crashed), end each live request here: release its
        memory through the executor (no other task uses it now) and apply its terminal event
        (``Crashed(crash)``, or an abort)."""
        live = list(self._registry.live.values())
        if not live:
            return
        await anyio.to_thread.run_sync(self._release_all, [r.request_id for r in live])
        for req in live:
            if not req.is_finished:
                event = Crashed(crash) if crash is not None else AbortRequested()
                req.apply(event, "engine", output_tokens=len(req.output_ids))
            self._registry.ended(req)

    def _release_all(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            try:
                self._started_executor.release(rid)
            except Exception:  # shutdown frees what it can; the pools check below tells
                log.error("engine.release_failed", request_id=rid, exc_info=True)

    async def _close_executor(self) -> None:
        executor = self._started_executor
        self.final_pool_counts = executor.pool_counts()
        await anyio.to_thread.run_sync(_close_taken, [executor])
        _engine_closed()
        if self._froze_gc:
            self._froze_gc = False
            _unfreeze_gc()
        if self.final_pool_counts != self.initial_pool_counts:
            log.warning(
                "engine.pools_not_restored", initial=self.initial_pool_counts, final=self.final_pool_counts
            )

    async def _wind_down(self, finish: bool) -> None:
        if not finish:
            for rid in list(self._registry.live):
                self.abort(rid)
        await self._registry.wait_idle()

    async def flush_prefix_cache(self) -> int:
        """Evict every prefix-cache page no live request shares (returns how many); with nothing
        live, every pool is back at its initial count afterwards."""
        self._require_running()
        outcome = await self._started_pipe.control.call(FlushCache())
        if outcome.error is not None:
            raise RuntimeError(f"flushing the prefix cache failed: {outcome.error}")
        evicted = outcome.result
        assert isinstance(evicted, int), "FlushCache answers with the number of pages it evicted"
        return evicted

    async def wait_idle(self) -> None:
        """Return once no request is live (every one has ended and released its memory)."""
        self._require_running()
        await self._registry.wait_idle()

    # --- requests ---------------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> RequestStream:
        """Stream one request's output as deltas (the last one has ``finished``, ``finish_reason``
        and ``metrics``); ``params`` None samples with ``default_sampling_params()``. Raises
        ``RequestError`` naming the field right here if the request is invalid. The request is
        submitted when iteration starts; closing or cancelling the iterator aborts it. Iteration
        raises ``RequestFailed`` if the request fails. A text prompt longer than ``OFF_LOOP_CHARS``
        is encoded in a worker thread when iteration starts: its parameters and id are checked here,
        what needs its tokens (too long, an id out of the vocabulary) raises ``RequestError`` there.

        ``async with engine.generate(...) as stream: async for delta in stream: ...`` aborts the
        request as soon as the block is left, ``break`` included (a bare ``async for`` that breaks
        while something still holds the iterator aborts only when the iterator is closed)."""
        if _is_long_text(prompt):
            self._check_without_prompt(params, request_id)
            return RequestStream(self._stream_later(lambda: prompt, params, request_id))
        return RequestStream(self._stream(self._new_request(prompt, params, request_id)))

    async def generate_text(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """Run one request to its end and return its whole output. ``timeout``: a deadline in
        seconds from its submission (a long prompt's encoding comes before); past it the request is
        aborted (its memory released) and ``TimeoutError`` raised."""
        req = await self._new_request_off_loop(lambda: prompt, _is_long_text(prompt), params, request_id)
        with anyio.fail_after(timeout):  # the request's own cancel scope: cancelling it aborts the request
            async with aclosing(self._stream(req, whole=True)) as deltas:
                async for _ in deltas:
                    pass
        # the stream ends only on the delta that finished the request (a failure raises instead)
        assert req.finish_reason is not None, "a finished request has its finish_reason"
        logprobs = None if req.output_logprobs is None else tuple(req.output_logprobs)
        return GenerateResult(req.request_id, req.text, tuple(req.output_ids), req.finish_reason, req.metrics,
                              logprobs)

    def chat(
        self, messages: Messages, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> RequestStream:
        """``generate`` on a conversation (``[{"role": ..., "content": ...}, ...]``) rendered by the
        checkpoint's chat template with the generation prompt added; a checkpoint without a template
        raises ``RequestError`` naming ``messages``. A long conversation (``OFF_LOOP_CHARS``) is
        rendered and encoded in a worker thread when iteration starts, its errors raised there."""
        if _is_long_chat(messages):
            self._check_without_prompt(params, request_id)
            return RequestStream(self._stream_later(lambda: self.chat_prompt(messages), params, request_id))
        return self.generate(self.chat_prompt(messages), params, request_id=request_id)

    async def chat_text(
        self,
        messages: Messages,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """``generate_text`` on a conversation (see ``chat``)."""
        if _is_long_chat(messages):
            prompt = await anyio.to_thread.run_sync(self.chat_prompt, messages)
        else:
            prompt = self.chat_prompt(messages)
        return await self.generate_text(prompt, params, request_id=request_id, timeout=timeout)

    def chat_prompt(self, messages: Messages) -> list[int]:
        """The prompt ids of a conversation: ``apply_chat_template(messages, add_generation_prompt=True)``."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def abort(self, request_id: str) -> bool:
        """Ask to abort a live request (in whatever state it is); False if none has this id.

        Returns at once; the stage that owns the request ends it at its next safe point (between
        two device commands), releases its memory, and its stream ends with ``finish_reason="abort"``.
        """
        req = self._registry.live.get(request_id) if self._pipe is not None else None
        if req is None or req.is_finished:
            return False
        self._ctx.aborts.add(request_id)
        self._started_pipe.waker.wake_all(reason="abort")
        return True

    @property
    def plan(self) -> EnginePlan:
        """What start-up resolved and derived from ``config`` (which stays as given): the speculative
        config ``"auto"`` chose, ``max_context_len``, the pools, HOT (``pipeline.startup``)."""
        if self._plan is None:
            raise EngineClosed("the engine has not started: use `async with Engine(config) as engine:`")
        return self._plan

    @property
    def tokenizer(self) -> Tokenizer:
        self._require_running()
        return self._started_executor.tokenizer

    @property
    def generation_defaults(self) -> dict[str, float | int]:
        """The checkpoint's sampling defaults: the fields its ``generation_config.json`` sets among
        ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty`` and ``max_new_tokens``
        (``do_sample: false`` there is ``temperature`` 0), validated. Empty without the file, for the
        bundled model and for an injected model. Read when the engine starts (or when first asked)."""
        if self._generation_defaults is None:
            self._generation_defaults = self._read_generation_defaults()
        return dict(self._generation_defaults)

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """``SamplingParams`` with the checkpoint's defaults (``generation_defaults``) under
        ``overrides``; what a request given no params samples with."""
        from pipeline.sampling import SamplingParams

        return SamplingParams(**{**self.generation_defaults, **overrides})

    def stats(self) -> dict[str, object]:
        """Pools (free and capacity), HiSparse counters, speculative acceptance, request counts and
        throughput, as of the last device command."""
        self._require_running()
        return self._started_pipe.stats()

    # --- helpers ----------------------------------------------------------------------------------

    @property
    def _started_pipe(self) -> Pipeline:
        """The pipeline; only for code that runs once ``__aenter__`` has built it."""
        assert self._pipe is not None, "the engine has not started: __aenter__ builds the pipeline"
        return self._pipe

    @property
    def _started_executor(self) -> CommandExecutor:
        """The executor; only for code that runs once ``__aenter__`` has built it."""
        assert self.executor is not None, "the engine has not started: __aenter__ builds the executor"
        return self.executor

    @property
    def _registry(self) -> Registry:
        return self._started_pipe.ctx.registry

    @property
    def _ctx(self) -> StageContext:
        return self._started_pipe.ctx

    def _require_running(self) -> None:
        if not self._running:
            raise EngineClosed("the engine is not running: use `async with Engine(config) as engine:`")

    def _new_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None, request_id: str | None
    ) -> Request:
        from pipeline.request import Request
        from pipeline.validation import encode_prompt

        self._require_running()
        ex = self._started_executor
        token_ids = encode_prompt(prompt, ex.tokenizer)  # text or ids, else RequestError naming `prompt`
        params = self.default_sampling_params() if params is None else params
        ex.validate(token_ids, params)  # reads only the config and the model's vocabulary size
        if request_id is None:
            request_id = next(f"req-{n}" for n in self._ids if f"req-{n}" not in self._registry.live)
        elif not isinstance(request_id, str) or not request_id:
            raise RequestError("request_id", request_id, "must be a non-empty string")
        self._registry.check_new_id(request_id)
        return Request(request_id, tuple(token_ids), params, ex.tokenizer, ex.plan.max_context_len)

    def _check_without_prompt(self, params: SamplingParams | None, request_id: str | None) -> None:
        """At the call, what a request whose long prompt is encoded later can be checked for: the
        engine running, its sampling parameters, its id (``RequestError`` naming the field)."""
        from pipeline.validation import validate_params

        self._require_running()
        if params is not None:
            validate_params(params)
        if request_id is not None:
            if not isinstance(request_id, str) or not request_id:
                raise RequestError("request_id", request_id, "must be a non-empty string")
            self._registry.check_new_id(request_id)

    async def _new_request_off_loop(
        self,
        prompt: Callable[[], str | Sequence[int]],
        off_loop: bool,
        params: SamplingParams | None,
        request_id: str | None,
    ) -> Request:
        """``_new_request`` of what ``prompt()`` gives; with ``off_loop``, ``prompt()`` and the encoding
        run in a worker thread (the rest, which touches the engine's state, stays on the loop)."""
        from pipeline.validation import encode_prompt

        if not off_loop:
            return self._new_request(prompt(), params, request_id)
        self._require_running()
        tokenizer = self._started_executor.tokenizer
        token_ids = await anyio.to_thread.run_sync(lambda: encode_prompt(prompt(), tokenizer))
        return self._new_request(token_ids, params, request_id)

    async def _stream_later(
        self, prompt: Callable[[], str | Sequence[int]], params: SamplingParams | None, request_id: str | None
    ) -> AsyncGenerator[RequestOutput, None]:
        """``_stream`` of a request whose prompt is made and encoded in a worker thread first."""
        req = await self._new_request_off_loop(prompt, True, params, request_id)
        async with aclosing(self._stream(req)) as deltas:
            async for delta in deltas:
                yield delta

    async def _stream(self, req: Request, *, whole: bool = False) -> AsyncGenerator[RequestOutput, None]:
        """Submit ``req`` and yield its deltas (``whole``: one delta, at the end)."""
        pipe = self._started_pipe
        buffer = self._registry.add(req, pipe.on_read, whole=whole)
        log.info(
            SUBMITTED, request_id=req.request_id, state=req.state.value, prompt_tokens=len(req.prompt_ids)
        )
        try:
            await pipe.submit(req)
        except BaseException:  # closed, or cancelled while waiting for a slot: it never reached admission
            pipe.drop_unsubmitted(req)
            raise
        try:
            while True:
                delta = await buffer.next()
                yield delta
                if delta.finished:
                    return
        finally:
            if not req.is_finished:
                self.abort(req.request_id)


def _is_long_text(prompt: object) -> bool:
    return isinstance(prompt, str) and len(prompt) > OFF_LOOP_CHARS


def _is_long_chat(messages: object) -> bool:
    """A conversation whose messages' text is longer than ``OFF_LOOP_CHARS`` (a message's text content
    counted without copying it; any other message as written)."""
    return isinstance(messages, (list, tuple)) and sum(_chars(m) for m in messages) > OFF_LOOP_CHARS


def _chars(message: object) -> int:
    content = message.get("content") if isinstance(message, dict) else None
    return len(content) if isinstance(content, str) else len(str(message))


class RequestStream:
    """What ``Engine.generate`` returns: an async iterator of deltas, and an async context manager
    that aborts the request when its block is left (whether or not the stream was read to its end)."""

    def __init__(self, deltas: AsyncGenerator[RequestOutput, None]) -> None:
        self._deltas = deltas

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        return await self._deltas.__anext__()

    async def aclose(self) -> None:
        """Stop reading: an unfinished request is aborted."""
        await self._deltas.aclose()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = ["Engine", "EngineClosed", "EngineError", "GenerateResult", "RequestOutput", "RequestStream"]
