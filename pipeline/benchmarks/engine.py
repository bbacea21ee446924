"""``hispec bench engine``: throughput of the async engine beside the synchronous driver.

For each concurrency (default 1, 8 and 32 requests submitted at once) both run the same prompts
with the same configuration and model, greedy, in the same process; the two alternate run by run
(driver first on even repeats, engine first on odd ones) so that machine noise hits both alike.
Reported: generated tokens per second from the first submission to the last completion (engine
start-up and executor construction excluded on both sides), the median over repeats, and the ratio
engine / driver as the median of each repeat's paired ratio (with its range). Beside it, the share of
the engine's wall time that its executor spent inside device commands: the rest is the pipeline's
own cost (event loop, stages, thread hand-offs), a figure the machine's noise hardly moves. Greedy
outputs must be identical; the report says whether they are.

The bundled model is used when present; otherwise a random tiny model, with a note (its speed is
representative, its text is not).
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from typing import TYPE_CHECKING, Any

import anyio

from pipeline.benchmarks import loop_lag
from pipeline.benchmarks.common import batch_config, machine, table, write_json
from pipeline.config import EngineConfig
from pipeline.logs import configure_logging

if TYPE_CHECKING:
    from pipeline.engine import Engine


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' (bundled) or an HF-format directory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-spec", action="store_true")
    parser.add_argument("--no-hisparse", action="store_true")
    parser.add_argument(
        "--hot",
        type=int,
        default=128,
        help="HiSparse device buffer (hot columns; >= the model's index_topk; default: the engine's)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-engine.json")
    parser.add_argument("-v", "--verbose", action="store_true", help="print an error's traceback too")
    loop_lag.add_args(parser)


def load_or_random(args: argparse.Namespace):
    """(model, note): the requested checkpoint, or a random tiny model if it cannot be loaded."""
    from pipeline.model import ModelConfig, init_weights, load_model
    from pipeline.model.checkpoint import parse_dtype
    from pipeline.model.model import DeepseekV32

    try:
        return load_model(args.model, dtype=args.dtype), ""
    except Exception as exc:  # missing or unreadable checkpoint
        note = f"model {args.model!r} unavailable ({type(exc).__name__}): a random tiny model stands in"
    cfg = ModelConfig.from_hf_dict(RANDOM_TINY)
    model = init_weights(DeepseekV32(cfg), seed=args.seed)
    return model.to_dtype(parse_dtype(args.dtype)).eval(), note


RANDOM_TINY = dict(
    model_type="deepseek_v32", vocab_size=257, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1,
    num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=4096, index_topk=16,
    index_n_heads=2, index_head_dim=8, num_nextn_predict_layers=1, eos_token_id=256,
    routed_scaling_factor=1.0, norm_topk_prob=True, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0,
    tie_word_embeddings=False,
)  # fmt: skip


def prompts_for(args: argparse.Namespace, count: int) -> list[list[int]]:
    try:
        from pipeline.benchmarks.common import held_out_prompts

        return held_out_prompts(count, args.prompt_len, args.seed)
    except Exception:  # no corpus on this machine: random bytes
        import torch

        gen = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, 256, (count, args.prompt_len), generator=gen).tolist()


def engine_config(args: argparse.Namespace, concurrency: int) -> EngineConfig:
    return batch_config(
        args,
        requests=concurrency,
        prompt_len=args.prompt_len,
        hisparse=not args.no_hisparse,
        num_steps=None if args.no_spec else 3,
    )


def run_driver(model, cfg, prompts, params) -> tuple[float, list[list[int]]]:
    from pipeline.driver import SyncDriver
    from pipeline.executor import Executor

    executor = Executor(cfg, model=model)
    driver = SyncDriver(executor)
    start = time.perf_counter()
    reqs = driver.generate(prompts, params)
    seconds = time.perf_counter() - start
    executor.close()
    return seconds, [list(r.output_ids) for r in reqs]


def run_engine(model, cfg, prompts, params) -> tuple[float, list[list[int]], float]:
    """(seconds, outputs, share of those seconds the executor spent inside commands)."""
    from pipeline.engine import Engine

    outputs: list[list[int]] = [[] for _ in prompts]

    async def main() -> tuple[float, float]:
        async with Engine(cfg, model=model) as engine:

            async def one(i: int) -> None:
                result = await engine.generate_text(prompts[i], params, request_id=f"req-{i}")
                outputs[i] = list(result.token_ids)

            busy = _busy_seconds(engine)
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            seconds = time.perf_counter() - start
            return seconds, (_busy_seconds(engine) - busy) / seconds

    seconds, busy_share = anyio.run(main)
    return seconds, outputs, busy_share


def _busy_seconds(engine: Engine) -> float:
    """The engine's executor-busy time so far (``Engine.stats``)."""
    busy = engine.stats()["executor_busy_s"]
    assert isinstance(busy, int | float)
    return float(busy)


def measure(args, model, concurrency: int) -> dict[str, Any]:
    from pipeline.sampling import SamplingParams

    cfg = engine_config(args, concurrency)
    prompts = prompts_for(args, concurrency)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {"driver": [], "engine": []}
    busy: list[float] = []
    identical = True
    for repeat in range(args.repeats):
        order = ("driver", "engine") if repeat % 2 == 0 else ("engine", "driver")
        outputs = {}
        for name in order:
            if name == "driver":
                seconds, outputs[name] = run_driver(model, cfg, prompts, params)
            else:
                seconds, outputs[name], share = run_engine(model, cfg, prompts, params)
                busy.append(share)
            rates[name].append(sum(len(o) for o in outputs[name]) / seconds)
        identical &= outputs["driver"] == outputs["engine"]
    driver, engine = statistics.median(rates["driver"]), statistics.median(rates["engine"])
    # each repeat runs both back to back: the median of the paired ratios cancels the machine's drift
    paired = [e / d for e, d in zip(rates["engine"], rates["driver"])]
    return {
        "concurrency": concurrency,
        "driver_tokens_per_s": driver,
        "engine_tokens_per_s": engine,
        "ratio": statistics.median(paired),
        "ratio_min_max": [min(paired), max(paired)],
        # the engine's own cost, free of the machine's noise: 1 - this is the event loop's share
        "engine_executor_busy_share": statistics.median(busy),
        "runs": rates,
        "outputs_identical": identical,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hispec bench engine", description=__doc__.split("\n\n")[0])
    add_args(parser)
    args = parser.parse_args(argv)
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    sink = configure_logging(level="warning", stream=io.StringIO())  # both sides log the same events
    model, note = load_or_random(args)
    if args.loop_lag:
        return lag_main(args, model, note, sink)
    rows = [measure(args, model, c) for c in args.concurrency]
    sink.close()
    report = {"bench": "engine", **header(args, note), "prompt_len": args.prompt_len, "rows": rows}
    write_json(args.out, report)
    if note:
        print(f"note: {note}")
    spec = "speculative (3 steps)" if report["speculative"] else "plain"
    mode = f"{spec}, HiSparse {'on' if report['hisparse'] else 'off'}"
    print(
        f"model {report['model']} {args.dtype}, {mode}, prompts of {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens, median of {args.repeats}, {torch.get_num_threads()} threads"
    )
    print(table(
        ["concurrent requests", "sync driver tokens/s", "engine tokens/s", "engine / driver (paired median)",
         "range", "engine time in executor commands", "same tokens"],
        [[r["concurrency"], r["driver_tokens_per_s"], r["engine_tokens_per_s"], r["ratio"],
          "{:.2f}-{:.2f}".format(*r["ratio_min_max"]), f"{r['engine_executor_busy_share']:.1%}",
          "yes" if r["outputs_identical"] else "NO"] for r in rows],
    ))  # fmt: skip
    return 0


def header(args: argparse.Namespace, note: str) -> dict[str, object]:
    """What both reports say of the run: the machine, the model and the engine's mode."""
    return {
        "machine": machine(),
        "model": args.model if not note else "random tiny",
        "note": note,
        "dtype": args.dtype,
        "speculative": not args.no_spec,
        "hisparse": not args.no_hisparse,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
    }


def lag_main(args: argparse.Namespace, model, note: str, sink) -> int:
    """``--loop-lag``: the host loop's lag beside tokens/s, mode by mode (``loop_lag``)."""
    import torch

    result = loop_lag.measure(args, model)
    sink.close()
    report = {"bench": "engine-loop-lag", **header(args, note), "tick_ms": args.tick_ms, **result}
    write_json(args.out, report)
    if note:
        print(f"note: {note}")
    spec = "speculative (3 steps)" if report["speculative"] else "plain"
    print(
        f"model {report['model']} {args.dtype}, {spec}, HiSparse {'on' if report['hisparse'] else 'off'}, "
        f"{args.requests} text prompts at once (one of {args.long_prompt_len} bytes, the others "
        f"{args.prompt_len}), {args.new_tokens} new tokens, a {args.tick_ms:g} ms ticker; median (range) "
        f"of {args.repeats}, {torch.get_num_threads()} threads"
    )
    print(table(*loop_lag.report_table(result)))
    print(f"same tokens in every mode: {'yes' if result['outputs_identical'] else 'NO'}")
    return 0
