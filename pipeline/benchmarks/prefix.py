"""``hispec bench prefix``: prefix caching on beside off, on two workloads that repeat prefixes.

1. **Shared system prompt**: a ``--prefix``-token prefix common to every request, each with its own
   ``--suffix``-token question. One request warms the cache; then ``--requests`` requests arrive one
   after another. Reported: time to first token (median), throughput, hit rate.
2. **Multi-turn chat**: ``--chats`` conversations of ``--turns`` turns run concurrently, each opening with the
   same ``--system``-token system prompt; each turn resends the whole conversation (the system prompt, its
   earlier messages and answers) plus a new ``--user``-token message. Reported: output tokens per second over
   the whole workload, mean time to first token, hit rate.

Each workload runs with the cache on and off in one process, alternating which goes first repeat by
repeat; ratios are the median of each repeat's paired ratio, with their range. Greedy outputs must
be identical with the cache on and off; the report says whether they are.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import anyio

from pipeline import cli_config
from pipeline.benchmarks.common import held_out_prompts, machine, measured, setup, table, write_json
from pipeline.config import DEFAULT_POOL_TOKENS, EngineConfig, HiSparseConfig


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' (bundled) or an HF-format directory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prefix", type=int, default=1500, help="tokens of the shared system prompt")
    parser.add_argument("--suffix", type=int, default=100, help="tokens of each request's own part")
    parser.add_argument("--requests", type=int, default=4, help="requests after the warm-up")
    parser.add_argument("--chats", type=int, default=4, help="concurrent conversations")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=1024, help="tokens of the chats' system prompt")
    parser.add_argument("--user", type=int, default=64, help="tokens of each new user message")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--no-hisparse", action="store_true")
    parser.add_argument("--spec", action="store_true", help="MTP speculation on (default: plain decoding)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-prefix.json")
    parser.add_argument("-v", "--verbose", action="store_true", help="print an error's traceback too")


def config(args: argparse.Namespace, *, cache: bool) -> EngineConfig:
    from pipeline.config import SpeculativeConfig

    chat = args.system + args.turns * (args.user + args.new_tokens)
    context = max(args.prefix + args.suffix, chat) + args.new_tokens + 64
    return cli_config.engine_config(
        args,
        max_context_len=context,
        max_running_requests=max(args.chats, 2),
        device_pool_tokens=max(DEFAULT_POOL_TOKENS, -(-context // 16) * 16 * 2),
        hisparse=None if args.no_hisparse else HiSparseConfig(),
        speculative=SpeculativeConfig() if args.spec else None,
        prefix_cache=cache,
        num_threads=args.threads or None,
    )


def shared_prompt(model, cfg: EngineConfig, prefix: list[int], suffixes: list[list[int]], args) -> dict:
    from pipeline.engine import Engine
    from pipeline.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    out: dict[str, Any] = {}

    async def main() -> None:
        async with Engine(cfg, model=model) as engine:
            await engine.generate_text(prefix + suffixes[0], params)  # warms the cache (when on)
            ttft, outputs, hits, tokens = [], [], [], 0
            start = time.perf_counter()
            for suffix in suffixes[1:]:
                result = await engine.generate_text(prefix + suffix, params)
                ttft.append(measured(result.metrics.time_to_first_token))
                outputs.append(list(result.token_ids))
                hits.append(result.metrics.cached_tokens)
                tokens += len(result.token_ids)
            seconds = time.perf_counter() - start
            out.update(
                ttft=statistics.median(ttft),
                tokens_per_s=tokens / seconds,
                outputs=outputs,
                hit_rate=sum(hits) / sum(len(prefix) + len(s) for s in suffixes[1:]),
            )

    anyio.run(main)
    return out


def chat(model, cfg: EngineConfig, system: list[int], messages: list[list[list[int]]], args) -> dict:
    from pipeline.engine import Engine
    from pipeline.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    out: dict[str, Any] = {}

    async def main() -> None:
        async with Engine(cfg, model=model) as engine:
            outputs: list[list[list[int]]] = [[] for _ in messages]
            ttft: list[float] = []
            hits = queried = tokens = 0

            async def conversation(i: int) -> None:
                nonlocal hits, queried, tokens
                history: list[int] = list(system)
                for user in messages[i]:
                    prompt = history + user
                    result = await engine.generate_text(prompt, params)
                    outputs[i].append(list(result.token_ids))
                    ttft.append(measured(result.metrics.time_to_first_token))
                    hits += result.metrics.cached_tokens
                    queried += len(prompt)
                    tokens += len(result.token_ids)
                    history = prompt + list(result.token_ids)

            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(len(messages)):
                    tg.start_soon(conversation, i)
            seconds = time.perf_counter() - start
            out.update(
                tokens_per_s=tokens / seconds,
                ttft=statistics.mean(ttft),
                outputs=outputs,
                hit_rate=hits / queried,
            )

    anyio.run(main)
    return out


def paired(runs: dict[str, list[dict]], key: str, invert: bool = False) -> tuple[float, float, float]:
    ratios = [
        (off[key] / on[key]) if invert else (on[key] / off[key]) for on, off in zip(runs["on"], runs["off"])
    ]
    return statistics.median(ratios), min(ratios), max(ratios)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hispec bench prefix", description=__doc__.split("\n\n")[0])
    add_args(parser)
    args = parser.parse_args(argv)
    from pipeline.benchmarks.engine import load_or_random

    threads = setup(args.threads)
    model, note = load_or_random(args)
    prefix = held_out_prompts(1, args.prefix, args.seed)[0]
    suffixes = held_out_prompts(args.requests + 1, args.suffix, args.seed + 1)
    system = held_out_prompts(1, args.system, args.seed + 5)[0] if args.system else []
    messages = [held_out_prompts(args.turns, args.user, args.seed + 10 + i) for i in range(args.chats)]
    shared: dict[str, list[dict]] = {"on": [], "off": []}
    chats: dict[str, list[dict]] = {"on": [], "off": []}
    for repeat in range(args.repeats):
        for side in ("on", "off") if repeat % 2 == 0 else ("off", "on"):
            cfg = config(args, cache=side == "on")
            shared[side].append(shared_prompt(model, cfg, prefix, suffixes, args))
            chats[side].append(chat(model, cfg, system, messages, args))
    same = all(
        a["outputs"] == b["outputs"] for runs in (shared, chats) for a, b in zip(runs["on"], runs["off"])
    )
    ttft_ratio = paired(shared, "ttft")
    chat_ratio = paired(chats, "tokens_per_s")
    report = {
        "bench": "prefix",
        "machine": machine(),
        "note": note,
        "shared_prompt": {
            side: [{k: v for k, v in r.items() if k != "outputs"} for r in runs]
            for side, runs in shared.items()
        },
        "chat": {
            side: [{k: v for k, v in r.items() if k != "outputs"} for r in runs]
            for side, runs in chats.items()
        },
        "ttft_on_over_off": ttft_ratio,
        "chat_throughput_on_over_off": chat_ratio,
        "outputs_identical": same,
    }
    write_json(args.out, report)
    if note:
        print(f"note: {note}")
    med = statistics.median
    print(
        f"model {args.model} {args.dtype}, {threads} thread(s), "
        f"HiSparse {'off' if args.no_hisparse else 'on'}, {'speculative' if args.spec else 'plain'}, "
        f"{args.repeats} alternating repeats"
    )
    print(table(
        ["workload", "cache", "time to first token (s)", "tokens/s", "hit rate"],
        [[f"shared prefix {args.prefix} + {args.suffix}", side, med([r["ttft"] for r in shared[side]]),
          med([r["tokens_per_s"] for r in shared[side]]), f"{med([r['hit_rate'] for r in shared[side]]):.0%}"]
         for side in ("off", "on")]
        + [[f"chat {args.chats} x {args.turns} turns, system {args.system}", side,
            med([r["ttft"] for r in chats[side]]), med([r["tokens_per_s"] for r in chats[side]]),
            f"{med([r['hit_rate'] for r in chats[side]]):.0%}"]
           for side in ("off", "on")],
    ))  # fmt: skip
    print(
        f"time to first token, cache on / off: {ttft_ratio[0]:.2f} "
        f"(range {ttft_ratio[1]:.2f}-{ttft_ratio[2]:.2f}); "
        f"chat throughput on / off: {chat_ratio[0]:.2f} (range {chat_ratio[1]:.2f}-{chat_ratio[2]:.2f}); "
        f"same tokens: {'yes' if same else 'NO'}"
    )
    return 0
