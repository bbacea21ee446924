"""``hispec serve``: the OpenAI-compatible server, uvicorn on the engine's own event loop.

Start-up: the socket is bound and uvicorn starts first (``/health`` answers 503 while the model
loads), then the engine is entered; once it runs, ``/health`` answers 200 and the ready line
``hispec serve: listening on http://HOST:PORT`` is printed.

Shutdown (SIGINT or SIGTERM, or ``HttpServer.shutdown()``): the server stops taking requests
(503), then either lets the requests in flight finish (``--on-exit finish``) or aborts them
(``--on-exit abort``, the default: their clients get an error). uvicorn closes the listening socket
and waits for every connection to end; then the engine is left, every memory pool back at its
initial free count, and the process exits 0 (1 if a pool did not come back). A second signal
aborts whatever is still running.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio
import structlog
import uvicorn

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.generate import add_budget_arguments, add_chunk_argument, batch_tokens, chunk_tokens
from pipeline.logs import configure_logging
from pipeline.server.app import ServerState, create_app

log = structlog.get_logger("hispec.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (printed on the ready line)")
    p.add_argument("--model", default="tiny", help="'tiny' (bundled) or an HF-format directory")
    p.add_argument("--served-model-name", help="the name clients pass as `model` (default: --model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--max-context-len", type=int, default=4096, help="capped at the model's positions")
    p.add_argument(
        "--max-running-requests", type=int, default=None,
        help="request rows (default: 32; with a device memory budget, what its plan holds)",
    )
    add_budget_arguments(p)
    p.add_argument(
        "--device-pool-tokens",
        type=int,
        default=None,
        help="device KV slots (default: 16384, or one full context if that is more)",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--hot", type=int, default=128, help="HiSparse hot columns per request")
    p.add_argument("--no-hisparse", action="store_true", help="keep every token's KV on the device")
    p.add_argument("--no-spec", action="store_true", help="plain decoding (no MTP speculation)")
    p.add_argument("--num-steps", type=int, default=3, help="draft steps per speculative round")
    p.add_argument("--seed", type=int, default=0, help="engine seed (sampled requests derive theirs from it)")
    p.add_argument(
        "--on-exit",
        choices=["abort", "finish"],
        default="abort",
        help="on SIGINT/SIGTERM: abort the requests in flight, or let them finish",
    )
    add_chunk_argument(p)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor parallelism over N processes")
    p.add_argument("--log-json", metavar="FILE", help="write every log event to FILE as JSON lines")
    p.add_argument("-v", "--verbose", action="store_true", help="print log events on stderr")
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from pipeline.model import ModelConfig, resolve_model_dir

    positions = ModelConfig.from_dir(resolve_model_dir(args.model)).max_position_embeddings
    context = min(args.max_context_len, positions or args.max_context_len)
    page = args.page_size
    pool, rows = args.device_pool_tokens, args.max_running_requests
    budget = args.device_memory is not None or args.device_memory_fraction is not None
    if pool is None and not budget:
        pool = max(16384, -(-context // page) * page)
    if rows is None and not budget:
        rows = 32
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        page_size=page,
        max_context_len=context,
        max_running_requests=rows,
        device_pool_tokens=pool,
        device_memory_bytes=args.device_memory,
        device_memory_fraction=args.device_memory_fraction,
        hisparse=None if args.no_hisparse else HiSparseConfig(device_buffer_size=args.hot),
        speculative=None if args.no_spec else SpeculativeConfig(num_steps=args.num_steps),
        chunked_prefill_tokens=chunk_tokens(args),
        prefill_batch_tokens=batch_tokens(args),
        mixed_steps=not args.no_mixed_steps,
        prefix_cache=not args.no_prefix_cache,
        seed=args.seed,
        tensor_parallel_size=args.tp,
    )


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the embedding code decides what a signal does."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """``create_app(engine)`` served by uvicorn on the current event loop; ``await run()``.

    ``run`` enters the engine itself (after the socket is listening) and leaves it after the last
    connection has ended. ``shutdown()`` (from the event loop: a signal handler, a test) starts the
    drain; ``on_exit`` says what happens to the requests in flight.
    """

    def __init__(
        self,
        engine: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        served_model_name: str | None = None,
        on_exit: str = "abort",
    ) -> None:
        if on_exit not in ("abort", "finish"):
            raise ValueError(f"on_exit={on_exit!r}: must be 'abort' or 'finish'")
        self.engine = engine
        self.app = create_app(engine, served_model_name=served_model_name)
        self.state: ServerState = self.app.state.hispec
        self.on_exit = on_exit
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            http="httptools",
            ws="none",
            timeout_graceful_shutdown=None,
        )
        self._server = _Uvicorn(config)
        self._stop = anyio.Event()
        self.pools_restored: bool | None = None  # known once run() returns

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def shutdown(self, *, force: bool = False) -> None:
        """Stop taking requests; abort or finish those in flight (``on_exit``). ``force`` (or a second
        call) aborts everything still running."""
        if force or self._stop.is_set():
            aborted = self.state.abort_in_flight()
            log.warning("server.forced_shutdown", aborted=aborted)
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
                    await served.wait()
            finally:
                self._server.should_exit = True
                self.state.draining = True
        initial, final = self.engine.initial_pool_counts, self.engine.final_pool_counts
        self.pools_restored = initial is not None and final == initial
        log.info("server.stopped", pools_restored=self.pools_restored, initial=initial, final=final)


async def _serve(args: argparse.Namespace, model: Any) -> int:
    from pipeline.engine import Engine

    engine = Engine(engine_config(args), model=model, on_exit=args.on_exit)
    server = HttpServer(
        engine,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name or args.model,
        on_exit=args.on_exit,
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
    print(
        f"hispec serve: stopped; memory pools {'restored' if server.pools_restored else 'NOT restored'}",
        flush=True,
    )
    return 0 if server.pools_restored else 1


SWITCH_INTERVAL_S = 0.001


def main(argv: Sequence[str] | None = None, *, model: Any = None) -> int:
    """Entry point of ``hispec serve``; ``model`` replaces loading ``--model`` (tests)."""
    args = build_parser().parse_args(argv)
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    # The event loop (HTTP, SSE) and the executor's worker thread share the GIL; a shorter switch
    # interval than the default 5 ms lets the loop answer while the executor runs Python code.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    level = "info" if args.log_json or args.verbose else "warning"
    sink = configure_logging(json=args.log_json or False, level=level)
    try:
        return anyio.run(_serve, args, model)
    except FileNotFoundError as exc:
        print(f"hispec serve: model {args.model!r} not found ({exc}); pass --model PATH", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"hispec serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    finally:
        sink.close()
