"""``hispec bench chunked``: chunked prefill beside whole-prompt prefill, on a long prompt.

Two measurements, each alternating its configurations repeat by repeat in one process:

1. **A long prompt on a small device pool** (HiSparse): a prompt of ``--long`` tokens served with
   ``device_pool_tokens = --pool`` and chunks of ``--chunk`` tokens, beside the same prompt prefilled
   whole on a pool large enough for it. Reported: time to first token of each, the peak device rows
   the request held (sampled after every command of the synchronous driver) against the bound
   chunk + HOT + page, and whether the first tokens agree.
2. **Inter-token latency while a long prompt arrives** (the async engine): ``--running`` requests
   decode; once each has streamed a few tokens a ``--long``-token prompt is submitted. The gaps
   between the running requests' deltas while that prompt is prefilled (from its submission to its
   first token) are the inter-token latencies reported, p50 and p99: mixed steps (each chunk in the
   running requests' decode forward, the default), with fixed chunks and with chunks paced by the
   decode steps (``Engine(prefill_pacing=True)``); separate chunk and decode forwards
   (``mixed_steps=False``), fixed and paced; and whole prompts; beside the same running requests
   with no prompt arriving (the same number of gaps); and the long prompt's own time to first token
   in each.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import TYPE_CHECKING, Any

import anyio

from pipeline import cli_config
from pipeline.benchmarks.common import held_out_prompts, machine, percentile, setup, table, write_json
from pipeline.config import EngineConfig, HiSparseConfig
from pipeline.hisparse.coordinator import HiSparseCoordinator

if TYPE_CHECKING:
    from pipeline.messages import Command, Outcome


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' (bundled) or an HF-format directory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--long", type=int, default=4000, help="tokens of the long prompt")
    parser.add_argument("--chunk", type=int, default=256, help="chunked_prefill_tokens of the chunked side")
    parser.add_argument("--pool", type=int, default=1024, help="device_pool_tokens of the small-pool run")
    parser.add_argument("--hot", type=int, default=128, help="HiSparse device buffer (hot columns)")
    parser.add_argument(
        "--running", type=int, default=8, help="requests decoding when the long prompt arrives"
    )
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-chunked.json")
    parser.add_argument("-v", "--verbose", action="store_true", help="print an error's traceback too")


def config(
    args: argparse.Namespace, *, chunk: int | None, pool: int, rows: int = 2, mixed: bool = False
) -> EngineConfig:
    context = min(args.long + 64, 4096) if args.model == "tiny" else args.long + 64
    ratio = -(-(context * rows + 1024) // pool)  # the host and logical pools hold every request
    return cli_config.engine_config(
        args,
        max_context_len=context,
        max_running_requests=rows,
        device_pool_tokens=pool,
        chunked_prefill_tokens=chunk,
        mixed_steps=mixed,
        hisparse=HiSparseConfig(device_buffer_size=args.hot, host_to_device_ratio=max(1, ratio)),
        speculative=None,
        num_threads=args.threads or None,
    )


def long_prompt_run(model, cfg: EngineConfig, prompt: list[int]) -> dict[str, Any]:
    """Time to first token and peak device rows of one long prompt (synchronous driver)."""
    from pipeline.driver import SyncDriver
    from pipeline.executor import Executor
    from pipeline.sampling import SamplingParams

    executor = Executor(cfg, model=model)
    memory = executor.memory
    assert isinstance(memory, HiSparseCoordinator)  # (the configurations here run HiSparse)
    pages = memory.alloc.physical
    peak, ttft = 0, None
    command = executor.run

    def sampled(cmd: Command, *, idle: bool = True) -> Outcome:
        """``executor.run``, then the device rows after it (the first token's command included)."""
        nonlocal peak, ttft
        outcome = command(cmd, idle=idle)
        for seq in executor.seqs.values():
            peak = max(peak, len(pages.pages_of(seq.row)) * cfg.page_size)
        if ttft is None and req.output_ids:
            ttft = time.perf_counter() - start
        return outcome

    try:
        driver = SyncDriver(executor)
        setattr(executor, "run", sampled)  # noqa: B010 (shadows the method: every command is sampled)
        start = time.perf_counter()
        req = driver.submit(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
        driver.run()
        return {"ttft_s": ttft, "peak_device_rows": peak, "first_token": req.output_ids[0]}
    finally:
        executor.close()


def measure_long(args, model, prompt: list[int]) -> dict[str, Any]:
    small = config(args, chunk=args.chunk, pool=args.pool)
    whole = config(args, chunk=None, pool=-(-(args.long + 64) // 16) * 16 + 16)
    runs: dict[str, list[dict]] = {"chunked": [], "whole": []}
    for repeat in range(args.repeats):
        for name in ("chunked", "whole") if repeat % 2 == 0 else ("whole", "chunked"):
            runs[name].append(long_prompt_run(model, small if name == "chunked" else whole, prompt))
    ttft = {k: [r["ttft_s"] for r in v] for k, v in runs.items()}
    paired = [c / w for c, w in zip(ttft["chunked"], ttft["whole"])]
    return {
        "prompt_tokens": len(prompt),
        "chunk": args.chunk,
        "hot": args.hot,
        "page": small.page_size,
        "chunked_device_pool_tokens": args.pool,
        "whole_device_pool_tokens": whole.device_pool_tokens,
        "peak_device_rows": {k: max(r["peak_device_rows"] for r in v) for k, v in runs.items()},
        "bound_rows": args.chunk + args.hot + small.page_size,
        "ttft_s": {k: statistics.median(v) for k, v in ttft.items()},
        "ttft_chunked_over_whole": statistics.median(paired),
        "ttft_ratio_min_max": [min(paired), max(paired)],
        "same_first_token": len({r["first_token"] for v in runs.values() for r in v}) == 1,
    }


def itl_run(
    model,
    cfg: EngineConfig,
    running: list[list[int]],
    long: list[int] | None,
    gaps: int | None,
    pacing: bool = True,
):
    """Gaps between the running requests' deltas while ``long`` is prefilled (or, without it, the
    first ``gaps`` gaps after the same warm-up)."""
    from pipeline.engine import Engine
    from pipeline.sampling import SamplingParams

    warm = 4
    out: dict[str, Any] = {}

    async def main() -> None:
        async with Engine(cfg, model=model, prefill_pacing=pacing) as engine:
            stamps: list[list[float]] = [[] for _ in running]
            started = anyio.Event()
            window: list[float] = []
            done = anyio.Event()

            async def decode(i: int) -> None:
                params = SamplingParams(
                    max_new_tokens=engine.plan.max_context_len - len(running[i]) - 1, ignore_eos=True
                )
                async with engine.generate(running[i], params, request_id=f"run-{i}") as stream:
                    async for _ in stream:
                        stamps[i].append(time.perf_counter())
                        if all(len(s) >= warm for s in stamps):
                            started.set()
                        if done.is_set():
                            return

            async def arrive() -> None:
                await started.wait()
                window.append(time.perf_counter())
                if long is not None:
                    result = await engine.generate_text(
                        long, SamplingParams(max_new_tokens=1, ignore_eos=True)
                    )
                    out["first_token"] = result.token_ids[0]
                    window.append(time.perf_counter())
                else:
                    assert gaps is not None  # (a run without the long prompt counts gaps)
                    while sum(_gaps_in(s, window[0], None) for s in stamps) < gaps:
                        await anyio.sleep(0.005)
                    window.append(time.perf_counter())
                done.set()

            async with anyio.create_task_group() as tg:
                for i in range(len(running)):
                    tg.start_soon(decode, i)
                tg.start_soon(arrive)
            out["gaps"] = [g for s in stamps for g in _gap_values(s, window[0], window[1])]
            out["window_s"] = window[1] - window[0]

    anyio.run(main)
    return out


def _gap_values(stamps: list[float], start: float, end: float | None) -> list[float]:
    """Gaps between consecutive deltas whose later delta arrived within ``[start, end]`` (plus the
    gap still open at ``end``: a stream stalled through the window counts)."""
    gaps = [b - a for a, b in itertools.pairwise(stamps) if b >= start and (end is None or b <= end)]
    if end is not None:
        last = max((t for t in stamps if t <= end), default=start)
        gaps.append(end - max(last, start))
    return gaps


def _gaps_in(stamps: list[float], start: float, end: float | None) -> int:
    return sum(1 for a, b in itertools.pairwise(stamps) if b >= start and (end is None or b <= end))


def measure_itl(args, model, running: list[list[int]], long: list[int]) -> dict[str, Any]:
    rows = args.running + 1
    pool = (args.long + 64) + rows * (args.hot + 64)
    pool = -(-pool // 16) * 16
    cfgs = {
        "mixed_paced": config(args, chunk=args.chunk, pool=pool, rows=rows, mixed=True),
        "mixed": config(args, chunk=args.chunk, pool=pool, rows=rows, mixed=True),
        "paced": config(args, chunk=args.chunk, pool=pool, rows=rows),
        "chunked": config(args, chunk=args.chunk, pool=pool, rows=rows),
        "whole": config(args, chunk=None, pool=pool, rows=rows),
    }
    paced = {"mixed_paced", "paced"}
    samples: dict[str, list[float]] = {"none": [], **{name: [] for name in cfgs}}
    windows: dict[str, list[float]] = {name: [] for name in cfgs}
    for repeat in range(args.repeats):
        order = list(cfgs) if repeat % 2 == 0 else list(reversed(cfgs))
        for name in order:
            run = itl_run(model, cfgs[name], running, long, None, pacing=name in paced)
            samples[name].extend(run["gaps"])
            windows[name].append(run["window_s"])
        # the same running requests, no prompt arriving: as many gaps as the chunked window had
        run = itl_run(model, cfgs["chunked"], running, None, max(8, len(samples["chunked"]) // (repeat + 1)))
        samples["none"].extend(run["gaps"])
    report: dict[str, Any] = {
        name: {
            "p50_ms": percentile(v, 0.5) * 1e3,
            "p99_ms": percentile(v, 0.99) * 1e3,
            "max_ms": max(v) * 1e3,
            "gaps": len(v),
        }
        for name, v in samples.items()
    }
    for name in cfgs:
        report[f"{name}_p99_over_none"] = report[name]["p99_ms"] / report["none"]["p99_ms"]
        report[name]["ttft_s"] = statistics.median(windows[name])  # the long prompt's, among the others
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hispec bench chunked", description=__doc__.split("\n\n")[0])
    add_args(parser)
    args = parser.parse_args(argv)
    from pipeline.benchmarks.engine import load_or_random

    threads = setup(args.threads)
    model, note = load_or_random(args)
    long = held_out_prompts(1, args.long, args.seed)[0]
    running = held_out_prompts(args.running, 64, args.seed + 1)
    first = measure_long(args, model, long)
    itl = measure_itl(args, model, running, long)
    write_json(
        args.out, {"bench": "chunked", "machine": machine(), "note": note, "long_prompt": first, "itl": itl}
    )
    if note:
        print(f"note: {note}")
    print(
        f"model {args.model} {args.dtype}, {threads} thread(s), prompt of {first['prompt_tokens']} tokens, "
        f"chunks of {args.chunk}, HOT {args.hot}, {args.repeats} alternating repeats"
    )
    print(table(
        ["prefill", "device_pool_tokens", "peak device rows", "time to first token (s)"],
        [["chunked", first["chunked_device_pool_tokens"], first["peak_device_rows"]["chunked"],
          first["ttft_s"]["chunked"]],
         ["whole", first["whole_device_pool_tokens"], first["peak_device_rows"]["whole"],
          first["ttft_s"]["whole"]]],
    ))  # fmt: skip
    print(
        f"bound chunk + HOT + page = {first['bound_rows']} rows; TTFT chunked / whole "
        f"{first['ttft_chunked_over_whole']:.2f} (range {first['ttft_ratio_min_max'][0]:.2f}-"
        f"{first['ttft_ratio_min_max'][1]:.2f}); "
        f"same first token: {'yes' if first['same_first_token'] else 'NO'}"
    )
    print()
    print(f"inter-token latency of {args.running} running requests while the prompt is prefilled")
    labels = {
        "mixed_paced": f"mixed steps, chunks of {args.chunk}, paced",
        "mixed": f"mixed steps, chunks of {args.chunk}",
        "paced": f"chunks of {args.chunk}, paced",
        "chunked": f"chunks of {args.chunk}",
        "whole": "whole",
    }
    print(table(
        ["prompt arriving", "p50 (ms)", "p99 (ms)", "max (ms)", "gaps", "p99 / no prompt", "its TTFT (s)"],
        [["none", itl["none"]["p50_ms"], itl["none"]["p99_ms"], itl["none"]["max_ms"], itl["none"]["gaps"],
          1.0, "-"]]
        + [[labels[n], itl[n]["p50_ms"], itl[n]["p99_ms"], itl[n]["max_ms"], itl[n]["gaps"],
            itl[f"{n}_p99_over_none"], itl[n]["ttft_s"]] for n in labels],
    ))  # fmt: skip
    return 0
