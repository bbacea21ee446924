"""``hispec bench tp``: tensor parallelism at TP 1 and TP 2 (or more), and its time in collectives.

The same greedy batch runs through the synchronous driver over a plain ``Executor`` (TP 1) and over a
``DistributedExecutor`` of N ranks (this process is rank 0, the others are spawned); on the CPU the
ranks talk over gloo, on CUDA over NCCL (one device per rank). Each command is timed on rank 0, and
the time rank 0 spends inside collectives during it is taken from its group's counters, so every
row reports:

* generated tokens per second (first submission to last completion, start-up excluded);
* the mean time of a decode step (``Decode``, or a speculative round's ``Draft`` + ``Verify``);
* the share of the commands' time spent in collectives (waiting for the slowest rank included:
  on a shared CPU it is mostly the ranks' imbalance, on GPUs the all-reduce cost itself);
* whether the tokens equal TP 1's (float32 sums in another order may flip a near tie; float64 not).

and the host memory of each run, read once the batch is done (before the ranks stop):

* the HiSparse host pool's bytes on the node (``host KV``): once when the ranks share one pool (the
  default), once a rank with ``--no-shared-host-pool``; the target is TP N's equal to TP 1's;
* the resident memory of every process of the run (rank 0 and the spawned ranks), summed two ways
  from ``/proc/<pid>/smaps_rollup``: ``RSS`` counts a page every process maps once per process (the
  shared pool N times), ``PSS`` divides each page among the processes that map it, so the sum counts
  the shared segment, and every other shared page, once. Rank 0 is this process, so its figures
  include the model and what earlier runs left allocated; compare the columns across TP sizes.

Start-up (spawning the ranks, loading the shards) is reported apart. The bundled model is used when
present; otherwise a random tiny model, with a note.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import attrs

from pipeline.benchmarks.common import batch_config, machine, setup, table, write_json
from pipeline.benchmarks.engine import load_or_random, prompts_for
from pipeline.messages import Decode, Draft, Mixed, Verify

STEP_COMMANDS = (Decode, Draft, Verify, Mixed)  # (a mixed step's forward carries a decode step)
MIB = 1 << 20


MEMORY_COLUMNS = ("host_kv_bytes", "rss_bytes", "pss_bytes")  # printed in MiB


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' (bundled) or an HF-format directory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one device per rank")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes to run")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in the batch")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-spec", action="store_true")
    parser.add_argument("--no-hisparse", action="store_true")
    parser.add_argument("--host-ratio", type=int, default=None, metavar="R",
                        help="HiSparse host_to_device_ratio (default: the engine's); a larger host pool "
                             "shows in the memory columns")
    parser.add_argument("--no-shared-host-pool", action="store_true",
                        help="each rank keeps its own HiSparse host pool (default: one per node, shared)")
    parser.add_argument(
        "--hot", type=int, default=64, help="HiSparse device buffer (>= the model's index_topk)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-tp.json")
    parser.add_argument("-v", "--verbose", action="store_true", help="print an error's traceback too")


class TimedExecutor:
    """An executor whose commands are timed, with rank 0's collective time inside each."""

    def __init__(self, executor) -> None:
        self.executor = executor
        self.group = getattr(executor, "group", None)
        self.command_s = 0.0
        self.collective_s = 0.0
        self.step_s = 0.0
        self.steps = 0

    def run(self, command, *, idle: bool = True):
        before = self.group.collective_s if self.group is not None else 0.0
        start = time.perf_counter()
        outcome = self.executor.run(command, idle=idle)
        seconds = time.perf_counter() - start
        self.command_s += seconds
        if self.group is not None:
            self.collective_s += self.group.collective_s - before
        if isinstance(command, STEP_COMMANDS):
            self.step_s += seconds
            self.steps += not isinstance(command, Draft)  # a round is Draft + Verify: one step
        return outcome

    def __getattr__(self, name: str):
        return getattr(self.executor, name)


def run_once(model, cfg, prompts, params, size: int) -> dict[str, Any]:
    from pipeline.distributed.executor import DistributedExecutor
    from pipeline.driver import SyncDriver
    from pipeline.executor import Executor

    start = time.perf_counter()
    executor: Executor | DistributedExecutor
    if size == 1:
        executor = Executor(cfg, model=model)
    else:
        executor = DistributedExecutor(attrs.evolve(cfg, tensor_parallel_size=size), model=model)
    startup = time.perf_counter() - start
    try:
        timed = TimedExecutor(executor)
        driver = SyncDriver(timed)
        start = time.perf_counter()
        reqs = driver.generate(prompts, params)
        seconds = time.perf_counter() - start
        memory = host_memory(executor)
    finally:
        executor.close()
    tokens = sum(len(r.output_ids) for r in reqs)
    return {
        "tokens_per_s": tokens / seconds,
        "step_ms": 1000 * timed.step_s / max(timed.steps, 1),
        "collective_share": timed.collective_s / timed.command_s if timed.command_s else 0.0,
        "startup_s": startup,
        "outputs": [list(r.output_ids) for r in reqs],
        **memory,
    }


def host_memory(executor) -> dict[str, Any]:
    """The run's processes, its HiSparse host pool bytes on the node, and the resident memory of
    its processes summed as RSS and as PSS (see the module docstring)."""
    pids = [os.getpid(), *getattr(executor, "worker_pids", [])]
    rss = pss = 0
    for pid in pids:
        figures = smaps_rollup(pid)
        rss += figures.get("Rss", 0)
        pss += figures.get("Pss", 0)
    return {"processes": len(pids), "host_kv_bytes": host_kv_bytes(executor), "rss_bytes": rss,
            "pss_bytes": pss}


def host_kv_bytes(executor) -> int:
    """The host pool's bytes on the node: what a distributed executor reports, or the one pool of a
    single process (0 without HiSparse)."""
    pool = executor.stats().get("host_pool")
    if pool is not None:
        return int(pool["bytes_per_node"])
    host = getattr(executor.memory, "host", None)
    return 0 if host is None else host.kv.numel() * host.kv.element_size()


def smaps_rollup(pid: int) -> dict[str, int]:
    """Bytes by field of ``/proc/<pid>/smaps_rollup`` (empty where the kernel has none)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines()[1:]:
        name, _, rest = line.partition(":")
        value = rest.split()
        if len(value) == 2 and value[1] == "kB":
            out[name] = int(value[0]) * 1024
    return out


def measure(args, model, size: int, reference: list[list[int]] | None) -> dict[str, Any]:
    from pipeline.sampling import SamplingParams

    cfg = batch_config(
        args,
        requests=args.concurrency,
        prompt_len=args.prompt_len,
        hisparse=not args.no_hisparse,
        num_steps=None if args.no_spec else 3,
    )
    cfg = attrs.evolve(cfg, num_threads=args.threads, device=args.device,
                       shared_host_pool=not args.no_shared_host_pool)
    if cfg.hisparse is not None and args.host_ratio is not None:
        cfg = attrs.evolve(cfg, hisparse=attrs.evolve(cfg.hisparse, host_to_device_ratio=args.host_ratio))
    prompts = prompts_for(args, args.concurrency)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    runs = [run_once(model, cfg, prompts, params, size) for _ in range(args.repeats)]
    outputs = runs[0]["outputs"]
    return {
        "tp": size,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "step_ms": statistics.median(r["step_ms"] for r in runs),
        "collective_share": statistics.median(r["collective_share"] for r in runs),
        "startup_s": statistics.median(r["startup_s"] for r in runs),
        "runs_tokens_per_s": [r["tokens_per_s"] for r in runs],
        "processes": runs[-1]["processes"],
        "host_kv_bytes": runs[-1]["host_kv_bytes"],  # the same every run
        "rss_bytes": statistics.median(r["rss_bytes"] for r in runs),
        "pss_bytes": statistics.median(r["pss_bytes"] for r in runs),
        "outputs_equal_tp1": None if reference is None else outputs == reference,
        "outputs": outputs,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hispec bench tp", description=__doc__.split("\n\n")[0])
    add_args(parser)
    args = parser.parse_args(argv)
    threads = setup(args.threads)
    model, note = load_or_random(args)
    model = model.to(args.device)
    rows: list[dict[str, Any]] = []
    reference = None
    for size in sorted(set(args.tp)):
        row = measure(args, model, size, reference)
        if size == 1:
            reference = row["outputs"]
        rows.append(row)
    for row in rows:
        row.pop("outputs")
    report = {
        "bench": "tp",
        "machine": machine(),
        "model": args.model if not note else "random tiny",
        "note": note,
        "dtype": args.dtype,
        "device": args.device,
        "speculative": not args.no_spec,
        "hisparse": not args.no_hisparse,
        "shared_host_pool": not args.no_shared_host_pool,
        "host_ratio": args.host_ratio,
        "concurrency": args.concurrency,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "threads_per_rank": threads,
        "rows": rows,
    }
    write_json(args.out, report)
    if note:
        print(f"note: {note}")
    mode = "speculative (3 steps)" if report["speculative"] else "plain"
    print(
        f"model {report['model']} {args.dtype}, {mode}, HiSparse {'on' if report['hisparse'] else 'off'}, "
        f"{args.concurrency} requests of {args.prompt_len} + {args.new_tokens} tokens, "
        f"median of {args.repeats}, {threads} thread(s) per rank"
    )
    headers = ["TP", "tokens/s", "step ms", "collectives share", "start-up s", "tokens == TP 1"]
    print(table(headers, [
        [r["tp"], r["tokens_per_s"], r["step_ms"], r["collective_share"], r["startup_s"],
         "-" if r["outputs_equal_tp1"] is None else r["outputs_equal_tp1"]]
        for r in rows
    ]))  # fmt: skip
    pools = "one per rank" if args.no_shared_host_pool else "one per node, shared by its ranks"
    print(f"host memory (HiSparse host pool {pools}; RSS and PSS summed over the run's processes):")
    print(table(["TP", "processes", "host KV MiB", "RSS sum MiB", "PSS sum MiB"], [
        [r["tp"], r["processes"], *(f"{r[k] / MIB:,.0f}" for k in MEMORY_COLUMNS)]
        for r in rows
    ]))  # fmt: skip
    print(f"wrote {args.out}")
    return 0
