"""``hispec bench serve``: streaming clients over HTTP beside the in-process engine, same prompts.

A ``hispec serve`` subprocess serves the model on 127.0.0.1; in this process, N concurrent clients
(httpx, streaming ``/v1/completions`` with token-id prompts, greedy, ``ignore_eos``) send the
requests, each client one request after another. Beside it, an ``Engine`` in this process, built
from the same configuration (the serve command line, parsed here too), runs the same prompts with N
concurrent consumers of ``engine.generate``. The two alternate round by round (HTTP first on even
repeats), so the machine's noise hits both alike.

Reported per concurrency (default 1, 8, 32 clients): requests/s and generated tokens/s over the
round (first request sent to last one done), the ratio server / in-process (the median of each
repeat's paired ratio), time to first token (request sent to its first streamed text) and
inter-token latency (the gap between successive streamed chunks, one per decode step or verify
round) at p50 and p99, and whether both produced the same text.

With ``--data-parallel-size N`` > 1 it measures routing instead (``serve_routing``): prefix-cache
hit rate and time to first token with cache-aware routing against round-robin, N replicas each.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import time
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from pipeline.benchmarks.common import completion_chunks, machine, table, write_json
from pipeline.logs import configure_logging

if TYPE_CHECKING:
    from pipeline.engine import Engine


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32], help="concurrent streaming clients")
    p.add_argument(
        "--requests", type=int, default=None, help="requests per round (default: 2 per client, >= 8)"
    )
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (ignore_eos)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="tiny", help="'tiny' (bundled) or an HF-format directory")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--hot", type=int, default=64, help="HiSparse hot columns per request")
    p.add_argument("--no-spec", action="store_true")
    p.add_argument("--no-hisparse", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both sides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-serve.json")
    routing = p.add_argument_group(
        "data parallel", "with --data-parallel-size N > 1: cache-aware routing against round-robin over N "
        "replicas, on conversations sharing system prompts (pipeline/benchmarks/serve_routing.py)",
    )
    routing.add_argument("--data-parallel-size", "--dp", type=int, default=1, metavar="N")
    routing.add_argument("--system-prompts", type=int, default=8, help="distinct system prompts")
    routing.add_argument("--system-len", type=int, default=512, help="tokens of each system prompt")
    routing.add_argument("--conversations", type=int, default=24)
    routing.add_argument("--turns", type=int, default=4, help="requests per conversation")
    routing.add_argument("--user-len", type=int, default=32, help="tokens of each user message")
    return p


def serve_argv(args: argparse.Namespace) -> list[str]:
    """The ``hispec serve`` options of the benchmarked server (parsed here too, for the engine side)."""
    argv = [
        "--port",
        "0",
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--hot",
        str(args.hot),
        "--max-context-len",
        str(args.prompt_len + args.max_tokens + 16),
        "--max-running-requests",
        str(max(args.clients)),
        "--threads",
        str(args.threads),
        "--seed",
        str(args.seed),
        "--served-model-name",
        "bench",
    ]
    return argv + (["--no-spec"] if args.no_spec else []) + (["--no-hisparse"] if args.no_hisparse else [])


class Record:
    """One request's timings (perf_counter seconds) and output."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.chunk_times: list[float] = []
        self.text: list[str] = []
        self.num_tokens = 0
        self.done = 0.0

    def chunk(self, text: str) -> None:
        if text:
            self.chunk_times.append(time.perf_counter())
            self.text.append(text)


async def http_request(client, prompt: list[int], max_tokens: int) -> Record:
    record = Record()
    async for chunk in completion_chunks(client, prompt, max_tokens):
        if chunk.get("usage"):
            record.num_tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices", ()):
            record.chunk(choice["text"])
    record.done = time.perf_counter()
    return record


async def engine_request(engine: Engine, prompt: list[int], max_tokens: int) -> Record:
    from pipeline.sampling import SamplingParams

    record = Record()
    stream = engine.generate(prompt, SamplingParams(max_new_tokens=max_tokens, ignore_eos=True))
    async with aclosing(stream) as deltas:
        async for delta in deltas:
            record.chunk(delta.text)
            record.num_tokens += len(delta.token_ids)
    record.done = time.perf_counter()
    return record


async def run_round(
    send, prompts: list[list[int]], clients: int, max_tokens: int
) -> tuple[float, list[Record]]:
    """``clients`` workers take the prompts in order, one request at a time each; (seconds, records)."""
    records: list[Record | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))

    async def worker() -> None:
        for i in next_index:
            records[i] = await send(prompts[i], max_tokens)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(clients):
            tg.start_soon(worker)
    seconds = time.perf_counter() - start
    done = [r for r in records if r is not None]
    assert len(done) == len(records), "every prompt was sent"
    return seconds, done


def summary(seconds: float, records: list[Record]) -> dict[str, float]:
    ttft = [r.chunk_times[0] - r.sent for r in records if r.chunk_times]
    itl = [b - a for r in records for a, b in zip(r.chunk_times, r.chunk_times[1:])]

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    return {
        "requests_per_s": len(records) / seconds,
        "tokens_per_s": sum(r.num_tokens for r in records) / seconds,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
    }


def start_server(argv: list[str]) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "pipeline.cli", "serve", *argv]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None  # (stdout=PIPE)
    for line in proc.stdout:
        if "listening on" in line:
            return proc, line.split("listening on ")[1].split()[0]
    raise RuntimeError(f"hispec serve did not start (exit status {proc.wait()})")


async def measure(args: argparse.Namespace, url: str) -> list[dict[str, Any]]:
    import httpx

    from pipeline.benchmarks.engine import prompts_for
    from pipeline.engine import Engine
    from pipeline.server.serve import build_parser as serve_parser
    from pipeline.server.serve import engine_config

    cfg = engine_config(serve_parser().parse_args(serve_argv(args)))
    rows = []
    limits = httpx.Limits(
        max_connections=max(args.clients) + 4, max_keepalive_connections=max(args.clients) + 4
    )
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client, Engine(cfg) as engine:
        sides = {
            "server": lambda p, n: http_request(client, p, n),
            "engine": lambda p, n: engine_request(engine, p, n),
        }
        warm_up = prompts_for(argparse.Namespace(prompt_len=args.prompt_len, seed=args.seed + 1), 1)[0]
        for send in sides.values():  # first calls pay one-off costs (allocations, lazy imports)
            await send(warm_up, args.max_tokens)
        for clients in args.clients:
            count = args.requests or max(8, 2 * clients)
            prompts = prompts_for(argparse.Namespace(prompt_len=args.prompt_len, seed=args.seed), count)
            runs: dict[str, list[dict[str, float]]] = {"server": [], "engine": []}
            same = True
            for repeat in range(args.repeats):
                texts = {}
                for side in ("server", "engine") if repeat % 2 == 0 else ("engine", "server"):
                    seconds, records = await run_round(sides[side], prompts, clients, args.max_tokens)
                    runs[side].append(summary(seconds, records))
                    texts[side] = ["".join(r.text) for r in records]
                same &= texts["server"] == texts["engine"]
            paired = [s["tokens_per_s"] / e["tokens_per_s"] for s, e in zip(runs["server"], runs["engine"])]
            rows.append(
                {
                    "clients": clients,
                    "requests": count,
                    "runs": runs,
                    "same_text": same,
                    "ratio": float(np.median(paired)),
                    "ratio_min_max": [min(paired), max(paired)],
                    **{
                        f"{side}_{key}": float(np.median([r[key] for r in runs[side]]))
                        for side in runs
                        for key in runs[side][0]
                    },
                }
            )
    return rows


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.data_parallel_size > 1:
        from pipeline.benchmarks import serve_routing

        if args.clients == build_parser().get_default("clients"):
            args.clients = [8]
        if len(args.clients) != 1:
            raise ValueError("--clients: give one count with --data-parallel-size")
        args.clients = args.clients[0]
        if args.out == build_parser().get_default("out"):
            args.out = "bench-serve-routing.json"
        return serve_routing.main(args, start_server)
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    sink = configure_logging(level="warning", stream=io.StringIO())
    proc, url = start_server(serve_argv(args))
    try:
        rows = anyio.run(measure, args, url)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        sink.close()
    report = {
        "bench": "serve",
        "machine": machine(),
        "model": args.model,
        "dtype": args.dtype,
        "speculative": not args.no_spec,
        "hisparse": not args.no_hisparse,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "rows": rows,
    }
    write_json(args.out, report)
    spec = "speculative (3 steps)" if report["speculative"] else "plain"
    mode = f"{spec}, HiSparse {'on' if report['hisparse'] else 'off'}"
    print(
        f"model {args.model} {args.dtype}, {mode}, prompts of {args.prompt_len} tokens, "
        f"{args.max_tokens} new tokens, median of {args.repeats}, {torch.get_num_threads()} threads"
    )
    ms = 1000.0
    print(
        table(
            [
                "clients",
                "requests",
                "server req/s",
                "server tokens/s",
                "engine tokens/s",
                "server / engine",
                "range",
                "TTFT p50 / p99 ms (server)",
                "TTFT p50 / p99 ms (engine)",
                "ITL p50 / p99 ms (server)",
                "ITL p50 / p99 ms (engine)",
                "same text",
            ],
            [
                [
                    r["clients"],
                    r["requests"],
                    r["server_requests_per_s"],
                    r["server_tokens_per_s"],
                    r["engine_tokens_per_s"],
                    r["ratio"],
                    "{:.2f}-{:.2f}".format(*r["ratio_min_max"]),
                    f"{r['server_ttft_p50_s'] * ms:.1f} / {r['server_ttft_p99_s'] * ms:.1f}",
                    f"{r['engine_ttft_p50_s'] * ms:.1f} / {r['engine_ttft_p99_s'] * ms:.1f}",
                    f"{r['server_itl_p50_s'] * ms:.1f} / {r['server_itl_p99_s'] * ms:.1f}",
                    f"{r['engine_itl_p50_s'] * ms:.1f} / {r['engine_itl_p99_s'] * ms:.1f}",
                    "yes" if r["same_text"] else "NO",
                ]
                for r in rows
            ],
        )
    )
    return 0
