"""One data-parallel replica: an ``Engine`` in its own process, answering pickled frames on a socket.

::

    server process (ReplicatedEngine)                 replica process (replica_main)
      Submit(request_id, prompt_ids, params) ───────►  engine.generate(...) in a task of its own
      Abort(request_id)                      ───────►  engine.abort(request_id)
      Ask(seq, "stats" | "flush")            ───────►  engine.stats() / engine.flush_prefix_cache()
      Stop()                                 ───────►  leave the engine (abort or finish what is live)
                                             ◄───────  Ready(plan, ...) once the engine runs
                                             ◄───────  Delta(output) per delta; Failed(request_id, ...)
                                             ◄───────  Answer(seq, value, error)
                                             ◄───────  Stopped(final_pool_counts), then the socket closes

A frame is an 8-byte big-endian length and a pickle. The replica's engine is a plain ``Engine``
(``tensor_parallel_size`` ranks of its own when ``--tp`` > 1); an injected model reaches it as its
tensors and configuration (shared memory, as ``RankSetup`` carries them to tensor-parallel ranks).
The server tokenizes; a replica receives token ids and sends deltas with their text.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc
import attrs
from anyio.streams.buffered import BufferedByteReceiveStream

from pipeline.config import EngineConfig
from pipeline.errors import EngineClosed, RequestError, RequestFailed

if TYPE_CHECKING:
    import torch

    from pipeline.messages import RequestOutput
    from pipeline.model import ModelConfig
    from pipeline.model.tokenizer import Tokenizer
    from pipeline.sampling import SamplingParams
    from pipeline.startup import EnginePlan

_LENGTH = struct.Struct(">Q")
SEND_TIMEOUT_S = 30.0  # a frame not taken in this long: the other side is hung, the channel closes


# --- server -> replica ----------------------------------------------------------------------------


@attrs.frozen
class Submit:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams


@attrs.frozen
class Abort:
    request_id: str


@attrs.frozen
class Ask:
    seq: int  # the server's number for this question; the answer carries it
    what: str  # "stats" | "flush"


@attrs.frozen
class Stop:
    pass


# --- replica -> server ----------------------------------------------------------------------------


@attrs.frozen
class Ready:
    plan: EnginePlan
    vocab_size: int  # the model's (what a prompt's ids are checked against)
    generation_defaults: dict[str, float | int]
    initial_pool_counts: dict[str, int]


@attrs.frozen
class Delta:
    output: RequestOutput


@attrs.frozen
class Failed:
    """A request ended in an error: ``kind`` is ``"failed"`` (``RequestFailed``), ``"invalid"``
    (``RequestError``: ``reason`` is its rule, ``field`` its field) or ``"closed"`` (the engine is
    stopping)."""

    request_id: str
    kind: str
    reason: str
    field: str | None = None
    output_ids: tuple[int, ...] = ()


@attrs.frozen
class Answer:
    seq: int
    value: Any
    error: str | None = None


@attrs.frozen
class Stopped:
    final_pool_counts: dict[str, int] | None


@attrs.frozen
class ReplicaSetup:
    """What a replica process builds its engine from (pickled to it)."""

    index: int
    config: EngineConfig
    on_exit: str  # "abort" | "finish": what leaving its engine does to requests in flight
    tensors: dict[str, torch.Tensor] | None  # an injected model's tensors, or None: load config.model
    model_config: ModelConfig | None  # the injected model's configuration
    tokenizer: Tokenizer  # the server's (the same ids on both sides)
    threads: int  # torch intra-op threads (0: torch's default)
    cuda_devices: str | None = None  # on CUDA: the devices this replica (and its ranks) may see


class FrameChannel:
    """Pickled frames over a connected stream socket, both ways (one writer at a time)."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)
        self._lock = anyio.Lock()

    @classmethod
    async def open(cls, sock: socket.socket) -> FrameChannel:
        return cls(await anyio.abc.SocketStream.from_socket(sock))

    async def send(self, message: object) -> None:
        """Send one frame whole: a cancelled caller does not cut it short (the other side would read
        garbage after it). A frame the other side does not take in ``SEND_TIMEOUT_S`` closes the
        channel (``anyio.BrokenResourceError``): that side is hung."""
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        async with self._lock:
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(SEND_TIMEOUT_S) as waited:
                    await self._stream.send(_LENGTH.pack(len(body)) + body)
                if waited.cancelled_caught:
                    await self._stream.aclose()
                    raise anyio.BrokenResourceError(f"the other side took no frame in {SEND_TIMEOUT_S:.0f} s")

    async def receive(self) -> object:
        """The next frame; ``anyio.EndOfStream`` once the other side has closed."""
        try:
            (length,) = _LENGTH.unpack(await self._reader.receive_exactly(_LENGTH.size))
            return pickle.loads(await self._reader.receive_exactly(length))
        except anyio.IncompleteRead:
            raise anyio.EndOfStream from None

    async def __aiter__(self) -> AsyncIterator[object]:
        while True:
            try:
                yield await self.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return

    async def aclose(self) -> None:
        await self._stream.aclose()


def rebuild_model(model_config: ModelConfig, tensors: dict[str, torch.Tensor]) -> Any:
    """The injected model again, from its configuration and tensors (no copy, no random init)."""
    import torch

    from pipeline.model import DeepseekV32

    with torch.device("meta"):
        model = DeepseekV32(model_config)
    model.load_state_dict(tensors, assign=True)
    if model_config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def replica_main(setup: ReplicaSetup, sock: socket.socket) -> None:
    """The replica process: serve frames on ``sock`` until ``Stop`` or until the server goes; then
    the process ends at once (an error: its traceback, exit status 1). It ignores SIGINT and
    SIGTERM: the server decides when its replicas stop (Ctrl-C in a terminal reaches every process
    of the foreground group, and a replica that died of it would lose the requests that
    ``--on-exit finish`` lets finish)."""
    from pipeline.distributed.environment import ignore_stop_signals
    from pipeline.logs import configure_logging

    ignore_stop_signals()  # the server decides when its replicas stop
    if setup.cuda_devices is not None:  # before CUDA starts here; the ranks it spawns inherit it
        os.environ["CUDA_VISIBLE_DEVICES"] = setup.cuda_devices
    if setup.threads > 0:
        import torch

        torch.set_num_threads(setup.threads)
    with suppress(ImportError):  # a thread lock for the weights' progress bar: a multiprocessing one
        from tqdm import tqdm  # would outlive this process, which ends without running finalizers

        tqdm.set_lock(threading.RLock())
    sink = configure_logging(level="warning")  # its warnings and errors on the server's stderr
    try:
        anyio.run(serve_replica, setup, sock)
    finally:
        sink.close()
    # stopped cleanly (its pools reported): nothing is left to tear down that the server waits for
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


async def serve_replica(setup: ReplicaSetup, sock: socket.socket) -> None:
    """Build the engine, send ``Ready``, answer frames until ``Stop`` (or the server goes), leave the
    engine, send ``Stopped``."""
    from pipeline.engine import Engine

    channel = await FrameChannel.open(sock)
    model = None
    if setup.tensors is not None:
        assert setup.model_config is not None, "an injected model's tensors come with its configuration"
        model = rebuild_model(setup.model_config, setup.tensors)
    on_exit: Literal["abort", "finish"] = "finish" if setup.on_exit == "finish" else "abort"
    engine = Engine(setup.config, model=model, tokenizer=setup.tokenizer, on_exit=on_exit)
    live: set[str] = set()  # the requests submitted here that have not ended
    async with engine:
        assert engine.initial_pool_counts is not None, "a running engine has counted its pools"
        ready = Ready(engine.plan, _vocab_size(setup), engine.generation_defaults, engine.initial_pool_counts)
        await channel.send(ready)
        async with anyio.create_task_group() as tg:
            async for message in channel:
                if isinstance(message, Submit):
                    live.add(message.request_id)
                    tg.start_soon(_run_request, engine, channel, message, live)
                elif isinstance(message, Abort):
                    engine.abort(message.request_id)
                elif isinstance(message, Ask):
                    tg.start_soon(_answer, engine, channel, message)
                elif isinstance(message, Stop):
                    break
            # Stop, or the server went: the requests end (aborted, or finished as on_exit says) and
            # their tasks send their last deltas before the engine is left
            if on_exit == "abort":
                for request_id in list(live):
                    engine.abort(request_id)
    with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        await channel.send(Stopped(engine.final_pool_counts))  # unless the server has gone
    await channel.aclose()


def _vocab_size(setup: ReplicaSetup) -> int:
    if setup.model_config is not None:
        return setup.model_config.vocab_size
    from pipeline.model import ModelConfig, resolve_model_dir

    return ModelConfig.from_dir(resolve_model_dir(setup.config.model)).vocab_size


async def _run_request(engine: Any, channel: FrameChannel, submit: Submit, live: set[str]) -> None:
    """Stream one request's deltas back; its error as ``Failed``."""
    failed: Failed | None = None
    try:
        async with engine.generate(submit.prompt_ids, submit.params, request_id=submit.request_id) as stream:
            async for delta in stream:
                await channel.send(Delta(delta))
    except RequestFailed as exc:
        failed = Failed(submit.request_id, "failed", exc.reason, output_ids=tuple(exc.output_ids))
    except RequestError as exc:
        failed = Failed(submit.request_id, "invalid", exc.rule, field=exc.field)
    except EngineClosed as exc:
        failed = Failed(submit.request_id, "closed", str(exc))
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        return  # the server has gone
    except Exception as exc:
        failed = Failed(submit.request_id, "failed", f"{type(exc).__name__}: {exc}")
    finally:
        live.discard(submit.request_id)
    if failed is not None:
        with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await channel.send(failed)


async def _answer(engine: Any, channel: FrameChannel, ask: Ask) -> None:
    try:
        if ask.what == "stats":
            answer = Answer(ask.seq, engine.stats())
        elif ask.what == "flush":
            answer = Answer(ask.seq, await engine.flush_prefix_cache())
        else:
            answer = Answer(ask.seq, None, f"unknown question {ask.what!r}")
    except Exception as exc:
        answer = Answer(ask.seq, None, f"{type(exc).__name__}: {exc}")
    await channel.send(answer)
