"""``hispec bench engine --loop-lag``: how long the engine holds its host's event loop.

An application that embeds an engine shares its event loop with it. Here a ticker task of that loop
asks to wake every millisecond (``anyio.sleep(0.001)``, ``--tick-ms``) while the engine serves a
mixed load: a wave of concurrent requests given as text (``--requests``, default 10), one of them a
long prompt (``--long-prompt-len`` bytes, default 1,800) among short ones (``--prompt-len``). A
tick's *lag* is how much later than asked it woke: the time something else held the loop (or the
GIL, or the CPU) when the ticker was due. Each repeat runs every mode twice: a wave alone, for the
output tokens per second (first submission to last completion) and the process's CPU time (all
threads) per output token, a figure a busy machine moves less than the wall time; and a wave beside
the ticker, for the lag's median, 99th percentile and maximum, the ticks the loop served per second
(turns the engine left the application's own tasks) and the tokens per second meanwhile (the ticks
cost CPU too). Each figure is the median over repeats with its range; tokens/s also as the paired
ratio against the first mode.

Modes (``--modes``): ``loop`` runs the executor's commands on the event loop itself
(``executor_thread=False``), ``thread`` in the executor's thread (``True``), ``default`` as the
configuration's default (``None``); ``idle`` runs the ticker alone for a while, no engine at all:
the lag the machine itself causes (a busy machine delays a waking thread), the floor of the others.
They alternate run by run, the order reversed on odd repeats, after one untimed wave of each
(``--warmup``). Greedy outputs must be identical across modes; the report says whether they are.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Any

import anyio
import attrs

from pipeline.benchmarks.common import batch_config, percentile
from pipeline.config import EngineConfig

# EngineConfig.executor_thread of each mode; "idle" runs the ticker alone (no engine): the machine's own lag
MODES = {"loop": False, "thread": True, "default": None, "idle": None}
IDLE_S = 2.0


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--loop-lag", action="store_true", help="measure the host loop's lag under a mixed load"
    )
    parser.add_argument("--requests", type=int, default=10, help="--loop-lag: concurrent requests in a wave")
    parser.add_argument(
        "--long-prompt-len", type=int, default=1800, help="--loop-lag: the long prompt's bytes"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=["loop", "default"],
        help="--loop-lag: where the commands run (loop, thread, default; idle: the ticker alone)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="--loop-lag: untimed waves of each mode first")
    parser.add_argument("--tick-ms", type=float, default=1.0, help="--loop-lag: the ticker's period")


def text_prompts(args: argparse.Namespace) -> list[str]:
    """One long text prompt among short ones (held-out text; random letters without the corpus)."""
    lengths = [args.long_prompt_len] + [args.prompt_len] * (args.requests - 1)
    try:
        from pipeline.benchmarks.common import held_out_prompts

        windows = [w[:n] for w, n in zip(held_out_prompts(len(lengths), max(lengths), args.seed), lengths)]
    except Exception:  # no corpus on this machine
        import random

        rng = random.Random(args.seed)
        windows = [[rng.randrange(97, 123) for _ in range(n)] for n in lengths]
    # one byte a token with the bundled tokenizer; the end-of-document id is not text
    return [bytes(t for t in w if t < 128).decode("ascii") for w in windows]


def lag_config(args: argparse.Namespace) -> EngineConfig:
    return batch_config(
        args,
        requests=args.requests,
        prompt_len=args.long_prompt_len,
        hisparse=not args.no_hisparse,
        num_steps=None if args.no_spec else 3,
    )


def run_wave(model, cfg: EngineConfig, prompts: list[str], params, tick_s: float | None) -> dict[str, Any]:
    """One wave of ``prompts`` at once, beside a ticker (``tick_s`` None: none): tokens/s, the
    process's CPU time per token, the ticks' lags, the outputs."""
    from pipeline.engine import Engine

    outputs: list[list[int]] = [[] for _ in prompts]
    lags: list[float] = []
    cpu = [0.0]  # the process's CPU seconds over the wave, all threads

    async def ticker(done: anyio.Event, period: float) -> None:
        while not done.is_set():
            due = time.perf_counter() + period
            await anyio.sleep(period)
            lags.append(max(0.0, time.perf_counter() - due))

    async def main() -> float:
        async with Engine(cfg, model=model) as engine:

            async def one(i: int) -> None:
                result = await engine.generate_text(prompts[i], params, request_id=f"req-{i}")
                outputs[i] = list(result.token_ids)

            done = anyio.Event()
            async with anyio.create_task_group() as tg:
                if tick_s is not None:
                    tg.start_soon(ticker, done, tick_s)
                    await anyio.sleep(0)  # the ticker is waiting before the first request arrives
                start, cpu[0] = time.perf_counter(), _cpu_seconds()
                async with anyio.create_task_group() as requests:
                    for i in range(len(prompts)):
                        requests.start_soon(one, i)
                seconds = time.perf_counter() - start
                cpu[0] = _cpu_seconds() - cpu[0]
                done.set()
            return seconds

    seconds = anyio.run(main)
    tokens = sum(len(o) for o in outputs)
    return {
        "tokens_per_s": tokens / seconds,
        "cpu_ms_per_token": 1e3 * cpu[0] / tokens,
        "lag_ms": _lag_ms(lags),
        "ticks_per_s": len(lags) / seconds,
        "outputs": outputs,
    }


def run_idle(seconds: float, tick_s: float) -> dict[str, Any]:
    """The ticker alone for ``seconds``: the machine's own lag."""
    lags: list[float] = []

    async def main() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            due = time.perf_counter() + tick_s
            await anyio.sleep(tick_s)
            lags.append(max(0.0, time.perf_counter() - due))

    cpu = _cpu_seconds()
    anyio.run(main)
    cpu = _cpu_seconds() - cpu
    return {
        "lag_ms": _lag_ms(lags),
        "ticks_per_s": len(lags) / seconds,
        "cpu_us_per_tick": 1e6 * cpu / len(lags),
    }


def _lag_ms(lags: list[float]) -> dict[str, float]:
    nan = float("nan")
    if not lags:
        return {"p50": nan, "p99": nan, "max": nan}
    return {"p50": 1e3 * percentile(lags, 0.50), "p99": 1e3 * percentile(lags, 0.99), "max": 1e3 * max(lags)}


def measure(args: argparse.Namespace, model) -> dict[str, Any]:
    """Each repeat runs every mode twice: a wave alone (tokens/s, CPU) and a wave beside the ticker
    (the lag; and tokens/s while the loop also serves the ticks)."""
    from pipeline.sampling import SamplingParams

    cfg = lag_config(args)
    prompts = text_prompts(args)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    tick_s = args.tick_ms / 1e3
    configs = {mode: attrs.evolve(cfg, executor_thread=MODES[mode]) for mode in args.modes}
    outputs: list[list[list[int]]] = []

    def run(mode: str) -> dict[str, Any]:
        if mode == "idle":
            return run_idle(IDLE_S, tick_s)
        alone = run_wave(model, configs[mode], prompts, params, None)
        ticked = run_wave(model, configs[mode], prompts, params, tick_s)
        outputs.extend([alone.pop("outputs"), ticked.pop("outputs")])
        return {**alone, "lag_ms": ticked["lag_ms"], "ticks_per_s": ticked["ticks_per_s"],
                "beside_ticker_tokens_per_s": ticked["tokens_per_s"]}  # fmt: skip

    for _ in range(args.warmup):
        for mode in args.modes:
            run(mode)
    outputs.clear()
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    for repeat in range(args.repeats):
        for mode in args.modes if repeat % 2 == 0 else args.modes[::-1]:
            runs[mode].append(run(mode))
    first = next((m for m in args.modes if m != "idle"), "idle")  # (idle alone: no tokens to pair)
    rows = []
    for mode in args.modes:
        row: dict[str, Any] = {"mode": mode, "executor_thread": MODES[mode] if mode != "idle" else None}
        if mode != "idle":
            paired = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs[mode], runs[first])]
            row |= {
                "tokens_per_s": _spread([r["tokens_per_s"] for r in runs[mode]]),
                "tokens_per_s_vs": _spread(paired),
                "cpu_ms_per_token": _spread([r["cpu_ms_per_token"] for r in runs[mode]]),
                "beside_ticker_tokens_per_s": _spread([r["beside_ticker_tokens_per_s"] for r in runs[mode]]),
            }
        row |= {f"lag_{q}_ms": _spread([r["lag_ms"][q] for r in runs[mode]]) for q in ("p50", "p99", "max")}
        row |= {"ticks_per_s": _spread([r["ticks_per_s"] for r in runs[mode]]), "runs": runs[mode]}
        rows.append(row)
    return {
        "requests": args.requests,
        "prompt_bytes": [len(p) for p in prompts],
        "paired_against": first,
        "outputs_identical": all(o == outputs[0] for o in outputs),
        "rows": rows,
    }


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def report_table(result: dict[str, Any]) -> tuple[list[str], list[list[object]]]:
    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        if key not in row:
            return "-"
        s = row[key]
        return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"

    headers = [
        "mode", "tokens/s", f"/ {result['paired_against']} (paired)", "CPU ms / token",
        "tokens/s beside the ticker", "lag p50 ms", "lag p99 ms", "lag max ms", "ticks / s",
    ]  # fmt: skip
    rows: list[list[object]] = [
        [r["mode"], cell(r, "tokens_per_s", ".0f"), cell(r, "tokens_per_s_vs", ".2f"),
         cell(r, "cpu_ms_per_token", ".2f"), cell(r, "beside_ticker_tokens_per_s", ".0f"),
         cell(r, "lag_p50_ms", ".2f"), cell(r, "lag_p99_ms", ".1f"), cell(r, "lag_max_ms", ".1f"),
         cell(r, "ticks_per_s", ".0f")]
        for r in result["rows"]
    ]  # fmt: skip
    return headers, rows
