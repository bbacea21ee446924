"""``hispec bench spec``: speculative decoding with num_steps 1..N beside plain decoding, in one run.

Held-out prompts, greedy, batch 1 (or ``--batch``), HiSparse on unless ``--no-hisparse``. For each
configuration it reports the accept length (tokens committed per verify, bonus included), the accept
rate (drafts accepted / proposed) and decode tokens/s (from the first output token to the last, so
prefill is excluded), and the speed-up over plain decoding. Configurations alternate prompt by
prompt, so machine noise hits all of them alike, in an order that goes through every order of them
from one prompt to the next (each configuration runs right after each other one equally often:
what ran just before moves a run's speed); the whole alternation runs ``--repeats`` times.
Tokens/s is the median over repeats; the speed-up is the median of the paired per-prompt ratios
(each configuration against plain decoding on the same prompt in the same repeat), which cancels
the drift of a shared machine between prompts. The outputs must be identical (greedy is lossless);
the benchmark says so if they are not.
"""

from __future__ import annotations

import argparse
import itertools

from pipeline import cli_config
from pipeline.benchmarks.common import (
    add_common_args,
    held_out_prompts,
    machine,
    measured,
    median,
    setup,
    table,
    write_json,
)
from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.speculative.metrics import SpecCounters


def engine_config(args: argparse.Namespace, num_steps: int) -> EngineConfig:
    ctx = args.prompt_len + args.new_tokens + 16
    pages = -(-(ctx + 16) * args.batch // args.page_size) * args.page_size
    return cli_config.engine_config(
        args,
        max_context_len=ctx,
        max_running_requests=args.batch,
        device_pool_tokens=max(pages, args.hot + args.page_size),
        hisparse=None
        if args.no_hisparse
        else HiSparseConfig(device_buffer_size=args.hot, host_to_device_ratio=2),
        speculative=SpeculativeConfig(num_steps=num_steps) if num_steps else None,
    )


def run_batch(
    executor: Executor, prompts: list[list[int]], new_tokens: int
) -> tuple[list[list[int]], float, int]:
    """Greedy generation of one batch; returns (outputs, decode seconds, decode tokens)."""
    from pipeline.sampling import SamplingParams

    driver = SyncDriver(executor)
    reqs = driver.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    first = min(measured(r.metrics.first_token_time) for r in reqs)
    last = max(measured(r.metrics.last_token_time) for r in reqs)
    return [r.output_ids for r in reqs], last - first, sum(len(r.output_ids) - 1 for r in reqs)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hispec bench spec", description=__doc__)
    add_common_args(parser, "bench-spec.json")
    parser.add_argument("--max-steps", type=int, default=3, help="num_steps 1..this")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hot", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--no-hisparse", action="store_true")
    args = parser.parse_args(argv)
    threads = setup(args.threads)
    steps = list(range(0, args.max_steps + 1))
    executors: dict[int, Executor] = {0: Executor(engine_config(args, 0))}
    for k in steps[1:]:
        executors[k] = Executor(engine_config(args, k), model=executors[0].model)
    prompts = held_out_prompts(args.prompts, args.prompt_len, args.seed)
    per_repeat: dict[int, list[float]] = {k: [] for k in steps}  # tokens/s of each whole repeat
    ratios: dict[int, list[float]] = {k: [] for k in steps}  # paired per-prompt speed-ups
    identical = True
    orders = list(itertools.permutations(steps))  # each after each other equally often (docstring)
    turn = 0
    for _ in range(args.repeats):
        seconds = dict.fromkeys(steps, 0.0)
        tokens = dict.fromkeys(steps, 0)
        for start in range(0, len(prompts), args.batch):
            batch = prompts[start : start + args.batch]
            outputs, rates = {}, {}
            for k in orders[turn % len(orders)]:
                outputs[k], sec, count = run_batch(executors[k], batch, args.new_tokens)
                seconds[k] += sec
                tokens[k] += count
                rates[k] = count / sec
            turn += 1
            for k in steps:
                ratios[k].append(rates[k] / rates[0])
            identical &= all(outputs[k] == outputs[0] for k in steps)
        for k in steps:
            per_repeat[k].append(tokens[k] / seconds[k])
    report = summarize(args, steps, executors, per_repeat, ratios, identical, threads)
    write_json(args.out, report)
    print_report(report)
    for executor in executors.values():
        executor.close()
    return 0


def summarize(args, steps, executors, per_repeat, ratios, identical, threads) -> dict:
    rows = {}
    for k in steps:
        counters: SpecCounters | None = executors[k].spec_counters
        rows[k] = {
            "num_steps": k,
            "tokens_per_s": median(per_repeat[k]),
            "tokens_per_s_repeats": per_repeat[k],
            "speedup": median(ratios[k]),
            "speedup_min_max": [min(ratios[k]), max(ratios[k])],
            "accept_length": None if counters is None else counters.accept_length,
            "accept_rate": None if counters is None else counters.accept_rate,
            "accepted_per_pos": None if counters is None else counters.accepted_per_pos,
            "verify_rounds": None if counters is None else counters.verify_rounds,
        }
    return {
        "bench": "spec",
        "machine": machine(),
        "model": args.model,
        "dtype": args.dtype,
        "hisparse": not args.no_hisparse,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "batch": args.batch,
        "repeats": args.repeats,
        "threads": threads,
        "outputs_identical_to_plain": identical,
        "configs": rows,
    }


def print_report(r: dict) -> None:
    print(
        f"model {r['model']} {r['dtype']}, HiSparse {'on' if r['hisparse'] else 'off'}, "
        f"{r['prompts']} held-out prompts of {r['prompt_len']} tokens, {r['new_tokens']} new tokens, "
        f"batch {r['batch']}, {r['threads']} threads, {r['repeats']} repeats"
    )
    rows = []
    for k, c in r["configs"].items():
        name = "plain" if int(k) == 0 else f"spec, {k} steps"
        length, rate = c["accept_length"], c["accept_rate"]
        shown = ["-" if v is None else v for v in (length, rate)]
        low, high = c["speedup_min_max"]
        rows.append([name, *shown, c["tokens_per_s"], c["speedup"], f"{low:.2f}-{high:.2f}"])
    print(
        table(
            [
                "decoding",
                "accept length",
                "accept rate",
                "decode tokens/s",
                "vs plain (median)",
                "per-prompt range",
            ],
            rows,
        )
    )
    print(f"outputs identical to plain greedy: {r['outputs_identical_to_plain']}")
