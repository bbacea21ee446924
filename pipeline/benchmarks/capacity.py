"""``hispec bench capacity``: one device memory budget, all-resident KV beside HiSparse.

A long-context workload: ``--requests`` requests of ``--prompt-len`` prompt tokens and ``--new-tokens`` output
tokens (contexts several times HOT), all arriving together, more of them than resident KV can seat at
``--device-memory``. Every variant gets the same budget, its pools and request rows derived from it
(``pipeline.pool_sizes``): ``resident`` (all KV on the device), ``hisparse`` and ``hisparse+spec`` (MTP
speculation on; its draft layer's KV is all resident and paid from the same budget); ``resident+spec`` on
request (``--variants``). Reported per variant: seats (the plan's), output tokens/s, requests/s, peak and mean
running requests (the engine's counters: requests stepped together), retractions, time to first token and
inter-token latency p50/p99, HiSparse misses per decode step.

``--repeats N`` runs the variants N times, alternating their order repeat by repeat; the table shows
each variant's median run (by tokens/s), and the tokens/s ratios that matter (HiSparse against
resident, speculation on against off) are paired repeat by repeat and given as median and range.

``--sweep N,N,...`` repeats the run for each number of requests at the same budget and plots output
tokens/s against the mean running requests for each variant (``--plot``, matplotlib).

    hispec bench capacity --device-memory 32MB --prompt-len 1536 --new-tokens 512 --requests 32
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio
import attrs

from pipeline.benchmarks.common import held_out_prompts, machine, percentile, setup, table, write_json
from pipeline.capacity import format_bytes
from pipeline.config import EngineConfig
from pipeline.plan import add_plan_arguments, plan_config

VARIANTS = ("resident", "hisparse", "hisparse+spec", "resident+spec")
DEFAULT_VARIANTS = VARIANTS[:3]


def add_args(parser: argparse.ArgumentParser) -> None:
    add_plan_arguments(parser)
    parser.set_defaults(device_memory=32 * 10**6)
    parser.add_argument("--prompt-len", type=int, default=1536)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=32, help="requests arriving together")
    parser.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, of {VARIANTS}"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of every variant, alternating their order"
    )
    parser.add_argument("--sweep", default="", metavar="N,N,...", help="also run these request counts")
    parser.add_argument("--plot", default="bench-capacity.png", help="the sweep's plot (PNG)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-capacity.json")
    parser.add_argument("-v", "--verbose", action="store_true", help="print an error's traceback too")


def variant_config(args: argparse.Namespace, variant: str) -> EngineConfig:
    context = args.prompt_len + args.new_tokens
    cfg = plan_config(args, hisparse=variant.startswith("hisparse"), context=context)
    if variant.endswith("+spec"):
        from pipeline.config import SpeculativeConfig

        steps = args.num_steps or 3
        return attrs.evolve(
            cfg,
            speculative=SpeculativeConfig(num_steps=steps),
            seed=args.seed,
            num_threads=args.threads or None,
        )
    return attrs.evolve(cfg, speculative=None, seed=args.seed, num_threads=args.threads or None)


async def run_once(cfg: EngineConfig, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    from pipeline import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    async with Engine(cfg) as engine:
        results: dict[int, Any] = {}

        async def one(i: int) -> None:
            results[i] = await engine.generate_text(prompts[i], params, request_id=f"r{i}")

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        seconds = time.perf_counter() - start
        stats: dict[str, Any] = engine.stats()  # JSON-shaped figures
        executor = engine.executor
        assert executor is not None  # (the engine is running)
        plan = executor.plan.device
    tokens = sum(len(r.token_ids) for r in results.values())
    metrics = [r.metrics for r in results.values()]
    ttft = [m.time_to_first_token for m in metrics if m.time_to_first_token is not None]
    itl = [m.inter_token_latency for m in metrics if m.inter_token_latency is not None]
    running = stats["running"]
    misses = sum(stats["hisparse"]["misses"]) if stats.get("hisparse") else 0
    context = len(prompts[0]) + new_tokens
    return {
        "seats": plan.seats(context).running,
        "seat_limit": plan.seats(context).limit,
        "device_bytes": plan.total_bytes,
        "output_tokens": tokens,
        "all_tokens": all(len(r.token_ids) == new_tokens for r in results.values()),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "requests_per_s": len(results) / seconds,
        "peak_running": running["peak_running"],
        "mean_running": running["mean_running"],
        "retractions": sum(m.num_retractions for m in metrics),
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p99": percentile(ttft, 0.99),
        "itl_p50": percentile(itl, 0.5),
        "itl_p99": percentile(itl, 0.99),
        "misses_per_step": misses / max(1, running["steps"]),
        "outputs": {i: list(r.token_ids) for i, r in results.items()},
    }


def run_all(args: argparse.Namespace, variants: list[str], count: int) -> dict[str, list[dict[str, Any]]]:
    """Every variant ``args.repeats`` times, the order reversed every other repeat: each variant's
    runs, in repeat order."""
    prompts = held_out_prompts(count, args.prompt_len, args.seed)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for repeat in range(max(1, args.repeats)):
        for variant in variants if repeat % 2 == 0 else variants[::-1]:
            runs[variant].append(anyio.run(run_once, variant_config(args, variant), prompts, args.new_tokens))
    return runs


def median_runs(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each variant's median run by output tokens/s."""
    return {v: sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2] for v, rs in runs.items()}


# (numerator, denominator) variants whose tokens/s ratio is reported, paired repeat by repeat
RATIOS = (("hisparse", "resident"), ("hisparse+spec", "hisparse"), ("resident+spec", "resident"))


def paired_ratios(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """``"a / b"`` -> median, low and high of the per-repeat tokens/s ratios, for the pairs present."""
    out = {}
    for a, b in RATIOS:
        if a in runs and b in runs:
            values = sorted(x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs[a], runs[b]))
            out[f"{a} / {b}"] = {"median": values[len(values) // 2], "low": values[0], "high": values[-1]}
    return out


HEADERS = [
    "variant",
    "seats",
    "tok/s",
    "req/s",
    "peak run",
    "mean run",
    "retract",
    "TTFT p50",
    "TTFT p99",
    "ITL p50",
    "ITL p99",
    "miss/step",
]


def rows_of(results: dict[str, dict[str, Any]]) -> list[list[object]]:
    return [
        [
            name,
            r["seats"],
            r["tokens_per_s"],
            r["requests_per_s"],
            r["peak_running"],
            r["mean_running"],
            r["retractions"],
            r["ttft_p50"],
            r["ttft_p99"],
            r["itl_p50"],
            r["itl_p99"],
            r["misses_per_step"],
        ]
        for name, r in results.items()
    ]


def plot(sweep: dict[int, dict[str, dict[str, Any]]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    variants = next(iter(sweep.values())).keys()
    for variant in variants:
        points = sorted((r[variant]["mean_running"], r[variant]["tokens_per_s"], n) for n, r in sweep.items())
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=variant)
        for x, y, n in points:
            ax.annotate(str(n), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set_xlabel("mean running requests (labels: requests offered)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hispec bench capacity", description=__doc__.split("\n\n")[0])
    add_args(parser)
    args = parser.parse_args(argv)
    threads = setup(args.threads)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {VARIANTS}")
    budget = format_bytes(args.device_memory)
    ratio = args.ratio or "per plan"
    title = (
        f"{args.model}, {budget} device budget, {args.prompt_len}+{args.new_tokens} tokens, HOT {args.hot}, "
        f"ratio {ratio}"
    )
    runs = run_all(args, variants, args.requests)
    results = median_runs(runs)
    repeats = f", median of {args.repeats} alternating runs" if args.repeats > 1 else ""
    print(f"{title}, {args.requests} requests arriving together ({threads} threads{repeats})")
    print(table(HEADERS, rows_of(results)))
    ratios = paired_ratios(runs)
    for name, r in ratios.items():
        print(f"tokens/s {name}: {r['median']:.2f} (range {r['low']:.2f}-{r['high']:.2f})")
    payload: dict[str, Any] = {
        "machine": machine(),
        "args": vars(args),
        "results": strip(results),
        "ratios": ratios,
        "runs": {v: [{f: x for f, x in r.items() if f != "outputs"} for r in rs] for v, rs in runs.items()},
    }
    first = runs[variants[0]][0]["outputs"]
    same = {v: all(r["outputs"] == first for r in runs[v]) for v in variants[1:]}
    if same:
        print(f"greedy outputs equal {variants[0]}'s: {same}")
        payload["outputs_equal"] = same
    sweep_counts = [int(n) for n in args.sweep.split(",") if n]
    if sweep_counts:
        sweep = {n: median_runs(run_all(args, variants, n)) for n in sweep_counts}
        sweep[args.requests] = results
        for n in sorted(sweep):
            print(f"\n{n} requests")
            print(table(HEADERS, rows_of(sweep[n])))
        plot(sweep, args.plot, title)
        print(f"plot: {args.plot}")
        payload["sweep"] = {n: strip(r) for n, r in sorted(sweep.items())}
    write_json(args.out, payload)
    return 0


def strip(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k: {f: v for f, v in r.items() if f != "outputs"} for k, r in results.items()}
