"""``hispec bench policy``: HiSparse replacement policies on recorded top-k traces, and end to end.

1. **Traces**: the bundled model serves ``--requests`` held-out prompts at each ``--contexts``
   length with plain decoding and with speculative decoding (``--num-steps``), recording every
   top-k selection (``docs/topk-trace.md``). A trace does not depend on the cache (HiSparse never
   changes what the indexer selects), so one trace serves every HOT and policy.
2. **Replay**: each trace at each ``--hots``, every policy side by side with Belady's MIN as the
   floor (``hispec replay``): misses, host->device bytes, and each policy's misses / MIN's.
3. **End to end**: the engine decodes the longest context plainly at ``--engine-hot``, LRU beside
   the online policy with the fewest replayed misses, repeat by repeat alternately: output tokens
   (identical), misses, host->device bytes and decode tokens/s (prefill excluded).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import attrs

from kernels.swap_in_policy import POLICIES
from pipeline import cli_config
from pipeline.benchmarks.common import Timer, add_common_args, held_out_prompts, machine, median, setup, table
from pipeline.benchmarks.common import write_json as _write_json
from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import SyncDriver, prefill_whole
from pipeline.executor import Executor, NewSequence
from pipeline.hisparse.replay import ALL_POLICIES, replay
from pipeline.hisparse.trace import read_header, read_trace
from pipeline.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)


def config(
    args: argparse.Namespace, context: int, *, hot: int, policy: str, num_steps: int | None
) -> EngineConfig:
    page = 16
    max_context = context + args.new_tokens + 2 * page
    pool = -(-(max_context + 2 * page) // page) * page * args.requests
    return cli_config.engine_config(
        args,
        page_size=page,
        max_context_len=max_context,
        max_running_requests=args.requests,
        device_pool_tokens=pool,
        hisparse=HiSparseConfig(device_buffer_size=hot, host_to_device_ratio=2, policy=policy),
        # rounds at any batch size and context: the speculative traces are there to record verify steps
        # (the default rule on a CPU keeps rounds to a request alone within 1,024 tokens)
        speculative=SpeculativeConfig(num_steps=num_steps, max_batch_size=None, max_context=None)
        if num_steps
        else None,
    )


def record(
    args: argparse.Namespace, model, context: int, num_steps: int | None, hot: int, path: Path
) -> None:
    """Serve the prompts of one context to the end, recording the trace at ``path``."""
    cfg = config(args, context, hot=hot, policy="lru", num_steps=num_steps)
    executor = Executor(cfg, model=model, trace_path=str(path))
    try:
        prompts = held_out_prompts(args.requests, context, args.seed)
        SyncDriver(executor).generate(
            prompts, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        )
    finally:
        executor.close()


@attrs.frozen
class EngineRun:
    seconds: float
    tokens: dict[str, list[int]]  # request -> output tokens
    misses: list[int]  # per layer, during the decode
    h2d_bytes: list[int]


def engine_run(executor: Executor, prompts: list[list[int]], new_tokens: int, tag: str) -> EngineRun:
    """Prefill and stage (untimed), then ``new_tokens`` timed plain decode steps of the whole batch."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    prefill_whole(executor, [NewSequence(rid, tuple(p), GREEDY) for rid, p in zip(ids, prompts)])
    executor.wait_staging()
    # every request ready (in staging order: a short prompt may finish its prefill before a long one)
    assert sorted(executor.collect_ready()) == sorted(ids)
    before: dict[str, Any] | None = executor.memory.counters_dict()  # JSON-shaped
    assert before is not None  # (HiSparse)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    with Timer() as timer:
        for _ in range(new_tokens):
            result = executor.decode(ids)
            assert not result.refused, "the benchmark's pools are too small"
            for rid, new in result.tokens.items():
                tokens[rid].extend(new)
    after: dict[str, Any] | None = executor.memory.counters_dict()
    assert after is not None
    for rid in ids:
        executor.release(rid)
    delta = {key: [b - a for a, b in zip(before[key], after[key])] for key in ("misses", "h2d_bytes")}
    return EngineRun(
        timer.seconds,
        {rid.rsplit("-", 1)[1]: t for rid, t in tokens.items()},
        delta["misses"],
        delta["h2d_bytes"],
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hispec bench policy", description=__doc__.split("\n\n")[0])
    add_common_args(parser, "bench-policy.json")
    parser.add_argument(
        "--contexts",
        default="1024,3584",
        help="prompt lengths in tokens, comma-separated "
        "(the bundled model has 4096 positions: prompt + new tokens + 32 must fit)",
    )
    parser.add_argument("--hots", default="128,256,512", help="HOT values to replay at, comma-separated")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--num-steps", type=int, default=3, help="draft steps of the speculative traces")
    parser.add_argument("--engine-hot", type=int, default=128, help="HOT of the end-to-end runs")
    parser.add_argument("--engine-new-tokens", type=int, default=None, help="default: --new-tokens")
    parser.add_argument(
        "--trace-dir", default=None, help="keep the traces here (default: a temporary folder)"
    )
    args = parser.parse_args(argv)
    threads = setup(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    hots = [int(h) for h in args.hots.split(",")]
    if args.engine_hot not in hots:
        hots.append(args.engine_hot)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.trace_dir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        base = Executor(config(args, max(contexts), hot=min(hots), policy="lru", num_steps=None))
        model = base.model
        base.close()
        replays = []
        for context in contexts:
            for mode, steps in (("plain", None), ("speculative", args.num_steps)):
                path = folder / f"topk-{context}-{mode}.jsonl"
                record(args, model, context, steps, min(hots), path)
                records, header = read_trace(path), read_header(path)
                for hot in hots:
                    row_bytes, top_k = header["row_bytes"], header["top_k"]
                    assert isinstance(row_bytes, int) and isinstance(top_k, int), "an engine trace's header"
                    result = replay(records, hot, row_bytes=row_bytes, top_k=top_k)
                    replays.append({"context": context, "mode": mode, **result.as_dict()})
        best = _best_online(replays)
        e2e = end_to_end(args, model, max(contexts), best)
    report = {
        "bench": "policy",
        "machine": machine(),
        "model": args.model,
        "dtype": args.dtype,
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "num_steps": args.num_steps,
        "threads": threads,
        "repeats": args.repeats,
        "replays": replays,
        "best_online": best,
        "end_to_end": e2e,
    }
    _write_json(args.out, report)
    print_report(report)
    return 0


def _best_online(replays: list[dict]) -> str:
    """The online policy with the fewest misses over every replay (LRU when none does better)."""
    totals = {p: sum(r["policies"][p]["misses"] for r in replays) for p in POLICIES}
    best = min(POLICIES, key=lambda p: (totals[p], p != "lru"))
    return best


def end_to_end(args: argparse.Namespace, model, context: int, best: str) -> dict[str, Any]:
    """LRU, the engine's default on this device (``HiSparseConfig.policy="auto"``) and the best
    online policy of the replays, each in its own executor, the order rotating repeat by repeat."""
    default = HiSparseConfig().policy_for(model.device.type)
    policies = list(dict.fromkeys(["lru", default, best]))
    executors = {
        p: Executor(config(args, context, hot=args.engine_hot, policy=p, num_steps=None), model=model)
        for p in policies
    }
    prompts = held_out_prompts(args.requests, context, args.seed)
    new_tokens = args.engine_new_tokens or args.new_tokens
    runs: dict[str, list[EngineRun]] = {p: [] for p in policies}
    try:
        for repeat in range(args.repeats):
            shift = repeat % len(policies)  # each policy runs first, second, ... in turn
            for p in policies[shift:] + policies[:shift]:
                runs[p].append(engine_run(executors[p], prompts, new_tokens, f"{p}{repeat}"))
    finally:
        for executor in executors.values():
            executor.close()
    last = {p: rs[-1] for p, rs in runs.items()}
    return {
        "context": context,
        "hot": args.engine_hot,
        "default": default,
        "new_tokens": new_tokens,
        "tokens_identical": all(r.tokens == last["lru"].tokens for rs in runs.values() for r in rs),
        "policies": {
            p: {
                "misses": sum(last[p].misses),
                "h2d_bytes": sum(last[p].h2d_bytes),
                "decode_tokens_per_s": median([new_tokens * args.requests / r.seconds for r in rs]),
            }
            for p, rs in runs.items()
        },
    }


def print_report(r: dict) -> None:
    print(
        f"model {r['model']} {r['dtype']}, {r['requests']} requests, {r['new_tokens']} new tokens, "
        f"speculative num_steps {r['num_steps']}, {r['threads']} threads"
    )
    names = [p for p in ALL_POLICIES if p in r["replays"][0]["policies"]] if r["replays"] else []
    rows = []
    for rep in r["replays"]:
        pol = rep["policies"]
        rows.append(
            [
                rep["context"],
                rep["mode"],
                rep["hot"],
                *[pol[p]["misses"] for p in names],
                *[round(pol[p]["over_min"], 3) for p in names if p != "min"],
            ]
        )
    head = [
        "context",
        "mode",
        "HOT",
        *[f"{p} misses" for p in names],
        *[f"{p} / MIN" for p in names if p != "min"],
    ]
    print(table(head, rows))
    e2e = r["end_to_end"]
    print(
        f"\nend to end: context {e2e['context']}, HOT {e2e['hot']}, {e2e['new_tokens']} new tokens, "
        f"plain decoding, median of {r['repeats']}; tokens identical: {e2e['tokens_identical']}"
    )

    def label(p: str) -> str:
        marks = [
            m
            for m, q in (("default", e2e.get("default")), ("fewest replayed misses", r["best_online"]))
            if q == p
        ]
        return f"{p} ({', '.join(marks)})" if marks else p

    rows = [
        [label(p), v["misses"], round(v["h2d_bytes"] / 1e6, 3), v["decode_tokens_per_s"]]
        for p, v in e2e["policies"].items()
    ]
    print(table(["policy", "misses", "host->device MB", "decode tokens/s"], rows))
