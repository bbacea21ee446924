"""``hispec serve``: the OpenAI-compatible server, uvicorn on the engine's own event loop.

Start-up: the socket is bound and uvicorn starts first (``/health`` answers 503 while the model
loads), then the engine is entered; once it runs, ``/health`` answers 200 and the ready line
``hispec serve: listening on http://HOST:PORT`` is printed.

Shutdown (SIGINT or SIGTERM, or ``HttpServer.shutdown()``): the server stops taking requests
(503), then either lets the requests in flight finish (``--on-exit finish``) or aborts them
(``--on-exit abort``, the default: their clients get an error). uvicorn closes the listening socket
and the connections that are idle or whose request is still arriving, and waits for the others to
end. Shutdown never waits on a client: the requests get ``--shutdown-timeout`` seconds to end (then
they are aborted), the connections ``CLOSE_GRACE_S`` more to take their last bytes (then they are
closed). Then the engine is left, every memory pool back at its initial free count, and the process
exits 0 (1 if a pool did not come back). A second signal aborts whatever is still running and
closes every connection at once; the process then ends without the interpreter's own teardown
(as it does at a signal that comes once the server has stopped).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import anyio
import structlog
import uvicorn

from kernels.kv_fp8 import KV_CACHE_DTYPES
from pipeline import cli_config
from pipeline.config import DEFAULT_POOL_TOKENS, EngineConfig
from pipeline.generate import add_budget_arguments, add_chunk_argument, add_tokenizer_arguments
from pipeline.logs import configure_logging
from pipeline.server.app import DEFAULT_MAX_REQUEST_BYTES, ServerState, create_app
from pipeline.server.connections import ConnectionWatch, HttpProtocol, default_max_connections

if TYPE_CHECKING:
    from pipeline.server.router import RouterConfig

log = structlog.get_logger("hispec.server")

API_KEY_ENV = "HISPEC_API_KEY"  # the API key when --api-key is not given
CLOSE_GRACE_S = 2.0  # once no request runs, how long the connections get to take their last bytes
FORCE_GRACE_S = 0.5  # after a second signal (everything aborted), how long they get
POLL_S = 0.05  # how often a drain looks at what is left


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0")
        return value

    return parse


def _within(option: str, kind: type[int] | type[float], low: float, high: float | None = None
            ) -> Callable[[str], int | float]:
    """An option's value of ``kind`` from ``low`` to ``high`` (inclusive; None: no upper bound),
    or one line naming the option (``OptionError``), before the model loads."""
    from pipeline.cli_types import OptionError

    rule = f"must be {'an integer' if kind is int else 'a number'} " + (
        f"from {low:g} to {high:g}" if high is not None else f"of at least {low:g}"
    )

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise OptionError(option, text, rule) from None
        if not (low <= value and (high is None or value <= high)):
            raise OptionError(option, value, rule)
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    from pipeline.cli_types import port_number  # a bad --port: one line, before the model loads

    p.add_argument(
        "--port", type=port_number, default=8000, help="0 = any free port (printed on the ready line)"
    )
    p.add_argument("--model", default="tiny", help="'tiny' (bundled) or an HF-format directory")
    p.add_argument("--served-model-name", help="the name clients pass as `model` (default: --model)")
    add_tokenizer_arguments(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="how KV rows are stored: auto (= --dtype) or fp8_e4m3 (V3.2's FP8 layouts)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--max-context-len", "--max-model-len", type=int, default=4096, help="capped at the model's positions"
    )
    p.add_argument(
        "--max-running-requests", type=int, default=None,
        help="request rows (default: 32; with a device memory budget, what its plan holds)",
    )
    add_budget_arguments(p)
    p.add_argument(
        "--device-pool-tokens",
        type=int,
        default=None,
        help=f"device KV slots (default: {DEFAULT_POOL_TOKENS}, or one full context if that is more)",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--hot", type=int, default=None,
                   help="HiSparse hot columns per request (default: 128, or the model's index_topk if more)")
    p.add_argument("--no-hisparse", action="store_true", help="keep every token's KV on the device")
    p.add_argument(
        "--cuda-graphs", action="store_true",
        help="replay plain decode steps from CUDA graphs (needs --no-hisparse; docs/cuda.md)",
    )
    p.add_argument("--no-spec", action="store_true", help="plain decoding (no MTP speculation)")
    p.add_argument(
        "--num-steps",
        type=int,
        default=None,
        help="draft steps per speculative round (default: 3 if the model has MTP)",
    )
    p.add_argument("--seed", type=int, default=0, help="engine seed (sampled requests derive theirs from it)")
    p.add_argument(
        "--on-exit",
        choices=["abort", "finish"],
        default="abort",
        help="on SIGINT/SIGTERM: abort the requests in flight, or let them finish",
    )
    add_chunk_argument(p)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    p.add_argument(
        "--tp", type=int, default=None, metavar="N",
        help="tensor parallelism over N processes (default: the WORLD_SIZE torchrun gives, else 1)",
    )
    p.add_argument(
        "--data-parallel-size", "--dp", type=_positive(int), default=1, metavar="N",
        help="N engines (each its own --tp group, in its own processes) behind this server",
    )
    from pipeline.server.router import POLICIES, RouterConfig

    defaults = RouterConfig()
    p.add_argument(
        "--router-policy", choices=POLICIES, default="cache_aware",
        help="how requests are spread over the data-parallel replicas (docs/server.md)",
    )
    p.add_argument(
        "--router-cache-threshold", type=_within("--router-cache-threshold", float, 0, 1),
        default=defaults.cache_threshold, metavar="SHARE",
        help="cache_aware: a cached prefix of at least this share of the prompt routes by cache",
    )
    p.add_argument(
        "--router-balance-abs-threshold", type=_within("--router-balance-abs-threshold", int, 0),
        default=defaults.balance_abs_threshold, metavar="N",
        help="cache_aware: imbalance is more than N requests in flight between the busiest and the idlest",
    )
    p.add_argument(
        "--router-balance-rel-threshold", type=_within("--router-balance-rel-threshold", float, 1),
        default=defaults.balance_rel_threshold,
        metavar="RATIO", help="cache_aware: ... and the busiest has more than RATIO times the idlest's",
    )
    p.add_argument("--log-json", metavar="FILE", help="write every log event to FILE as JSON lines")
    p.add_argument("-v", "--verbose", action="store_true", help="print log events on stderr")
    p.add_argument(
        "--otlp-traces-endpoint", metavar="URL",
        help="send each request's lifecycle as OpenTelemetry spans when it ends (OTLP over HTTP, e.g. "
        "http://localhost:4318/v1/traces; the `otel` extra)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize "
        f"(default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--disable-access-log",
        action="store_true",
        help="no server.access log line per request (logged when logging is on: --log-json, -v)",
    )
    p.add_argument(
        "--max-connections", type=_positive(int), default=None, metavar="N",
        help="open connections at most; one more gets a 503 (default: 512, or less under a low "
        "file descriptor limit)",
    )
    p.add_argument(
        "--timeout-keep-alive", type=_positive(float), default=5.0, metavar="SECONDS",
        help="an idle connection is closed after this long; so is one whose request headers are "
        "not all in this long after it became idle",
    )
    p.add_argument(
        "--max-request-bytes", type=_positive(int), default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
        help="a larger request body is a 413 (default: 8 MiB)",
    )
    p.add_argument(
        "--shutdown-timeout", type=_positive(float), default=30.0, metavar="SECONDS",
        help="on SIGINT/SIGTERM, the longest the requests in flight get to end before they are aborted",
    )
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """``pipeline.cli_config.engine_config`` with serve's own defaults: the context capped at the
    model's positions, 32 request rows without a device memory budget."""
    from pipeline.model import ModelConfig, resolve_model_dir

    positions = ModelConfig.from_dir(resolve_model_dir(args.model)).max_position_embeddings
    context = min(args.max_context_len, positions or args.max_context_len)
    rows = args.max_running_requests
    budget = args.device_memory is not None or args.device_memory_fraction is not None
    if rows is None and not budget:
        rows = 32
    return cli_config.engine_config(args, max_context_len=context, max_running_requests=rows)


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The cache-aware policy's thresholds (the parser has checked their ranges)."""
    from pipeline.server.router import RouterConfig

    return RouterConfig(
        cache_threshold=args.router_cache_threshold,
        balance_abs_threshold=args.router_balance_abs_threshold,
        balance_rel_threshold=args.router_balance_rel_threshold,
    )


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the embedding code decides what a signal does."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class CannotListen(OSError):
    """The server's address cannot be bound (in use, not this machine's, not allowed)."""


class HttpServer:
    """``create_app(engine)`` served by uvicorn on the current event loop; ``await run()``.

    ``run`` enters the engine itself (after the socket is listening) and leaves it after the last
    connection has ended. ``shutdown()`` (from the event loop: a signal handler, a test) starts the
    drain; ``on_exit`` says what happens to the requests in flight, ``shutdown_timeout`` how long
    they get; a second ``shutdown()`` aborts them and closes every connection.

    ``max_connections`` (default: ``default_max_connections()``), ``timeout_keep_alive`` (seconds
    idle, or waiting for a request's headers) and ``max_request_bytes``: the limits a client is held
    to (``pipeline.server.connections``, ``pipeline.server.middleware.BodyLimit``).
    """

    def __init__(
        self,
        engine: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        served_model_name: str | None = None,
        on_exit: str = "abort",
        api_key: str | None = None,
        access_log: bool = True,
        max_connections: int | None = None,
        timeout_keep_alive: float = 5.0,
        max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
        shutdown_timeout: float = 30.0,
    ) -> None:
        if on_exit not in ("abort", "finish"):
            raise ValueError(f"on_exit={on_exit!r}: must be 'abort' or 'finish'")
        if max_connections is not None and max_connections < 1:
            raise ValueError(f"max_connections={max_connections}: must be at least 1")
        if not (timeout_keep_alive > 0 and shutdown_timeout >= 0):
            raise ValueError("timeout_keep_alive must be more than 0, shutdown_timeout at least 0")
        self.engine = engine
        self.app = create_app(
            engine,
            served_model_name=served_model_name,
            api_key=api_key,
            access_log=access_log,
            max_request_bytes=max_request_bytes,
        )
        self.state: ServerState = self.app.state.hispec
        self.on_exit = on_exit
        self.shutdown_timeout = shutdown_timeout
        self.max_connections = max_connections or default_max_connections()
        if self.max_connections > default_max_connections():
            log.warning(
                "server.max_connections_over_fd_limit",
                max_connections=self.max_connections,
                advised=default_max_connections(),
            )
        self._watch = ConnectionWatch()
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise CannotListen(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            http=HttpProtocol.configured(self.max_connections, self._watch),  # httptools, with limits
            ws="none",
            timeout_keep_alive=timeout_keep_alive,  # type: ignore[arg-type]  # seconds: a float works
            timeout_graceful_shutdown=None,  # the drain bounds itself (run)
        )
        self._server = _Uvicorn(config)
        self._stop = anyio.Event()
        self._forced = anyio.Event()
        self.pools_restored: bool | None = None  # known once run() returns

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def forced(self) -> bool:
        """A second ``shutdown()`` (or ``shutdown(force=True)``) came."""
        return self._forced.is_set()

    def shutdown(self, *, force: bool = False) -> None:
        """Stop taking requests; abort or finish those in flight (``on_exit``). ``force`` (or a second
        call) aborts everything still running and closes every connection at once."""
        if force or self._stop.is_set():
            log.warning(
                "server.forced_shutdown",
                in_flight=len(self.state.in_flight),
                connections=len(self._server.server_state.connections),
            )
            self.state.drain(abort=True)
            self._forced.set()
            self._stop.set()
            return
        self.state.drain(abort=self.on_exit == "abort")
        log.info("server.draining", on_exit=self.on_exit, in_flight=len(self.state.in_flight))
        self._stop.set()

    async def run(
        self,
        *,
        on_ready: Callable[[HttpServer], None] | None = None,
        task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until ``shutdown()`` and every connection has ended. ``task_status.started(port)``
        (and ``on_ready``) once the engine runs."""
        served = anyio.Event()

        async def serve() -> None:
            try:
                await self._server.serve(sockets=[self.sock])
            finally:
                served.set()
                self._stop.set()  # uvicorn ended on its own: leave the engine too

        loop = asyncio.get_running_loop()
        self._watch.previous = loop.get_exception_handler()
        loop.set_exception_handler(self._watch)  # accept out of descriptors: a warning, not tracebacks
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve)
                try:
                    while not (self._server.started or served.is_set()):
                        await anyio.sleep(0.01)
                    if not self._server.started:
                        raise RuntimeError("uvicorn did not start")
                    async with self.engine:
                        log.info("server.ready", url=self.url, model=self.state.model_name)
                        if on_ready is not None:
                            on_ready(self)
                        task_status.started(self.port)
                        await self._stop.wait()
                        self._server.should_exit = True
                        await self._drain(served)
                finally:
                    self._server.should_exit = True
                    self.state.draining = True
                    if not served.is_set():  # left early (an error): nothing is waited for
                        self._close_connections()
            due = self._watch.retries_due_by()  # asyncio's retries of failed accepts, still to come
            if due is not None and due > loop.time():
                await anyio.sleep(due - loop.time() + POLL_S)
        finally:
            loop.set_exception_handler(self._watch.previous)
        initial, final = self.engine.initial_pool_counts, self.engine.final_pool_counts
        self.pools_restored = initial is not None and final == initial
        log.info("server.stopped", pools_restored=self.pools_restored, initial=initial, final=final)

    async def _drain(self, served: anyio.Event) -> None:
        """After ``shutdown()``, until uvicorn has ended (``served``): the requests being served get
        ``shutdown_timeout`` seconds to end (then they are aborted), the connections ``CLOSE_GRACE_S``
        more to take their last bytes; after a second ``shutdown()`` (everything aborted), only
        ``FORCE_GRACE_S``. Then every connection left is closed. A response its client does not read
        does not count as being served: the drain never waits on a client."""

        def serving() -> bool:
            return any(connection.busy() for connection in self._connections())

        requests_end = anyio.current_time() + self.shutdown_timeout
        grace_end: float | None = None  # set once no request is being served (or they were aborted)
        forced_end: float | None = None
        while not served.is_set():
            now = anyio.current_time()
            if self.forced:
                forced_end = forced_end or now + FORCE_GRACE_S
                if now >= forced_end:
                    break
            elif grace_end is None:
                if serving() and now >= requests_end:
                    log.warning(
                        "server.shutdown_timeout",
                        seconds=self.shutdown_timeout,
                        aborted=len(self.state.in_flight),
                    )
                    self.state.drain(abort=True)
                if not serving() or now >= requests_end:
                    grace_end = now + CLOSE_GRACE_S
            elif now >= grace_end:
                break
            await anyio.sleep(POLL_S)
        if not served.is_set():
            self._close_connections()
            await served.wait()
        # every connection is gone; the tasks that served them end as their requests do (aborted)
        with anyio.move_on_after(CLOSE_GRACE_S):
            while self._server.server_state.tasks:
                await anyio.sleep(POLL_S)

    def _connections(self) -> list[HttpProtocol]:
        """The open connections. uvicorn types them as any of its protocols; this server configures
        one, ``HttpProtocol`` (and no WebSockets), so each is one of those."""
        return cast("list[HttpProtocol]", list(self._server.server_state.connections))

    def _close_connections(self) -> None:
        """Abort every request in flight and close every connection now; uvicorn stops waiting."""
        self.state.drain(abort=True)
        connections = self._connections()
        for connection in connections:
            connection.transport.abort()  # nothing more is sent: its client sees the connection end
        self._server.force_exit = True
        if connections:
            log.warning("server.connections_closed", connections=len(connections))


async def _serve(args: argparse.Namespace, model: Any) -> tuple[int, bool]:
    """Serve until a signal: (the exit status, whether a second signal forced the end)."""
    from pipeline.engine import Engine

    engine: Any
    if args.data_parallel_size > 1:
        from pipeline.server.replicas import ReplicatedEngine

        engine = ReplicatedEngine(
            engine_config(args), num_replicas=args.data_parallel_size, model=model, on_exit=args.on_exit,
            policy=args.router_policy, router_config=router_config(args), threads=args.threads,
        )  # fmt: skip
    else:
        engine = Engine(engine_config(args), model=model, on_exit=args.on_exit)
    server = HttpServer(
        engine,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name or args.model,
        on_exit=args.on_exit,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        access_log=not args.disable_access_log,
        max_connections=args.max_connections,
        timeout_keep_alive=args.timeout_keep_alive,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
    )

    def ready(server: HttpServer) -> None:
        print(f"hispec serve: listening on {server.url} (model {server.state.model_name!r})", flush=True)

    async with anyio.create_task_group() as tg:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:

            async def on_signals() -> None:
                async for signum in signals:
                    log.info("server.signal", signal=signal.Signals(signum).name)
                    server.shutdown()

            tg.start_soon(on_signals)
            await server.run(on_ready=ready)
            tg.cancel_scope.cancel()
    status = 0 if server.pools_restored else 1
    _exit_on_signal(status)
    print(
        f"hispec serve: stopped; memory pools {'restored' if server.pools_restored else 'NOT restored'}",
        flush=True,
    )
    return status, server.forced


def _exit_on_signal(status: int) -> None:
    """From now on SIGINT or SIGTERM ends the process at once with ``status``: the server has
    stopped, only the interpreter's teardown is left (not a traceback, nor a killed process)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def exit_now(signum: int, frame: object) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, exit_now)


SWITCH_INTERVAL_S = 0.001


def main(argv: Sequence[str] | None = None, *, model: Any = None) -> int:
    """Entry point of ``hispec serve``; ``model`` replaces loading ``--model`` (tests)."""
    args = build_parser().parse_args(argv)
    from pipeline.distributed.environment import launch_env

    if args.data_parallel_size > 1 and launch_env() is not None:  # torchrun's ranks are one engine's
        print("hispec serve: --data-parallel-size: not under a launcher (torchrun): its ranks serve one "
              "tensor-parallel engine", file=sys.stderr)  # fmt: skip
        return 2
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    # The event loop (HTTP, SSE) and the executor's worker thread share the GIL; a shorter switch
    # interval than the default 5 ms lets the loop answer while the executor runs Python code.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    logged = bool(args.log_json or args.verbose)
    spans = None
    if args.otlp_traces_endpoint:  # reads the lifecycle events, then drops what logging would not write
        from pipeline.trace_export import LiveSpans, OtelMissing

        try:
            spans = LiveSpans(args.otlp_traces_endpoint, drop_below=None if logged else "warning")
        except (OtelMissing, ValueError) as exc:
            print(f"hispec serve: --otlp-traces-endpoint: {exc}", file=sys.stderr)
            return 2
    level = "info" if logged or spans is not None else "warning"
    sink = configure_logging(json=args.log_json or False, level=level, processors=[spans] if spans else ())
    try:
        status, forced = anyio.run(_serve, args, model)
    except FileNotFoundError as exc:
        print(f"hispec serve: model {args.model!r} not found ({exc}); pass --model PATH", file=sys.stderr)
        return 2
    except CannotListen as exc:
        print(f"hispec serve: {exc}", file=sys.stderr)
        return 2
    finally:
        sink.close()
        if spans is not None:
            spans.close()  # sends the spans not sent yet
    if forced:  # a second signal: the process ends now, without the interpreter's teardown (seconds)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
