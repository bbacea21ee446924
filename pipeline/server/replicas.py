"""Data parallelism behind one server: ``ReplicatedEngine``, N engines in their own processes.

``ReplicatedEngine`` has the ``Engine`` surface the server uses (``generate``, ``generate_text``,
``abort``, ``tokenizer``, ``chat_prompt``, ``plan``, ``config``, ``generation_defaults``,
``stats``, the pool counts, ``async with``), so the app serves it as it serves one engine. Each
replica is a process running a plain ``Engine`` (``pipeline.server.replica_worker``; the server's
end of it: ``pipeline.server.replica_client``), with its own tensor-parallel ranks when the config
asks for them (on CUDA, devices of its own: ``replica_cuda_devices``); the server tokenizes,
checks each request, and a ``Router`` (``pipeline.server.router``) picks the replica that runs it.

A replica that dies (its process ends, its socket closes): every request it was running fails with
an ``ApiError`` (503, ``code: "replica_lost"``) naming it, the router never chooses it again, and the
others keep serving. With no replica left, new requests get a 503.

Statistics cross a process boundary: ``refresh_stats()`` (the ``/metrics`` endpoint awaits it)
asks every live replica, and ``stats()`` answers from the last figures, per replica and summed.

Shutdown (leaving the block): every live replica is told to stop (its engine ends what is live as
``on_exit`` says), and its process is waited for, then killed past ``STOP_TIMEOUT_S``. The pools
count as restored only if every replica reported its pools back at their initial counts.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing, suppress
from typing import TYPE_CHECKING, Any

import anyio
import attrs
import structlog

from pipeline.config import EngineConfig
from pipeline.engine import RequestStream
from pipeline.errors import ConfigError, EngineClosed, EngineError, RequestError, RequestFailed
from pipeline.messages import GenerateResult, RequestOutput
from pipeline.server.generation import ApiError
from pipeline.server.metrics import sum_stats
from pipeline.server.replica_client import (
    ReplicaClient,
    ReplicaStatus,
    join_all,
    lost_error,
    start_process,
)
from pipeline.server.replica_worker import Abort, Answer, Ask, Delta, Failed, Ready, ReplicaSetup, Submit
from pipeline.server.router import NoReplica, Router, RouterConfig

if TYPE_CHECKING:
    from pipeline.model.tokenizer import Messages, Tokenizer
    from pipeline.sampling import SamplingParams
    from pipeline.startup import EnginePlan

log = structlog.get_logger("hispec.server")

ASK_TIMEOUT_S = 30.0  # a replica that does not answer a question (a flush) in this long is skipped
# a scrape asks every replica for its figures; one that does not answer in this long keeps the
# figures it last gave (a scrape must not wait out a stuck replica: scrapers give up after about ten seconds)
STATS_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 60.0  # a replica still running this long after Stop is killed


@attrs.define(eq=False)
class _Pending:
    """A request sent to a replica, until its last delta or its error reaches its stream."""

    replica: int
    send: Any  # the memory object send end of its stream of RequestOutput | BaseException


class ReplicatedEngine:
    """``num_replicas`` engines of ``config`` behind one ``Engine`` surface (module docstring).

    ``model``: an injected model, sent to every replica as its tensors and configuration.
    ``policy`` / ``router_config``: how requests are routed. ``threads``: torch intra-op threads of
    each replica process (0: torch's default). ``launch(setup, sock)``: starts one replica serving
    ``sock`` and returns it with ``multiprocessing.Process``'s ``exitcode``, ``is_alive``, ``join``
    and ``kill`` (default: a spawned process; tests run replicas in threads).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        num_replicas: int,
        model: Any = None,
        tokenizer: Tokenizer | None = None,
        on_exit: str = "abort",
        policy: str = "cache_aware",
        router_config: RouterConfig | None = None,
        threads: int = 1,
        launch: Callable[[ReplicaSetup, socket.socket], Any] | None = None,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas}: must be at least 1")
        self.config = config
        self.router = Router(num_replicas, config.page_size, policy, router_config or RouterConfig())
        self._num_replicas = num_replicas
        self._model = model
        self._tokenizer = tokenizer
        self._on_exit = on_exit
        self._threads = threads
        self._launch = launch or start_process
        self.replicas: list[ReplicaClient] = []
        self._pending: dict[str, _Pending] = {}
        self._answers: dict[int, Any] = {}  # seq -> the send end its answer goes to
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._running = False
        self.initial_pool_counts: dict[str, int] | None = None
        self.final_pool_counts: dict[str, int] | None = None

    # --- lifetime ---------------------------------------------------------------------------------

    async def __aenter__(self) -> ReplicatedEngine:
        self._tokenizer = await anyio.to_thread.run_sync(self._load_tokenizer)
        self.replicas = await anyio.to_thread.run_sync(self._spawn)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            for replica in self.replicas:
                self._tg.start_soon(
                    replica.run, self._dispatch, self._ended, name=f"hispec-replica{replica.index}"
                )
            for replica in self.replicas:
                await replica.started.wait()
            lost = [r for r in self.replicas if not r.serving]
            if lost:
                raise EngineError(
                    "; ".join(f"replica {r.index} did not start: {r.lost_reason}" for r in lost)
                )
        except BaseException:  # one did not start, or the caller gave up: none is left running
            for replica in self.replicas:
                if not replica.serving and replica.process.is_alive():
                    replica.process.kill()  # still loading: it would read Stop only once it serves
            with anyio.CancelScope(shield=True):
                await self._stop_all()
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            raise
        counts = [r.ready.initial_pool_counts for r in self.replicas if r.ready is not None]
        self.initial_pool_counts = _per_replica(counts)
        self._running = True
        log.info("server.replicas_ready", replicas=self._num_replicas, policy=self.router.policy)
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool | None:
        self._running = False
        try:
            with anyio.CancelScope(shield=True):
                await self._stop_all()
        finally:
            self._tg.cancel_scope.cancel()
            suppressed = await self._tg.__aexit__(exc_type, exc, tb)
        finals = [r.final_pool_counts for r in self.replicas]
        self.final_pool_counts = None if any(f is None for f in finals) else _per_replica(finals)
        return suppressed

    def _load_tokenizer(self) -> Tokenizer:
        """The tokenizer the replicas' engines would load (passed to them: the ids agree)."""
        if self._tokenizer is not None:
            return self._tokenizer
        from pipeline.model.tokenizer import configured_tokenizer

        return configured_tokenizer(self.config, self._model)

    def _spawn(self) -> list[ReplicaClient]:
        from pipeline.preflight import check_memory
        from pipeline.startup import preflight

        # a bad config fails here, before any process starts; the replicas start at once, so their
        # memory layers must fit together, not each in what is free now
        plan = preflight(self.config, model=self._model)
        check_memory(self.config, plan.device, replicas=self._num_replicas)
        model = self._model
        assert self._tokenizer is not None, "the tokenizer is loaded before the replicas start"
        tensors = None if model is None else {name: t.detach() for name, t in model.state_dict().items()}
        n, tp = self._num_replicas, self.config.tensor_parallel_size
        on_cuda = self.config.device == "cuda"
        devices = replica_cuda_devices(n, tp, visible_cuda_devices()) if on_cuda else None
        replicas: list[ReplicaClient] = []
        try:
            for index in range(self._num_replicas):
                setup = ReplicaSetup(
                    index, self.config, self._on_exit, tensors, None if model is None else model.cfg,
                    self._tokenizer, self._threads, None if devices is None else devices[index],
                )  # fmt: skip
                ours, theirs = socket.socketpair()
                try:
                    process = self._launch(setup, theirs)
                except BaseException:
                    ours.close()
                    theirs.close()
                    raise
                replicas.append(ReplicaClient(index, process, ours))
        except BaseException:  # one could not be launched: those launched before it do not run on
            for replica in replicas:
                replica.process.kill()
                if replica.sock is not None:
                    replica.sock.close()
            join_all([r.process for r in replicas])
            raise
        return replicas

    def _dispatch(self, replica: ReplicaClient, message: object) -> None:
        """A frame from ``replica``: to the stream of the request it is about, or to the question."""
        if isinstance(message, Delta):
            pending = self._pending.get(message.output.request_id)
            if pending is not None:
                pending.send.send_nowait(message.output)
        elif isinstance(message, Failed):
            pending = self._pending.get(message.request_id)
            if pending is not None:
                pending.send.send_nowait(_failure(message))
        elif isinstance(message, Answer):
            waiting = self._answers.pop(message.seq, None)
            if waiting is not None:
                waiting.send_nowait(message)

    def _ended(self, replica: ReplicaClient) -> None:
        """``replica`` has ended (stopped, or lost): the router forgets it, its requests fail."""
        if replica.status is ReplicaStatus.LOST:
            self.router.mark_dead(replica.index)
        error = lost_error(replica.index, replica.lost_reason or "the server stopped it")
        for pending in [p for p in self._pending.values() if p.replica == replica.index]:
            pending.send.send_nowait(error)

    async def _stop_all(self) -> None:
        """Tell every replica to stop; wait for each (``STOP_TIMEOUT_S``), kill what is left."""
        for replica in self.replicas:
            await replica.stop()
        with anyio.move_on_after(STOP_TIMEOUT_S):
            for replica in self.replicas:
                await replica.ended.wait()
        for replica in self.replicas:
            if replica.process.is_alive():
                log.warning("server.replica_killed", replica=replica.index)
                replica.process.kill()
        await anyio.to_thread.run_sync(join_all, [r.process for r in self.replicas])

    # --- requests ---------------------------------------------------------------------------------

    def generate(
        self, prompt: Sequence[int], params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> RequestStream:
        """``Engine.generate`` over the replicas: ``prompt`` is token ids (the server tokenizes).
        Raises ``RequestError`` naming the field here for an invalid request, ``EngineClosed`` when
        not running or when no replica is left."""
        from pipeline.validation import validate_request

        self._require_running()
        if isinstance(prompt, str):
            raise RequestError("prompt", prompt, "a replicated engine takes token ids")
        prompt_ids = [int(t) for t in prompt]
        params = self.default_sampling_params() if params is None else params
        validate_request(
            prompt_ids, params, vocab_size=self._ready.vocab_size, max_context_len=self.plan.max_context_len
        )
        if request_id is None:
            request_id = next(f"req-{n}" for n in self._ids if f"req-{n}" not in self._pending)
        elif not isinstance(request_id, str) or not request_id:
            raise RequestError("request_id", request_id, "must be a non-empty string")
        if request_id in self._pending:
            raise RequestError("request_id", request_id, "is already in use by a live request")
        if not self.router.alive:
            raise EngineClosed("no replica is serving")
        return RequestStream(self._stream(request_id, prompt_ids, params))

    async def _stream(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]:
        try:
            route = self.router.route(prompt_ids)
        except NoReplica as exc:
            raise EngineClosed(str(exc)) from exc
        replica = self.replicas[route.replica]
        send, receive = anyio.create_memory_object_stream[RequestOutput | BaseException](math.inf)
        self._pending[request_id] = _Pending(route.replica, send)
        self.router.begin(route.replica)
        finished = False
        try:
            with receive:
                await replica.send(Submit(request_id, tuple(prompt_ids), params))
                async for item in receive:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if item.finished:
                        finished = True
                        return
        finally:
            del self._pending[request_id]
            self.router.end(route.replica)
            if not finished and replica.serving:
                self._send_soon(replica, Abort(request_id))

    async def generate_text(
        self,
        prompt: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """``Engine.generate_text`` over the replicas (token ids only)."""
        text: list[str] = []
        token_ids: list[int] = []
        last: RequestOutput | None = None
        with anyio.fail_after(timeout):
            async with aclosing(self.generate(prompt, params, request_id=request_id)) as stream:
                async for delta in stream:
                    text.append(delta.text)
                    token_ids.extend(delta.token_ids)
                    last = delta
        assert last is not None and last.finish_reason is not None and last.metrics is not None, (
            "a request's stream ends on its finished delta"
        )
        text_all = "".join(text)
        return GenerateResult(last.request_id, text_all, tuple(token_ids), last.finish_reason, last.metrics)

    def abort(self, request_id: str) -> bool:
        """Ask the replica running ``request_id`` to abort it; False if none runs it."""
        pending = self._pending.get(request_id)
        if pending is None:
            return False
        replica = self.replicas[pending.replica]
        if replica.serving:
            self._send_soon(replica, Abort(request_id))
        return True

    def _send_soon(self, replica: ReplicaClient, message: object) -> None:
        """Send a frame from synchronous code (an abort): in a task of the engine's group."""

        async def send() -> None:
            with suppress(ApiError):  # the replica went: its requests fail with it
                await replica.send(message)

        self._tg.start_soon(send)

    async def flush_prefix_cache(self) -> int:
        """Flush every live replica's prefix cache (and the router's record of it); pages evicted."""
        answers = await self._ask("flush")
        for index in answers:
            self.router.clear(index)
        return sum(int(value) for value in answers.values())

    async def refresh_stats(self) -> None:
        """Ask every live replica for its figures (what ``stats()`` answers from); nothing once the
        engine has stopped."""
        if not self._running:
            return
        for index, value in (await self._ask("stats", STATS_TIMEOUT_S)).items():
            self.replicas[index].stats = value

    async def _ask(self, what: str, timeout_s: float = ASK_TIMEOUT_S) -> dict[int, Any]:
        """Every serving replica's answer to ``what`` (those that fail or take longer than
        ``timeout_s`` are left out)."""
        self._require_running()
        answers: dict[int, Any] = {}

        async def ask(replica: ReplicaClient) -> None:
            seq = next(self._seq)
            send, receive = anyio.create_memory_object_stream[Answer](1)
            self._answers[seq] = send
            try:
                with receive, anyio.move_on_after(timeout_s):
                    await replica.send(Ask(seq, what))
                    answer = await receive.receive()
                    if answer.error is None:
                        answers[replica.index] = answer.value
                    else:
                        log.warning("server.replica_answer", replica=replica.index, error=answer.error)
            except (ApiError, anyio.EndOfStream):
                pass
            finally:
                self._answers.pop(seq, None)

        async with anyio.create_task_group() as tg:
            for replica in self.replicas:
                if replica.serving:
                    tg.start_soon(ask, replica)
        return answers

    # --- the rest of the Engine surface -----------------------------------------------------------

    def stats(self) -> dict[str, object]:
        """The figures last gathered by ``refresh_stats``: summed over the replicas as one
        ``Engine.stats()``, with ``replicas``: each replica's own (None: lost or not answered yet),
        ``replica_status``: each one's status, and ``counted``: the sum of the last figures of every
        replica that gave any, lost ones included (what a total of counts must not lose)."""
        self._require_running()
        per = [r.stats if r.serving else None for r in self.replicas]
        total = sum_stats([s for s in per if s is not None])
        # the last figures of every replica that gave any, lost ones too: what counters sum over
        counted = sum_stats([r.stats for r in self.replicas if r.stats is not None])
        return {**total, "replicas": per, "replica_status": self.replica_status(), "counted": counted}

    def replica_status(self) -> dict[str, str]:
        """Each replica's status by index: ``starting``, ``serving``, ``lost`` or ``stopped``."""
        return {str(r.index): r.status.value for r in self.replicas}

    @property
    def _ready(self) -> Ready:
        ready = next((r.ready for r in self.replicas if r.ready is not None), None)
        if ready is None:
            raise EngineClosed("the replicated engine has not started")
        return ready

    @property
    def plan(self) -> EnginePlan:
        return self._ready.plan

    @property
    def tokenizer(self) -> Tokenizer:
        self._require_running()
        assert self._tokenizer is not None, "a running engine has its tokenizer"
        return self._tokenizer

    @property
    def generation_defaults(self) -> dict[str, float | int]:
        return dict(self._ready.generation_defaults)

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        from pipeline.sampling import SamplingParams

        return SamplingParams(**{**self.generation_defaults, **overrides})

    def chat_prompt(self, messages: Messages) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def _require_running(self) -> None:
        if not self._running:
            raise EngineClosed("the replicated engine is not running")


def visible_cuda_devices() -> list[str]:
    """The CUDA devices this process may use, as ``CUDA_VISIBLE_DEVICES`` names them."""
    import torch

    count = torch.cuda.device_count()
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is None:
        return [str(i) for i in range(count)]
    return [d.strip() for d in named.split(",") if d.strip()][:count]


def replica_cuda_devices(num_replicas: int, tp: int, visible: Sequence[str]) -> list[str]:
    """Each replica's ``CUDA_VISIBLE_DEVICES``: replica i gets the i-th ``tp`` of the ``visible``
    devices (its rank r drives the r-th of them), no device is shared; ``ConfigError`` naming
    ``data_parallel_size`` when there are too few."""
    if len(visible) < num_replicas * tp:
        raise ConfigError(
            "data_parallel_size",
            num_replicas,
            f"{num_replicas} replicas of {tp} tensor-parallel rank(s) need {num_replicas * tp} CUDA "
            f"devices, {len(visible)} visible",
        )
    return [",".join(visible[i * tp : (i + 1) * tp]) for i in range(num_replicas)]


def _failure(failed: Failed) -> BaseException:
    if failed.kind == "invalid":
        return RequestError(failed.field or "prompt", None, failed.reason)
    if failed.kind == "closed":
        return EngineClosed(failed.reason)
    return RequestFailed(failed.request_id, failed.reason, failed.output_ids)


def _per_replica(counts: Sequence[dict[str, int] | None]) -> dict[str, int]:
    """Pool counts of every replica in one dict: ``"{pool}@{index}"`` -> count."""
    return {f"{pool}@{i}": n for i, c in enumerate(counts) if c is not None for pool, n in c.items()}
