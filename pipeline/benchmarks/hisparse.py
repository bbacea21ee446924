"""``hispec bench hisparse``: HiSparse decode beside all-resident decode, in one run.

For held-out prompts of at least 8x HOT tokens it reports, per mode: decode tokens/s (prefill
excluded), device KV bytes per request at the end of the decode; for HiSparse also the hit rate per
layer, host->device bytes per decoded token, and two checks of the design's claims: device KV rows
per request <= HOT + page_size whatever the context, and host->device bytes == unique misses x row
bytes. Modes alternate, repeat by repeat (the order reversed every other repeat), so machine noise
hits both alike; the throughput ratio is paired repeat by repeat (median and range).
"""

from __future__ import annotations

import argparse
from typing import Any

import attrs

from pipeline import cli_config
from pipeline.benchmarks.common import (
    Timer,
    add_common_args,
    held_out_prompts,
    machine,
    median,
    setup,
    table,
    write_json,
)
from pipeline.config import EngineConfig, HiSparseConfig
from pipeline.driver import prefill_whole
from pipeline.executor import Executor, NewSequence
from pipeline.hisparse.coordinator import HiSparseCoordinator
from pipeline.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)


@attrs.frozen
class DecodeRun:
    seconds: float
    tokens: int
    device_kv_bytes: list[int]  # per request, at the end
    hits: list[int]  # per layer, during the decode
    misses: list[int]
    h2d_bytes: list[int]


def decode_run(executor: Executor, prompts: list[list[int]], new_tokens: int, tag: str) -> DecodeRun:
    """Prefill and stage (untimed), then ``new_tokens`` timed decode steps of the whole batch."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    prefill_whole(executor, [NewSequence(rid, tuple(p), GREEDY) for rid, p in zip(ids, prompts)])
    executor.wait_staging()
    # every request ready (in staging order: a short prompt may finish its prefill before a long one)
    assert sorted(executor.collect_ready()) == sorted(ids)
    counters: dict[str, Any] | None = executor.memory.counters_dict()  # JSON-shaped
    with Timer() as timer:
        for _ in range(new_tokens):
            result = executor.decode(ids)
            assert not result.refused, "the benchmark's pools are too small"
    after: dict[str, Any] | None = executor.memory.counters_dict()
    kv_bytes = [executor.memory.device_kv_bytes(executor.seqs[rid].row) for rid in ids]
    for rid in ids:
        executor.release(rid)

    def delta(key: str) -> list[int]:
        if counters is None or after is None:
            return []
        return [b - a for a, b in zip(counters[key], after[key])]

    return DecodeRun(
        timer.seconds, new_tokens * len(ids), kv_bytes, delta("hits"), delta("misses"), delta("h2d_bytes")
    )


def configs(args: argparse.Namespace) -> dict[str, EngineConfig]:
    common = dict(max_context_len=args.prompt_len + args.new_tokens + 8, max_running_requests=args.batch,
                  speculative=None)
    pool = (args.prompt_len + args.new_tokens + 64) * args.batch
    pool = -(-pool // args.page_size) * args.page_size
    return {
        "resident": cli_config.engine_config(args, **common, device_pool_tokens=pool, hisparse=None),
        "hisparse": cli_config.engine_config(
            args,
            **common,
            device_pool_tokens=pool,
            hisparse=HiSparseConfig(device_buffer_size=args.hot, host_to_device_ratio=2),
        ),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hispec bench hisparse", description=__doc__)
    add_common_args(parser, "bench-hisparse.json")
    parser.add_argument("--hot", type=int, default=128, help="device_buffer_size (HOT)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=2048, help="tokens; at least 8 x HOT")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args(argv)
    threads = setup(args.threads)
    if args.prompt_len < 8 * args.hot:
        parser.error("--prompt-len must be at least 8 x --hot")
    executors = {name: Executor(cfg) for name, cfg in configs(args).items()}
    model = executors["resident"].model
    executors["hisparse"] = Executor(configs(args)["hisparse"], model=model)  # one copy of the weights
    prompts = held_out_prompts(args.batch, args.prompt_len, args.seed)
    for name, executor in executors.items():  # untimed: first calls (the compiled swap-in's loading)
        decode_run(executor, [prompts[0][: 2 * args.hot]], 2, f"warm-{name}")
    runs: dict[str, list[DecodeRun]] = {name: [] for name in executors}
    names = list(executors)
    for repeat in range(args.repeats):  # the order reversed every other repeat
        for name in names if repeat % 2 == 0 else names[::-1]:
            runs[name].append(decode_run(executors[name], prompts, args.new_tokens, f"{name}{repeat}"))
    report = summarize(runs, executors, args, threads)
    write_json(args.out, report)
    print_report(report)
    for executor in executors.values():
        executor.close()
    return 0


def summarize(runs: dict[str, list[DecodeRun]], executors: dict[str, Executor], args, threads: int) -> dict:
    cfg = executors["hisparse"].model.cfg
    coord = executors["hisparse"].memory
    assert isinstance(coord, HiSparseCoordinator)
    row_bytes = coord.host.row_bytes
    last = runs["hisparse"][-1]
    per_layer_rows = cfg.kv_row_dim * coord.device_kv.element_size()
    tps = {name: median([r.tokens / r.seconds for r in rs]) for name, rs in runs.items()}
    paired = sorted(
        (h.tokens / h.seconds) / (r.tokens / r.seconds) for h, r in zip(runs["hisparse"], runs["resident"])
    )
    return {
        "bench": "hisparse",
        "machine": machine(),
        "model": args.model,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "batch": args.batch,
        "hot": args.hot,
        "page_size": args.page_size,
        "layers": cfg.num_hidden_layers,
        "row_bytes": row_bytes,
        "tokens_per_s": tps,
        # paired repeat by repeat: median and range
        "hisparse_over_resident": median(paired),
        "hisparse_over_resident_range": [paired[0], paired[-1]],
        "device_kv_bytes_per_request": {name: rs[-1].device_kv_bytes[0] for name, rs in runs.items()},
        "device_kv_rows_per_request": {
            name: rs[-1].device_kv_bytes[0] // (per_layer_rows * cfg.num_hidden_layers)
            for name, rs in runs.items()
        },
        "hit_rate_per_layer": [h / (h + m) if h + m else 1.0 for h, m in zip(last.hits, last.misses)],
        "misses_per_layer": last.misses,
        "h2d_bytes_per_token": sum(last.h2d_bytes) / last.tokens,
        "h2d_equals_misses_times_row": all(b == m * row_bytes for b, m in zip(last.h2d_bytes, last.misses)),
        "device_rows_within_hot_plus_page": all(
            b // (per_layer_rows * cfg.num_hidden_layers) <= args.hot + args.page_size
            for b in last.device_kv_bytes
        ),
        "threads": threads,
        "repeats": args.repeats,
    }


def print_report(r: dict) -> None:
    print(
        f"model {r['model']} {r['dtype']}, prompt {r['prompt_len']} tokens (>= 8 x HOT {r['hot']}), "
        f"{r['new_tokens']} new tokens, batch {r['batch']}, {r['threads']} threads, median of {r['repeats']}"
    )
    rows = [
        [
            name,
            r["tokens_per_s"][name],
            r["device_kv_rows_per_request"][name],
            r["device_kv_bytes_per_request"][name],
        ]
        for name in ("resident", "hisparse")
    ]
    print(table(["mode", "decode tokens/s", "device KV rows/request", "device KV bytes/request"], rows))
    low, high = r["hisparse_over_resident_range"]
    print(f"HiSparse / resident decode throughput: {r['hisparse_over_resident']:.3f} "
          f"(paired repeat by repeat; range {low:.3f}-{high:.3f})")
    print("hit rate per layer: " + ", ".join(f"{h:.3f}" for h in r["hit_rate_per_layer"]))
    print(
        f"host->device bytes per decoded token: {r['h2d_bytes_per_token']:.1f} "
        f"(== unique misses x {r['row_bytes']} B: {r['h2d_equals_misses_times_row']})"
    )
    print(f"device KV rows per request <= HOT + page_size: {r['device_rows_within_hot_plus_page']}")
