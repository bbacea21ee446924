"""``hispec generate``: run prompts through the engine, print the text and a lifecycle trace.

Several prompts run concurrently; each text is streamed as it is produced (in the order of the
prompts: a later prompt's text so far appears when the earlier ones end), or printed when its
request ends with ``--no-stream``. ``-`` as a prompt reads it from stdin; ``--chat`` sends each
prompt as a user message through the model's chat template. After the texts, one line per request
shows the states it went through with the time it entered each (seconds since it arrived), then the
engine's HiSparse and speculative figures. ``--log-json FILE`` also writes every log event as JSON
lines, for ``hispec trace FILE``; ``--topk-trace FILE`` records every top-k selection for
``hispec replay``.
A sampling flag not given (``--temperature``, ``--top-p``, ``--top-k``, ``--max-new-tokens``) takes
the checkpoint's default from its ``generation_config.json``, else the built-in one
(docs/checkpoints.md).
Errors are reported by ``pipeline.cli`` (one line, exit status 2).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from structlog.typing import WrappedLogger

from kernels.kv_fp8 import KV_CACHE_DTYPES
from kernels.swap_in_policy import POLICIES
from pipeline.cli_config import engine_config
from pipeline.config import DEFAULT_CHUNK, DEFAULT_PREFILL_BATCH, RESIDENCIES
from pipeline.errors import HispecError
from pipeline.logs import SUBMITTED, by_request, configure_logging, is_lifecycle, record_time

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

    from pipeline.engine import Engine
    from pipeline.messages import RequestOutput
    from pipeline.sampling import SamplingParams

LOOP_STATES = ("decode", "draft", "verify")
STEP_EVENTS = ("StepDone", "Verified", "Finished")  # each ends one decode step or verify round
MOVE_EVENTS = ("Demoted", "Promoted")  # dynamic residency: each leaves the request in its state


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec generate", description=__doc__.split("\n\n")[0])
    p.add_argument("prompts", nargs="+", help="one or more prompts (they run concurrently); '-' reads stdin")
    p.add_argument("--no-stream", action="store_true", help="print each text when its request ends")
    p.add_argument("--chat", action="store_true", help="send each prompt as a user message (chat template)")
    p.add_argument(
        "--topk-trace",
        metavar="FILE",
        help="record every top-k selection to FILE for `hispec replay` (docs/topk-trace.md)",
    )
    add_engine_arguments(p, max_new_tokens=64)
    return p


# the sampling flags' built-in defaults, where neither the flag nor the checkpoint's
# generation_config.json sets a value (max_new_tokens: the command's own)
BUILTIN_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
CHECKPOINT_DEFAULT = "default: the checkpoint's generation_config.json, else"


def add_engine_arguments(p: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    """The sampling and engine options ``generate`` and ``chat`` share. A sampling flag not given
    takes the checkpoint's default (``generation_config.json``), else the built-in one."""
    p.add_argument("--max-new-tokens", type=int, default=None, help=f"{CHECKPOINT_DEFAULT} {max_new_tokens}")
    p.set_defaults(builtin_max_new_tokens=max_new_tokens)
    p.add_argument("--temperature", type=float, default=None, help=f"0 = greedy ({CHECKPOINT_DEFAULT} 0)")
    p.add_argument("--top-p", type=float, default=None, help=f"{CHECKPOINT_DEFAULT} 1.0")
    p.add_argument("--top-k", type=int, default=None, help=f"0 = no limit ({CHECKPOINT_DEFAULT} 0)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the model's end tokens")
    p.add_argument("--seed", type=int, default=0, help="engine seed (sampled requests derive theirs from it)")
    p.add_argument("--no-spec", action="store_true", help="plain decoding (no MTP speculation)")
    p.add_argument("--no-hisparse", action="store_true", help="keep every token's KV on the device")
    p.add_argument(
        "--policy", default="auto", choices=(*POLICIES, "auto"),
        help="HiSparse replacement policy (docs/cache-policy.md); auto: adaptive on a CPU, lru on CUDA"
    )
    p.add_argument(
        "--near-margin", type=int, default=None, metavar="M",
        help="positions ranked past the top-k for the near-policies "
        "(default: top_k under one, or with a trace)",
    )
    p.add_argument(
        "--residency", default="always", choices=RESIDENCIES,
        help="HiSparse: where a decoding request's KV lives (docs/residency.md): always the hot buffer, "
        "or dynamic: all on the device while memory lasts",
    )
    p.add_argument(
        "--num-steps", type=int, default=None, help="draft steps per round (default: 3 if the model has MTP)"
    )
    p.add_argument("--model", default="tiny", help="'tiny' (bundled) or an HF-format directory")
    add_tokenizer_arguments(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="how KV rows are stored: auto (= --dtype) or fp8_e4m3 (V3.2's FP8 layouts)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--max-context-len", "--max-model-len", type=int, default=None,
        help="default: the model's positions, as far as the pools hold",
    )
    add_chunk_argument(p)
    add_budget_arguments(p)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    p.add_argument(
        "--tp", type=int, default=None, metavar="N",
        help="tensor parallelism over N processes (default: the WORLD_SIZE torchrun gives, else 1)",
    )
    p.add_argument(
        "--no-shared-host-pool", action="store_true",
        help="with --tp: each rank keeps its own HiSparse host pool (default: one per node, shared)",
    )
    p.add_argument(
        "--cuda-graphs", action="store_true",
        help="replay plain decode steps from CUDA graphs (docs/cuda.md)",
    )
    p.add_argument("--log-json", metavar="FILE", help="write every log event to FILE as JSON lines")
    p.add_argument("-v", "--verbose", action="store_true", help="lifecycle events and tracebacks on stderr")


def add_tokenizer_arguments(p: argparse.ArgumentParser) -> None:
    """``--tokenizer`` and ``--chat-template`` (generate, chat and serve)."""
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="read the tokenizer files from DIR instead of the model directory")
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a Jinja chat template replacing the checkpoint's")


def add_budget_arguments(p: argparse.ArgumentParser) -> None:
    from pipeline.capacity import parse_bytes

    p.add_argument(
        "--device-memory", type=parse_bytes, default=None, metavar="BYTES",
        help="device memory budget of the KV memory layer (e.g. 64MB, 2GiB); sizes the pools",
    )
    p.add_argument(
        "--device-memory-fraction", type=float, default=None, metavar="F",
        help="CUDA: the budget as a fraction of the device memory free once the weights are loaded",
    )


def add_chunk_argument(p: argparse.ArgumentParser) -> None:
    """``--chunked-prefill-tokens``, ``--no-mixed-steps`` and ``--no-prefix-cache`` (generate, chat
    and serve)."""
    p.add_argument(
        "--no-prefix-cache", action="store_true", help="recompute every prompt (no prefix caching)"
    )
    p.add_argument(
        "--no-mixed-steps",
        action="store_true",
        help="run prefill chunks and decode steps as separate forwards",
    )
    p.add_argument(
        "--chunked-prefill-tokens",
        type=int,
        default=DEFAULT_CHUNK,
        metavar="N",
        help=f"prefill long prompts N tokens per forward (default {DEFAULT_CHUNK}; 0 = whole prompts)",
    )
    p.add_argument(
        "--prefill-batch-tokens",
        type=int,
        default=None,
        metavar="N",
        help=f"prompt tokens one prefill forward carries over all its requests (default: the larger of "
        f"{DEFAULT_PREFILL_BATCH} and the chunk, none with whole prompts; 0 = no bound)",
    )


def sampling_params(args: argparse.Namespace, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """The ``SamplingParams`` of the sampling flags; a flag not given takes ``defaults`` (the
    checkpoint's: ``Engine.generation_defaults``), else its built-in default."""
    from pipeline.sampling import SamplingParams

    builtin = {**BUILTIN_SAMPLING, "max_new_tokens": getattr(args, "builtin_max_new_tokens", 64)}
    given = {name: getattr(args, name) for name in builtin if getattr(args, name) is not None}
    chosen = {**builtin, **(defaults or {}), **given}
    return SamplingParams(**chosen, stop=tuple(args.stop), ignore_eos=args.ignore_eos)


class Collector:
    """A structlog processor keeping the lifecycle records (and passing every event on)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def __call__(self, _logger: WrappedLogger, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        if is_lifecycle(event) or event.get("event") == SUBMITTED:
            self.records.append(dict(event))
        return event


def drop(_logger: WrappedLogger, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    raise structlog.DropEvent


def compact_trace(events: list[dict[str, Any]], arrival: float | None) -> str:
    """``queued +0.000s > prefill +0.002s > ... > decode +0.015s (63 steps) > finished +0.650s [...]``.

    Times are seconds since the request arrived; a run of decode/draft/verify states folds into one
    entry with its number of steps (a retraction starts a new run), and a chunked prefill into one
    entry with its number of chunks."""
    origin = arrival if arrival is not None else record_time(events[0])
    entries: list[list[Any]] = []  # [state, entered at, steps]
    if arrival is not None:
        entries.append([events[0]["from_state"], arrival, 0])
    for record in events:
        if record["event"] == "ChunkDone" and entries and entries[-1][0] == "prefill":
            entries[-1][2] += 1
            continue
        if record["event"] in MOVE_EVENTS:  # a demotion or a promotion: the state goes on
            continue
        in_loop = bool(entries) and entries[-1][0] in LOOP_STATES
        if in_loop and record["event"] in STEP_EVENTS:
            entries[-1][2] += 1
        if not (in_loop and record["state"] in LOOP_STATES):
            entries.append([record["state"], record_time(record), 0])
    parts = []
    for state, entered, steps in entries:
        unit = "chunks" if state == "prefill" else "steps"
        count = steps + 1 if state == "prefill" and steps else steps  # the last chunk ends the state
        parts.append(f"{state} +{entered - origin:.3f}s" + (f" ({count} {unit})" if count else ""))
    last = events[-1]
    parts[-1] += f" [{last.get('reason', last['state'])}, {last.get('output_tokens', '?')} tokens]"
    return " > ".join(parts)


async def run(args: argparse.Namespace, model: Any) -> tuple[list[Any], dict[str, object]]:
    from pipeline.engine import Engine

    sampling_params(args).validate()  # a bad sampling flag is reported before the model loads
    results: list[Any] = [None] * len(args.prompts)
    trace = getattr(args, "topk_trace", None)
    async with Engine(engine_config(args), model=model, trace_path=trace) as engine:
        params = sampling_params(args, defaults=engine.generation_defaults)
        inputs = [
            engine.chat_prompt([{"role": "user", "content": p}]) if args.chat else p for p in args.prompts
        ]
        if args.no_stream:

            async def one(i: int, prompt: str | list[int]) -> None:
                results[i] = await engine.generate_text(prompt, params, request_id=f"req-{i}")

            async with anyio.create_task_group() as tg:
                for i, prompt in enumerate(inputs):
                    tg.start_soon(one, i, prompt)
        else:
            await stream(engine, args.prompts, inputs, params, results, chat=args.chat)
        stats = engine.stats()
    return results, stats


async def stream(
    engine: Engine,
    prompts: list[str],
    inputs: list[str | list[int]],
    params: SamplingParams,
    results: list[Any],
    *,
    chat: bool,
) -> None:
    """Run every prompt at once; print their texts in order, each delta as soon as it is its turn."""
    channels: list[tuple[MemoryObjectSendStream[RequestOutput], MemoryObjectReceiveStream[RequestOutput]]]
    channels = [anyio.create_memory_object_stream(math.inf) for _ in inputs]

    async def produce(i: int) -> None:
        send = channels[i][0]
        with send:
            async for delta in engine.generate(inputs[i], params, request_id=f"req-{i}"):
                send.send_nowait(delta)

    async with anyio.create_task_group() as tg:
        for i in range(len(inputs)):
            tg.start_soon(produce, i)
        for i, (prompt, (_, receive)) in enumerate(zip(prompts, channels)):
            print(f"--- req-{i} ---")
            print("" if chat else prompt, end="", flush=True)
            text: list[str] = []
            ids: list[int] = []
            last: RequestOutput | None = None
            with receive:
                async for last in receive:
                    print(last.text, end="", flush=True)
                    text.append(last.text)
                    ids.extend(last.token_ids)
            if last is None:  # its request was refused: the producer's error ends the task group
                continue
            results[i] = SimpleNamespace(
                text="".join(text), token_ids=tuple(ids), finish_reason=last.finish_reason
            )
            print(f"\n--- req-{i} ({last.finish_reason}, {len(ids)} tokens) ---")


def figures_line(stats: Mapping[str, Any]) -> list[str]:
    """The HiSparse, speculative and throughput lines of ``stats`` (``Engine.stats()``: JSON-shaped
    figures)."""
    lines = []
    hs = stats.get("hisparse")
    if hs:
        hits, misses = sum(hs["hits"]), sum(hs["misses"])
        rate = hits / (hits + misses) if hits + misses else 1.0
        lines.append(
            f"hisparse: {hits} hits, {misses} misses (hit rate {rate:.1%}), "
            f"{sum(hs['h2d_bytes']) / 1e6:.2f} MB host->device, "
            f"{sum(hs['d2h_bytes']) / 1e6:.2f} MB device->host"
        )
    spec = stats.get("speculative")
    if spec and spec["verify_rounds"]:
        lines.append(
            f"speculative: {spec['verify_rounds']} verify rounds, accept length {spec['accept_length']:.2f}, "
            f"accept rate {spec['accept_rate']:.1%}"
        )
    elif spec:  # on, but its adaptive rule never found a round worth running (batch size, context, speed)
        lines.append("speculative: 0 verify rounds (every step decoded plainly by the adaptive rule)")
    tp = stats["throughput"]
    lines.append(
        f"throughput: {tp['tokens_generated']} tokens in {tp['uptime_s']:.2f}s "
        f"({tp['tokens_per_s']:.1f} tokens/s)"
    )
    return lines


def user_error(exc: BaseException) -> HispecError | None:
    """The hispec error a command reports in one line (unwrapped from a task group's group), or None."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, HispecError) else None


def main(argv: Sequence[str] | None = None, *, model: Any = None) -> int:
    """Entry point of ``hispec generate``; ``model`` replaces loading ``--model`` (tests)."""
    args = build_parser().parse_args(argv)
    if "-" in args.prompts:
        args.prompts = [sys.stdin.read() if p == "-" else p for p in args.prompts]
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)  # a tiny model runs best on one thread
    collector = Collector()
    quiet = not (args.log_json or args.verbose)
    sink = configure_logging(
        json=args.log_json or False, level="info", processors=[collector, *([drop] if quiet else [])]
    )
    try:
        results, stats = anyio.run(run, args, model)
    finally:
        sink.close()
    for i, (prompt, result) in enumerate(zip(args.prompts, results) if args.no_stream else ()):
        print(f"--- req-{i} ({result.finish_reason}, {len(result.token_ids)} tokens) ---")
        print(("" if args.chat else prompt) + result.text)
    print("\nlifecycle (seconds since each request arrived):")
    arrivals = {r["request_id"]: record_time(r) for r in collector.records if r["event"] == SUBMITTED}
    for rid, events in by_request(collector.records).items():
        print(f"  {rid}: {compact_trace(events, arrivals.get(rid))}")
    for line in figures_line(stats):
        print(f"  {line}")
    return 0
