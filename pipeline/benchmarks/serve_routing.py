"""``hispec bench serve --data-parallel-size N``: cache-aware routing against round-robin.

Two ``hispec serve --data-parallel-size N`` subprocesses serve the same model, one routing with
``cache_aware``, the other ``round_robin``. The workload is many conversations over a few long system
prompts: each conversation picks one of ``--system-prompts`` prompts of ``--system-len`` tokens and
sends ``--turns`` turns, each turn's prompt the previous one's plus an assistant reply and a new user
message (``--user-len`` tokens each), greedy, ``ignore_eos``, ``--max-tokens`` new tokens.
``--clients`` concurrent clients take the conversations in order, one conversation at a time each.
Every repeat draws new system prompts (no server starts a round with them cached) and runs both
servers, alternating which goes first.

Reported per policy (median over the repeats): the prefix-cache hit rate (prompt tokens the servers
report as cached over prompt tokens sent, from each response's usage), time to first token (request
sent to its first streamed text) at p50 and p99, and requests/s over the round.
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np

from pipeline.benchmarks.common import completion_chunks, machine, table, write_json
from pipeline.logs import configure_logging

POLICIES = ("cache_aware", "round_robin")


def conversations(args: argparse.Namespace, seed: int) -> list[list[list[int]]]:
    """Each conversation's turns' prompts (token ids in [1, 250])."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(1, 251, args.system_len).tolist() for _ in range(args.system_prompts)]
    chats = []
    for c in range(args.conversations):
        prompt = list(systems[c % args.system_prompts])
        turns = []
        for turn in range(args.turns):
            if turn:
                prompt += rng.integers(1, 251, args.max_tokens).tolist()  # the assistant's reply
            prompt += rng.integers(1, 251, args.user_len).tolist()
            turns.append(list(prompt))
        chats.append(turns)
    return chats


def context_len(args: argparse.Namespace) -> int:
    """The longest prompt and its output."""
    return args.system_len + args.turns * (args.user_len + args.max_tokens) + args.max_tokens


class Turn:
    """One request's timings (perf_counter seconds) and usage."""

    def __init__(self) -> None:
        self.sent = time.perf_counter()
        self.first: float | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0


async def send_turn(client: Any, prompt: list[int], max_tokens: int) -> Turn:
    turn = Turn()
    async for chunk in completion_chunks(client, prompt, max_tokens):
        if chunk.get("usage"):
            turn.prompt_tokens = chunk["usage"]["prompt_tokens"]
            details = chunk["usage"].get("prompt_tokens_details") or {}
            turn.cached_tokens = details.get("cached_tokens") or 0
        if turn.first is None and any(c["text"] for c in chunk.get("choices", ())):
            turn.first = time.perf_counter()
    return turn


async def run_round(
    client: Any, chats: list[list[list[int]]], clients: int, max_tokens: int
) -> dict[str, float]:
    turns: list[Turn] = []
    next_chat = iter(chats)

    async def worker() -> None:
        for chat in next_chat:
            for prompt in chat:
                turns.append(await send_turn(client, prompt, max_tokens))

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(clients):
            tg.start_soon(worker)
    seconds = time.perf_counter() - start
    ttft = [t.first - t.sent for t in turns if t.first is not None]
    return {
        "hit_rate": sum(t.cached_tokens for t in turns) / max(1, sum(t.prompt_tokens for t in turns)),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "requests_per_s": len(turns) / seconds,
    }


def serve_argv(args: argparse.Namespace, policy: str) -> list[str]:
    argv = [
        "--port", "0", "--model", args.model, "--dtype", args.dtype, "--hot", str(args.hot),
        "--max-context-len", str(context_len(args)), "--max-running-requests", str(args.clients),
        "--threads", str(args.threads), "--seed", str(args.seed), "--served-model-name", "bench",
        "--data-parallel-size", str(args.data_parallel_size), "--router-policy", policy,
    ]  # fmt: skip
    return argv + (["--no-spec"] if args.no_spec else []) + (["--no-hisparse"] if args.no_hisparse else [])


async def measure(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, list[dict[str, float]]]:
    import httpx

    runs: dict[str, list[dict[str, float]]] = {policy: [] for policy in POLICIES}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        warm_up = conversations(argparse.Namespace(**{**vars(args), "conversations": 2}), args.seed + 10_000)
        for url in urls.values():  # first calls pay one-off costs (allocations, lazy imports)
            client.base_url = httpx.URL(url)
            await run_round(client, warm_up, 2, args.max_tokens)
        for repeat in range(args.repeats):
            chats = conversations(args, args.seed + repeat)
            for policy in POLICIES if repeat % 2 == 0 else POLICIES[::-1]:
                client.base_url = httpx.URL(urls[policy])
                runs[policy].append(await run_round(client, chats, args.clients, args.max_tokens))
    return runs


def main(args: argparse.Namespace, start_server: Callable[[list[str]], tuple[Any, str]]) -> int:
    """Run the comparison; ``start_server(argv)`` starts one ``hispec serve`` (its process, its URL)."""
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    sink = configure_logging(level="warning", stream=io.StringIO())
    procs = []
    try:
        urls = {}
        for policy in POLICIES:
            proc, urls[policy] = start_server(serve_argv(args, policy))
            procs.append(proc)
        runs = anyio.run(measure, args, urls)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=120)
        sink.close()
    medians = {
        policy: {key: float(np.median([r[key] for r in runs[policy]])) for key in runs[policy][0]}
        for policy in POLICIES
    }
    report = {
        "bench": "serve-routing",
        "machine": machine(),
        "model": args.model,
        "dtype": args.dtype,
        "data_parallel_size": args.data_parallel_size,
        "workload": {
            key: getattr(args, key)
            for key in (
                "system_prompts",
                "system_len",
                "conversations",
                "turns",
                "user_len",
                "max_tokens",
                "clients",
            )
        },
        "repeats": args.repeats,
        "runs": runs,
        "medians": medians,
    }
    write_json(args.out, report)
    print(
        f"model {args.model} {args.dtype}, {args.data_parallel_size} replicas, "
        f"{args.conversations} conversations x {args.turns} turns over {args.system_prompts} system "
        f"prompts of {args.system_len} tokens, "
        f"{args.clients} clients, median of {args.repeats}, {torch.get_num_threads()} threads"
    )
    ms = 1000.0
    print(
        table(
            ["policy", "prefix-cache hit rate", "TTFT p50 ms", "TTFT p99 ms", "req/s"],
            [
                [
                    policy,
                    f"{m['hit_rate']:.1%}",
                    f"{m['ttft_p50_s'] * ms:.1f}",
                    f"{m['ttft_p99_s'] * ms:.1f}",
                    f"{m['requests_per_s']:.2f}",
                ]
                for policy, m in medians.items()
            ],
        )
    )
    return 0
