"""``hispec bench kernels``: time each op and its achieved bandwidth beside plain ``torch`` copy bandwidth.

Not a test: nothing here asserts a speed. For every op and shape it reports the median time of one
call and the bytes the op must move (defined per op below; reads + writes), so ``bytes / time`` can
be compared with the bandwidth of ``dst.copy_(src)`` measured in the same run. On CUDA each op runs
both implementations (torch reference and Triton); on CPU only the reference (the engine's CPU path).

Results go to a JSON file (``--out``) and, as a markdown table, between the ``bench:begin`` /
``bench:end`` markers of ``docs/kernels.md`` only when asked (``--write-docs``): a benchmark never
rewrites a tracked file by default.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from kernels.indexer_topk import indexer_topk
from kernels.kv_copy import copy_rows
from kernels.sparse_mla import sparse_mla
from kernels.swap_in import swap_in

DOCS = Path(__file__).resolve().parents[2] / "docs" / "kernels.md"

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
F32 = 4
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@attrs.frozen
class Prepared:
    run: Callable[[str], object]  # impl -> one call
    reset: Callable[[], None]  # restores mutated state; not timed
    bytes_moved: int


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(run: Callable[[], object], reset: Callable[[], None], device: torch.device,
              budget_s: float = 0.4, max_reps: int = 50) -> float:
    """Median seconds of ``run`` after one warm-up; ``reset`` runs untimed before each call."""
    reset()
    run()
    times: list[float] = []
    spent = 0.0
    while len(times) < 3 or (spent < budget_s and len(times) < max_reps):
        reset()
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    return statistics.median(times)


def copy_bandwidth(device: torch.device, mib: int = 64) -> float:
    """Bytes/s (read + write) of a plain contiguous ``copy_`` of ``mib`` MiB."""
    src = torch.randn(mib * 2**20 // F32, device=device)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), lambda: None, device)
    return 2 * src.numel() * F32 / seconds


def _nothing() -> None:
    return None


def prep_indexer(device, dtype, *, tokens, heads, dim, ctx, top_k, prefill=False) -> Prepared:
    """Verify-like (4 neighbouring positions per request, each request's queries together, as the
    engine lays them out) or one prompt's prefill (``prefill``). Keys lie in pages of 16 locations
    in random order, as a paged pool holds them. Bytes: gathered keys + locations of every visible
    position, queries, weights, output."""
    reqs = 1 if prefill else max(1, tokens // 4)
    per = tokens // reqs
    size = dtype.itemsize
    q = torch.randn(tokens, heads, dim, device=device, dtype=dtype)
    w = torch.randn(tokens, heads, device=device, dtype=dtype)
    k = torch.randn(reqs * ctx, dim, device=device, dtype=dtype)
    page = 16 if ctx % 16 == 0 else 1
    pages = torch.randperm(reqs * ctx // page, device=device)
    r2t = (pages[:, None] * page + torch.arange(page, device=device)).view(reqs, ctx)
    rows = torch.arange(tokens, device=device) // per
    lens = ctx - (per - 1) + torch.arange(tokens, device=device) % per  # every query its own position
    moved = int(lens.sum()) * (dim * size + 8) + (q.numel() + w.numel()) * size + tokens * top_k * 4

    def run(impl):
        return indexer_topk(q, w, k, r2t, rows, lens, top_k, dim**-0.5, impl=impl, max_seq_len=ctx)

    return Prepared(run, _nothing, moved)


def prep_swap_in(device, dtype, *, reqs, steps, top_k, hot, extra, dim, ctx) -> Prepared:
    """About half of each step's entries miss. Bytes: KV rows copied (host read + device write)."""
    width = hot + extra
    g = torch.Generator().manual_seed(0)
    tokens = torch.full((reqs, width), -1, dtype=torch.int32)
    top = torch.empty(reqs, steps, top_k, dtype=torch.int32)
    for b in range(reqs):
        perm = torch.randperm(ctx - steps, generator=g).int()
        tokens[b, :hot] = perm[:hot]  # held positions
        for s in range(steps):
            held = perm[torch.randperm(hot, generator=g)[: top_k // 2]]
            fresh = perm[hot + torch.randperm(ctx - steps - hot, generator=g)[: top_k - top_k // 2]]
            top[b, s] = torch.cat([held, fresh])
    locs = torch.arange(reqs * width).view(reqs, width)
    host_map = torch.arange(reqs * ctx).view(reqs, ctx)
    lru0 = torch.stack([torch.randperm(hot, generator=g) for _ in range(reqs)]).int()
    lens = (ctx - steps + 1 + torch.arange(steps)).expand(reqs, steps).contiguous()
    host_dev = device if device.type == "cpu" else torch.device("cpu")
    host_kv = torch.randn(reqs * ctx, dim, device=host_dev, dtype=dtype)
    if host_dev != device:
        host_kv = host_kv.pin_memory()
    device_kv = torch.randn(reqs * width, dim, device=device, dtype=dtype)
    t = {name: v.to(device) for name, v in dict(top=top, lens=lens, tokens=tokens, locs=locs, lru=lru0,
                                                host_map=host_map).items()}
    live_tokens, live_lru = t["tokens"].clone(), t["lru"].clone()
    rows = torch.arange(reqs, device=device)

    def reset():
        live_tokens.copy_(t["tokens"])
        live_lru.copy_(t["lru"])

    def run(impl):
        return swap_in(t["top"], t["lens"], rows, live_tokens, t["locs"], live_lru, t["host_map"], host_kv,
                       device_kv, hot, impl=impl)

    reset()
    misses = int(run("torch").misses.sum())
    return Prepared(run, reset, 2 * misses * dim * dtype.itemsize)


def prep_sparse_mla(device, dtype, *, tokens, heads, latent, rope, top_k) -> Prepared:
    """Bytes: the gathered rows, the slots, the queries and the output."""
    rows = max(4 * top_k, 1024)
    size = dtype.itemsize
    ql = torch.randn(tokens, heads, latent, device=device, dtype=dtype)
    qr = torch.randn(tokens, heads, rope, device=device, dtype=dtype)
    kv = torch.randn(rows, latent + rope, device=device, dtype=dtype)
    slots = torch.stack([torch.randperm(rows, device=device)[:top_k] for _ in range(tokens)])
    moved = slots.numel() * ((latent + rope) * size + 8) + (ql.numel() + qr.numel() + ql.numel()) * size
    scale = (latent + rope) ** -0.5
    return Prepared(lambda impl: sparse_mla(ql, qr, kv, slots, scale, impl=impl), _nothing, moved)


def prep_copy(device, dtype, *, layers, n, dim, host_src: bool) -> Prepared:
    """Bytes: rows read + rows written, every layer."""
    rows = 4 * n
    src_dev = torch.device("cpu") if host_src else device
    src = torch.randn(layers, rows, dim, device=src_dev, dtype=dtype)
    dst = torch.zeros(layers, rows, dim, device=device, dtype=dtype)
    di = torch.randperm(rows, device=device)[:n]
    si = torch.randperm(rows, device=src_dev)[:n]
    src_, dst_ = (src[0], dst[0]) if layers == 1 else (src, dst)
    return Prepared(
        lambda impl: copy_rows(dst_, di, src_, si, impl=impl, validate=False),
        _nothing,
        2 * layers * n * dim * dtype.itemsize,
    )


def cases(device: torch.device, dtype: torch.dtype) -> list[tuple[str, str, dict, Callable[[], Prepared]]]:
    """(op, label, shape, builder): a tiny-model shape and a DeepSeek-like one scaled for a CPU."""
    table: list[tuple[str, str, Callable[..., Prepared], dict[str, Any]]] = [
        ("indexer_topk", "small", prep_indexer, dict(tokens=8, heads=4, dim=64, ctx=1024, top_k=64)),
        ("indexer_topk", "batch", prep_indexer, dict(tokens=32, heads=4, dim=32, ctx=2048, top_k=64)),
        ("indexer_topk", "large", prep_indexer, dict(tokens=4, heads=64, dim=128, ctx=16384, top_k=2048)),
        (
            "indexer_topk",
            "prefill",
            prep_indexer,
            dict(tokens=1536, heads=4, dim=32, ctx=1536, top_k=64, prefill=True),
        ),
        (
            "swap_in",
            "decode",
            prep_swap_in,
            dict(reqs=1, steps=1, top_k=64, hot=128, extra=16, dim=80, ctx=2048),
        ),
        (
            "swap_in",
            "verify",
            prep_swap_in,
            dict(reqs=1, steps=4, top_k=64, hot=128, extra=16, dim=80, ctx=2048),
        ),
        (
            "swap_in",
            "small",
            prep_swap_in,
            dict(reqs=8, steps=4, top_k=64, hot=128, extra=8, dim=80, ctx=2048),
        ),
        (
            "swap_in",
            "small",
            prep_swap_in,
            dict(reqs=8, steps=4, top_k=64, hot=128, extra=8, dim=576, ctx=2048),
        ),
        (
            "swap_in",
            "batch",
            prep_swap_in,
            dict(reqs=32, steps=1, top_k=64, hot=128, extra=8, dim=80, ctx=2048),
        ),
        (
            "swap_in",
            "large",
            prep_swap_in,
            dict(reqs=4, steps=2, top_k=2048, hot=4096, extra=8, dim=576, ctx=16384),
        ),
        ("sparse_mla", "decode", prep_sparse_mla, dict(tokens=1, heads=4, latent=64, rope=16, top_k=64)),
        ("sparse_mla", "verify", prep_sparse_mla, dict(tokens=4, heads=4, latent=64, rope=16, top_k=64)),
        ("sparse_mla", "small", prep_sparse_mla, dict(tokens=32, heads=16, latent=512, rope=64, top_k=64)),
        ("sparse_mla", "large", prep_sparse_mla, dict(tokens=8, heads=128, latent=512, rope=64, top_k=2048)),
        ("kv_copy", "small", prep_copy, dict(layers=1, n=64, dim=576, host_src=False)),
        ("kv_copy", "large", prep_copy, dict(layers=8, n=2048, dim=576, host_src=False)),
    ]
    if device.type == "cuda":
        table.append(("kv_copy", "host->device", prep_copy, dict(layers=8, n=2048, dim=576, host_src=True)))
    return [
        (op, label, shape, functools.partial(f, device, dtype, **shape)) for op, label, f, shape in table
    ]


def measure(device: torch.device, dtype: torch.dtype, only: set[str] | None) -> dict:
    bandwidth = copy_bandwidth(device)
    impls = ["torch", "triton"] if device.type == "cuda" else ["torch"]
    results = []
    for op, label, shape, build in cases(device, dtype):
        if only and op not in only:
            continue
        prepared = build()
        # on a CPU, swap-in also has the compiled path that `auto` takes, the indexer the compiled
        # loop that `auto` gives decode and verify, and sparse attention the loop that `auto` gives
        # small queries
        cpu_paths = (
            ["numba"] if device.type == "cpu" and op in ("swap_in", "indexer_topk", "sparse_mla") else []
        )
        for impl in impls + cpu_paths:
            seconds = time_call(functools.partial(prepared.run, impl), prepared.reset, device)
            rate = prepared.bytes_moved / seconds
            results.append(
                dict(
                    op=op,
                    label=label,
                    shape=shape,
                    impl=impl,
                    seconds=seconds,
                    bytes=prepared.bytes_moved,
                    bytes_per_s=rate,
                    of_copy_bw=rate / bandwidth,
                )
            )
            print(
                f"{op:13s} {label:12s} {impl:6s} {seconds * 1e3:9.3f} ms  {rate / 1e9:8.2f} GB/s", flush=True
            )
    machine = dict(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        processor=platform.processor() or platform.machine(),
        cpus=os.cpu_count(),
        load_avg_1min=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    )
    return dict(machine=machine, copy_bytes_per_s=bandwidth, results=results)


def _shape_text(shape: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in shape.items() if k != "host_src")


def markdown(report: dict) -> str:
    m = report["machine"]
    where = m["gpu"] or (
        f"{m['processor']}, {m['cpus']} CPUs, {m['threads']} torch thread(s), "
        f"load average {m['load_avg_1min']:.1f}"
    )
    lines = [
        f"Measured on {where} (torch {m['torch']}, {m['dtype']} rows); plain `copy_` bandwidth "
        f"**{report['copy_bytes_per_s'] / 1e9:.2f} GB/s** (read + write).",
        "",
        "| op | shape | impl | time / call | bytes moved | GB/s | of copy bw |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['op']} ({r['label']}) | {_shape_text(r['shape'])} | {r['impl']} | "
            f"{r['seconds'] * 1e3:.3f} ms | {r['bytes'] / 2**20:.2f} MiB | "
            f"{r['bytes_per_s'] / 1e9:.2f} | {100 * r['of_copy_bw']:.1f}% |"
        )
    return "\n".join(lines)


def write_docs(path: Path, table: str) -> bool:
    """Replace the text between the markers; False when the file or markers are missing."""
    if not path.is_file():
        return False
    text = path.read_text()
    if BEGIN not in text or END not in text:
        return False
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hispec bench kernels", description="Time each kernel op beside plain torch copy bandwidth."
    )
    parser.add_argument("--out", default="bench-kernels.json", help="JSON results (default: %(default)s)")
    parser.add_argument(
        "--write-docs",
        nargs="?",
        const=str(DOCS),
        default=None,
        metavar="MD",
        help="replace the bench section of MD (default when given: the repo's docs/kernels.md); "
        "without this flag no tracked file is written",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ops", nargs="*", help="subset of: indexer_topk swap_in sparse_mla kv_copy")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), help="row/query dtype (default: bfloat16 on CUDA, float32 on CPU)"
    )
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print an error's traceback too")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    report = measure(device, dtype, set(args.ops) if args.ops else None)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    table = markdown(report)
    print(table)
    if args.write_docs:
        path = Path(args.write_docs)
        print(f"updated {path}" if write_docs(path, table) else f"no bench markers in {path}")
    return 0
