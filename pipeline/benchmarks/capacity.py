"""``hispec bench capacity``: one device memory budget, all-resident KV beside HiSparse and dynamic residency.

A long-context workload: ``--requests`` requests of ``--prompt-len`` prompt tokens and ``--new-tokens`` output
tokens (contexts several times HOT), all arriving together, more of them than resident KV can seat at
``--device-memory``. Every variant gets the same budget, its pools and request rows derived from it
(``pipeline.pool_sizes``): ``resident`` (all KV on the device), ``hisparse`` (``residency="always"``),
``dynamic`` (HiSparse with ``residency="dynamic"``: whole contexts on the device while the pool holds them,
hot buffers under pressure) and ``hisparse+spec`` (MTP speculation on; its draft layer's KV is all resident
and paid from the same budget); ``resident+spec`` and ``dynamic+spec`` on request (``--variants``). Reported
per variant: seats (the plan's), output tokens/s, requests/s, peak and mean running requests (the engine's
counters: requests stepped together), retractions, time to first token and inter-token latency p50/p99,
HiSparse misses per decode step, and dynamic residency's demotions and promotions
(``engine.stats()["residency"]``).

``--repeats N`` runs the variants N times, alternating their order repeat by repeat; the table shows
each variant's median run (by tokens/s), and the tokens/s ratios that matter (HiSparse and dynamic
against resident, dynamic against HiSparse and against the better of resident and HiSparse, speculation
on against off) are paired repeat by repeat and given as median and range. ``--control`` runs the first
variant once more among them and pairs it with itself: what a ratio reads when nothing differs.

``--interleaved-steps N`` then times the decode step alone at each load (the given one and the sweep's;
a step is the executor's ``Decode`` command with its step boundary and the statistics snapshot after it):
one executor per variant holds the same requests, and N rounds of one decode step each, in alternating
order, give each variant's median step time and the per-step ratios, paired round by round against the
first variant that seats the load (drift between runs, this benchmark's noise, cancels there).

``--sweep N,N,...`` repeats the run for each number of requests at the same budget, prints the ratios
at each load with whether resident seats it (and whether HiSparse does), and plots output tokens/s
against the requests offered and against the mean running requests for each variant (``--plot``,
matplotlib).

    hispec bench capacity --device-memory 32MB --prompt-len 1536 --new-tokens 512 --requests 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import anyio
import attrs

from pipeline.benchmarks.common import held_out_prompts, machine, percentile, setup, table, write_json
from pipeline.capacity import format_bytes
from pipeline.config import EngineConfig
from pipeline.plan import add_plan_arguments, plan_config

VARIANTS = ("resident", "hisparse", "dynamic", "hisparse+spec", "resident+spec", "dynamic+spec")
DEFAULT_VARIANTS = VARIANTS[:4]
CONTROL = " (control)"  # ``--control``: the first variant once more, under this suffix


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
    parser.add_argument(
        "--control", action="store_true",
        help="also run the first variant a second time, alternating with the others, and pair it with "
        "itself: the spread a ratio carries on this machine when nothing differs",
    )
    parser.add_argument("--plot", default="bench-capacity.png", help="the sweep's plot (PNG)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="measure from the first run (default: one short unmeasured run of each variant)")
    parser.add_argument(
        "--interleaved-steps", type=int, default=0, metavar="N",
        help="also time N decode steps of each variant's executor, interleaved step by step, at each load "
        "every variant seats at once (the decode step alone, drift cancelled)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-capacity.json")
    parser.add_argument("-v", "--verbose", action="store_true", help="print an error's traceback too")


def variant_config(args: argparse.Namespace, variant: str) -> EngineConfig:
    variant = variant.removesuffix(CONTROL)
    context = args.prompt_len + args.new_tokens
    base = variant.removesuffix("+spec")
    residency = "dynamic" if base == "dynamic" else "always"
    cfg = plan_config(args, hisparse=base != "resident", context=context, residency=residency)
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


async def run_once(
    cfg: EngineConfig, prompts: list[list[int]], new_tokens: int, model: Any = None
) -> dict[str, Any]:
    """One engine serving ``prompts`` arriving together (``model``: one already built, else the
    config's): its figures, and each request's output tokens."""
    from pipeline import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    async with Engine(cfg, model=model) as engine:
        results: dict[int, Any] = {}

        async def one(i: int) -> None:
            results[i] = await engine.generate_text(prompts[i], params, request_id=f"r{i}")

        start, cpu_start = time.perf_counter(), time.process_time()
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
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
    residency = stats.get("residency") or {}
    context = len(prompts[0]) + new_tokens
    return {
        "seats": plan.seats(context).running,
        "seat_limit": plan.seats(context).limit,
        "device_bytes": plan.total_bytes,
        "output_tokens": tokens,
        "all_tokens": all(len(r.token_ids) == new_tokens for r in results.values()),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        # per second of this process's CPU time (every thread): what a machine shared with other
        # work changes least
        "tokens_per_cpu_s": tokens / max(cpu_seconds, 1e-9),
        "requests_per_s": len(results) / seconds,
        "peak_running": running["peak_running"],
        "mean_running": running["mean_running"],
        "retractions": sum(m.num_retractions for m in metrics),
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p99": percentile(ttft, 0.99),
        "itl_p50": percentile(itl, 0.5),
        "itl_p99": percentile(itl, 0.99),
        "misses_per_step": misses / max(1, running["steps"]),
        "demotions": residency.get("demotions", 0),
        "promotions": residency.get("promotions", 0),
        "demoted_bytes": residency.get("demoted_bytes", 0),
        "promoted_bytes": residency.get("promoted_bytes", 0),
        "outputs": {i: list(r.token_ids) for i, r in results.items()},
    }


def run_all(args: argparse.Namespace, variants: list[str], count: int) -> dict[str, list[dict[str, Any]]]:
    """Every variant ``args.repeats`` times on ``count`` held-out prompts (``run_alternating``)."""
    prompts = held_out_prompts(count, args.prompt_len, args.seed)
    configs = {v: variant_config(args, v) for v in variants}
    return run_alternating(configs, prompts, args.new_tokens, args.repeats)


def run_alternating(
    configs: dict[str, EngineConfig],
    prompts: list[list[int]],
    new_tokens: int,
    repeats: int,
    model: Any = None,
) -> dict[str, list[dict[str, Any]]]:
    """Every config ``repeats`` times (``run_once``), the order reversed every other repeat: each
    config's runs, in repeat order."""
    names = list(configs)
    built = () if model is None else (model,)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for repeat in range(max(1, repeats)):
        for name in names if repeat % 2 == 0 else names[::-1]:
            runs[name].append(anyio.run(run_once, configs[name], prompts, new_tokens, *built))
    return runs


def interleaved_steps(
    args: argparse.Namespace, variants: list[str], count: int, steps: int
) -> dict[str, Any] | None:
    """``count`` requests decoding on one executor per variant (admitted one at a time, so that a
    dynamic one demotes as it must), then ``steps`` decode steps of each, interleaved step by step in
    alternating order (a step: the executor's ``Decode`` command with its step boundary, and the
    statistics snapshot the engine refreshes after it): each variant's median step time and the
    paired per-step ratios against the first variant that seats them (median and quartiles). A
    variant that cannot seat them all at once is left out (``unseated``); None where fewer than two
    remain. A machine's drift between runs cancels here: the steps of a round are taken within
    milliseconds of each other."""
    from pipeline.driver import prefill_whole
    from pipeline.executor import Executor, NewSequence
    from pipeline.messages import Decode, StepResult
    from pipeline.sampling import SamplingParams

    prompts = held_out_prompts(count, args.prompt_len, args.seed)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    ids = [f"r{i}" for i in range(count)]
    executors: dict[str, Any] = {}
    unseated: list[str] = []
    try:
        for variant in variants:
            executor = executors[variant] = Executor(variant_config(args, variant))
            ready: list[str] = []
            for rid, prompt in zip(ids, prompts):
                prefill_whole(executor, [NewSequence(rid, tuple(prompt), params)])
                executor.wait_staging()
                ready += executor.collect_ready()
            if sorted(ready) != sorted(ids):
                unseated.append(variant)
                executors.pop(variant).close()
        variants = [v for v in variants if v not in unseated]
        if len(variants) < 2:
            return None
        steps = max(1, min(steps, args.new_tokens - 1))
        times: dict[str, list[float]] = {v: [] for v in variants}
        command = Decode(tuple(ids))
        for i in range(steps):
            for variant in variants if i % 2 == 0 else variants[::-1]:
                executor = executors[variant]
                start = time.perf_counter()
                outcome = executor.run(command)  # (with its step boundary: a promotion may follow)
                executor.stats()  # the snapshot the engine refreshes after each step
                times[variant].append(time.perf_counter() - start)
                if outcome.error is not None or not _stepped(outcome.result_as(StepResult)):
                    raise RuntimeError(f"{variant}: a decode step failed: {outcome}")
    finally:
        for executor in executors.values():
            executor.close()
    base = variants[0]
    out: dict[str, Any] = {
        "steps": steps,
        "median_step_s": {v: statistics.median(t) for v, t in times.items()},
        "unseated": unseated,
    }
    for variant in variants[1:]:
        paired = sorted(a / b for a, b in zip(times[variant], times[base]))
        q1, q2, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
        out[f"{variant} / {base}"] = {"median": q2, "q1": q1, "q3": q3}
    return out


def _stepped(result: Any) -> bool:
    """Every request of an interleaved step got its token (none refused, none failed)."""
    return not result.refused and not result.failed


def print_steps(count: int, found: dict[str, Any] | None) -> None:
    if found is None:
        print(f"decode steps at {count} requests: fewer than two variants hold them all decoding at once")
        return
    medians = ", ".join(f"{v} {s * 1e3:.2f} ms" for v, s in found["median_step_s"].items())
    left = f"; not seated at once: {', '.join(found['unseated'])}" if found["unseated"] else ""
    print(f"decode steps at {count} requests ({found['steps']} interleaved rounds): median {medians}{left}")
    for name, r in found.items():
        if " / " in name:
            print(f"  step time {name}: {r['median']:.3f} (quartiles {r['q1']:.3f}-{r['q3']:.3f})")


def warm_up(args: argparse.Namespace, variants: list[str]) -> None:
    """One short unmeasured run of every variant (two requests, a few tokens): what the process pays
    once (compiled loops loaded, first allocations) lands on none of the measured runs."""
    prompts = held_out_prompts(2, args.prompt_len, args.seed)
    for variant in variants:
        anyio.run(run_once, variant_config(args, variant), prompts, min(8, args.new_tokens))


def median_runs(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each variant's median run by output tokens/s."""
    return {v: sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2] for v, rs in runs.items()}


def sweep_point(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One load of a sweep: each variant's median run and the paired ratios, of tokens/s and of
    tokens per CPU second."""
    return {"results": median_runs(runs), "ratios": paired_ratios(runs),
            "cpu_ratios": paired_ratios(runs, "tokens_per_cpu_s")}


def sweep_json(sweep: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """A sweep's points as written: without the outputs, with who seats each load."""
    return {
        n: {"results": strip(point["results"]), "ratios": point["ratios"],
            "cpu_ratios": point["cpu_ratios"], "seated_by": load_regime(n, point["results"])}
        for n, point in sorted(sweep.items())
    }  # fmt: skip


# (numerator, denominator) variants whose tokens/s ratio is reported, paired repeat by repeat;
# BEST is the better of resident and hisparse in that repeat
BEST = "best of resident, hisparse"
RATIOS = (
    ("hisparse", "resident"),
    ("dynamic", "resident"),
    ("dynamic", "hisparse"),
    ("dynamic", BEST),
    ("hisparse+spec", "hisparse"),
    ("resident+spec", "resident"),
    ("dynamic+spec", "dynamic"),
)


def paired_ratios(
    runs: dict[str, list[dict[str, Any]]], measure: str = "tokens_per_s"
) -> dict[str, dict[str, float]]:
    """``"a / b"`` -> median, low and high of the per-repeat ratios of ``measure`` (tokens/s, or
    tokens per CPU second), for the pairs present."""
    speeds = {v: [r[measure] for r in rs] for v, rs in runs.items()}
    if "resident" in speeds and "hisparse" in speeds:
        speeds[BEST] = [max(a, b) for a, b in zip(speeds["resident"], speeds["hisparse"])]
    out = {}
    controls = [(v, v.removesuffix(CONTROL)) for v in speeds if v.endswith(CONTROL)]
    for a, b in (*RATIOS, *controls):
        if a in speeds and b in speeds:
            values = sorted(x / y for x, y in zip(speeds[a], speeds[b]))
            out[f"{a} / {b}"] = {"median": statistics.median(values), "low": values[0], "high": values[-1]}
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
    "demote",
    "promote",
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
            r.get("demotions", 0),
            r.get("promotions", 0),
        ]
        for name, r in results.items()
    ]


def load_regime(count: int, results: dict[str, dict[str, Any]]) -> str:
    """Which layouts seat ``count`` requests at once: "resident" (all-resident does), "hisparse"
    (only HiSparse does), "neither" (more than HiSparse seats; "?" without both variants)."""
    if "resident" not in results or "hisparse" not in results:
        return "?"
    if count <= results["resident"]["seats"]:
        return "resident"
    return "hisparse" if count <= results["hisparse"]["seats"] else "neither"


SWEEP_RATIOS = ("dynamic / resident", "dynamic / hisparse", f"dynamic / {BEST}")


def sweep_rows(
    sweep: dict[int, dict[str, Any]], variants: list[str], measure: str = "tokens_per_s"
) -> tuple[list[str], list[list[object]]]:
    """The sweep's summary: per load, who seats it, each variant's ``measure`` (its median run by
    tokens/s), dynamic's demotions and promotions, and the dynamic ratios of ``measure`` (median and
    range), and the control's against its variant (``--control``)."""
    key = "ratios" if measure == "tokens_per_s" else "cpu_ratios"
    controls = [f"{v} / {v.removesuffix(CONTROL)}" for v in variants if v.endswith(CONTROL)]
    ratio_names = [n for n in (*SWEEP_RATIOS, *controls) if any(n in point[key] for point in sweep.values())]
    unit = "tok/s" if measure == "tokens_per_s" else "tok/CPU s"
    headers = ["requests", "seated by", *(f"{v} {unit}" for v in variants)]
    if "dynamic" in variants:
        headers += ["dyn demote / promote"]
    headers += ratio_names
    rows = []
    for count, point in sorted(sweep.items()):
        results, ratios = point["results"], point[key]
        speeds = [results[v][measure] for v in variants]
        row: list[object] = [count, load_regime(count, results), *speeds]
        if "dynamic" in variants:
            row.append(f"{results['dynamic']['demotions']} / {results['dynamic']['promotions']}")
        for name in ratio_names:
            r = ratios.get(name)
            row.append("-" if r is None else f"{r['median']:.2f} ({r['low']:.2f}-{r['high']:.2f})")
        rows.append(row)
    return headers, rows


def plot(sweep: dict[int, dict[str, dict[str, Any]]], path: str, title: str) -> None:
    """Output tokens/s of each variant against the requests offered (left) and against the mean
    running requests (right; labels: the requests offered)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_load, by_running) = plt.subplots(1, 2, figsize=(11, 4.2))
    variants = next(iter(sweep.values())).keys()
    for variant in variants:
        offered = sorted((n, r[variant]["tokens_per_s"]) for n, r in sweep.items())
        by_load.plot([p[0] for p in offered], [p[1] for p in offered], marker="o", label=variant)
        points = sorted((r[variant]["mean_running"], r[variant]["tokens_per_s"], n) for n, r in sweep.items())
        by_running.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=variant)
        for x, y, n in points:
            by_running.annotate(str(n), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    by_load.set_xscale("log", base=2)
    by_load.set_xticks(sorted(sweep), [str(n) for n in sorted(sweep)])
    by_load.set_xlabel("requests offered (arriving together)")
    by_running.set_xlabel("mean running requests (labels: requests offered)")
    for ax in (by_load, by_running):
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
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
    if len(set(variants)) < len(variants):
        parser.error(f"--variants: {args.variants!r} names a variant twice (--control runs one again)")
    if args.control and variants:
        variants.append(variants[0] + CONTROL)
    budget = format_bytes(args.device_memory)
    ratio = args.ratio or "per plan"
    title = (
        f"{args.model}, {budget} device budget, {args.prompt_len}+{args.new_tokens} tokens, HOT {args.hot}, "
        f"ratio {ratio}"
    )
    if args.warmup:
        warm_up(args, variants)
    runs = run_all(args, variants, args.requests)
    results = median_runs(runs)
    repeats = f", median of {args.repeats} alternating runs" if args.repeats > 1 else ""
    print(f"{title}, {args.requests} requests arriving together ({threads} threads{repeats})")
    print(table(HEADERS, rows_of(results)))
    ratios, cpu_ratios = paired_ratios(runs), paired_ratios(runs, "tokens_per_cpu_s")
    for what, found in (("tokens/s", ratios), ("tokens per CPU second", cpu_ratios)):
        for name, r in found.items():
            print(f"{what} {name}: {r['median']:.2f} (range {r['low']:.2f}-{r['high']:.2f})")
    payload: dict[str, Any] = {
        "machine": machine(),
        "args": vars(args),
        "results": strip(results),
        "ratios": ratios,
        "cpu_ratios": cpu_ratios,
        "runs": {v: [{f: x for f, x in r.items() if f != "outputs"} for r in rs] for v, rs in runs.items()},
    }
    first = runs[variants[0]][0]["outputs"]
    same = {v: all(r["outputs"] == first for r in runs[v]) for v in variants[1:]}
    if same:
        print(f"greedy outputs equal {variants[0]}'s: {same}")
        payload["outputs_equal"] = same
    sweep_counts = [int(n) for n in args.sweep.split(",") if n]
    if sweep_counts:
        sweep: dict[int, dict[str, Any]] = {
            args.requests: {"results": results, "ratios": ratios, "cpu_ratios": cpu_ratios}
        }
        for n in sweep_counts:
            if n not in sweep:
                sweep[n] = sweep_point(run_all(args, variants, n))
        for n in sorted(sweep):
            print(f"\n{n} requests")
            print(table(HEADERS, rows_of(sweep[n]["results"])))
        for measure in ("tokens_per_s", "tokens_per_cpu_s"):
            headers, rows = sweep_rows(sweep, variants, measure)
            print(f"\nsweep, {measure} ({args.repeats} alternating runs a point; ratios: median (range))")
            print(table(headers, rows))
        plot({n: point["results"] for n, point in sweep.items()}, args.plot, title)
        print(f"plot: {args.plot}")
        payload["sweep"] = sweep_json(sweep)
    if args.interleaved_steps:
        payload["steps"] = {}
        for n in sorted({args.requests, *sweep_counts}):
            step_times = interleaved_steps(args, variants, n, args.interleaved_steps)
            print_steps(n, step_times)
            payload["steps"][n] = step_times
    write_json(args.out, payload)
    return 0


def strip(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k: {f: v for f, v in r.items() if f != "outputs"} for k, r in results.items()}
