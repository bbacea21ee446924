"""``hispec bench peer``: the engine beside HF transformers ``generate`` on the same weights.

One process, one checkpoint (HF loads the same directory with ``AutoModelForCausalLM``, i.e. its
DeepSeek-V3.2 class), greedy, the same prompts. Three configurations alternate within every repeat:
HF ``generate`` on a left-padded batch, the engine decoding plainly, and the engine with MTP
speculation; both engine configurations run HiSparse. Repeat by repeat the order goes through all
six orders of the three, so that each configuration runs first, second and third, and right after
each of the others, equally often (over 6 repeats): a run is affected by the one before it, enough
to move a paired ratio by a few per cent when one configuration mostly follows another
(docs/performance-notes.md). Workloads: batches of ``--concurrency``
requests with ``--prompt-len``-byte prompts, and one ``--long-prompt-len``-byte prompt alone.

Reported per workload and configuration (medians over repeats): generated tokens per second from
the first submission to the last completion (engine start-up and HF's model load excluded), and time
to first token. On the engine's side that is each request's own ``time_to_first_token``, the median
over the batch; on HF's side a separate ``generate(max_new_tokens=1)`` of the whole batch, since its
requests all get their first token together. Before the repeats, ``--warmup`` untimed runs of every
configuration (default 1) pay for what a process's first run pays once (first touches of freshly
mapped memory: a first engine run page-faults many thousands of times, the later ones a few;
lazy compilation), which would otherwise fall on whichever configuration the first repeat runs
first. Ratios are the medians of each repeat's paired ratio
(engine / HF; above 1 is faster for tokens/s, below 1 is faster for time to first token) with their
min-max range. HF transformers is an optional dependency: ``pip install 'hispec[bench]'``.
"""

from __future__ import annotations

import argparse
import io
import itertools
import statistics
import time
from typing import Any

import anyio
import torch

from pipeline.benchmarks.common import batch_config, held_out_prompts, machine, table, write_json
from pipeline.config import EngineConfig
from pipeline.logs import configure_logging

CONFIGS = ("hf", "plain", "spec")
INSTALL = "bench peer needs HF transformers: pip install 'hispec[bench]' (or: pip install transformers)"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' (bundled) or an HF-format directory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt bytes of the batch workloads")
    parser.add_argument("--long-prompt-len", type=int, default=1500,
                        help="prompt bytes of the single long-prompt workload (0 = skip it)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=6, help="a multiple of 6 balances the orders")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed runs of every configuration per workload before the repeats")
    parser.add_argument("--spec-steps", type=int, default=3, help="draft tokens per verify round")
    parser.add_argument(
        "--hot",
        type=int,
        default=128,
        help="HiSparse device buffer (hot columns; >= the model's index_topk; default: the engine's)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-peer.json")


def engine_config(args: argparse.Namespace, batch: int, prompt_len: int, spec: bool) -> EngineConfig:
    return batch_config(
        args,
        requests=batch,
        prompt_len=prompt_len,
        hisparse=True,
        num_steps=args.spec_steps if spec else None,
    )


def run_engine(args, model, prompts, spec: bool) -> dict[str, Any]:
    """One batch through a fresh engine: seconds, outputs, the median time to first token."""
    from pipeline.engine import Engine
    from pipeline.sampling import SamplingParams

    cfg = engine_config(args, len(prompts), len(prompts[0]), spec)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    results: list = [None] * len(prompts)

    async def main() -> float:
        async with Engine(cfg, model=model) as engine:

            async def one(i: int) -> None:
                results[i] = await engine.generate_text(prompts[i], params, request_id=f"req-{i}")

            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            return time.perf_counter() - start

    seconds = anyio.run(main)
    ttft = statistics.median(r.metrics.time_to_first_token for r in results)
    return {"seconds": seconds, "outputs": [list(r.token_ids) for r in results], "ttft": ttft}


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[B, longest]``, padding on the left as HF batches want."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def run_hf(hf_model, prompts, new_tokens: int, pad_id: int) -> dict[str, Any]:
    ids, mask = left_padded(prompts, pad_id)
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad_id)
    with torch.inference_mode():
        start = time.perf_counter()
        hf_model.generate(**kw, max_new_tokens=1, min_new_tokens=1)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = hf_model.generate(**kw, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "outputs": out[:, ids.shape[1] :].tolist(), "ttft": ttft}


def _paired(mine: list[float], theirs: list[float]) -> dict[str, Any]:
    ratios = [a / b for a, b in zip(mine, theirs)]
    return {"median": statistics.median(ratios), "min_max": [min(ratios), max(ratios)]}


def measure(args, model, hf_model, pad_id: int, batch: int, prompt_len: int) -> dict[str, Any]:
    prompts = held_out_prompts(batch, prompt_len, args.seed)
    rates: dict[str, list[float]] = {c: [] for c in CONFIGS}
    ttfts: dict[str, list[float]] = {c: [] for c in CONFIGS}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.warmup):  # first touches of memory, lazy compilation: not timed
        for name in CONFIGS:
            if name == "hf":
                run_hf(hf_model, prompts, args.new_tokens, pad_id)
            else:
                run_engine(args, model, prompts, spec=name == "spec")
    orders = list(itertools.permutations(CONFIGS))  # each after each other equally often (module docstring)
    for repeat in range(args.repeats):
        for name in orders[repeat % len(orders)]:
            if name == "hf":
                run = run_hf(hf_model, prompts, args.new_tokens, pad_id)
            else:
                run = run_engine(args, model, prompts, spec=name == "spec")
            rates[name].append(sum(len(o) for o in run["outputs"]) / run["seconds"])
            ttfts[name].append(run["ttft"])
            outputs.setdefault(name, run["outputs"])
    row: dict[str, Any] = {
        "batch": batch,
        "prompt_len": prompt_len,
        "runs": {"tokens_per_s": rates, "ttft_s": ttfts},
    }
    for name in CONFIGS:
        row[f"{name}_tokens_per_s"] = statistics.median(rates[name])
        row[f"{name}_ttft_s"] = statistics.median(ttfts[name])
    for name in ("plain", "spec"):
        row[f"{name}_speed_vs_hf"] = _paired(rates[name], rates["hf"])
        row[f"{name}_ttft_vs_hf"] = _paired(ttfts[name], ttfts["hf"])
        # greedy on both sides; HF's indexer breaks score ties arbitrarily, so a difference is possible
        row[f"{name}_same_tokens_as_hf"] = outputs[name] == outputs["hf"]
    return row


def load_hf(args):
    """HF's model of the same checkpoint directory, or None when transformers is missing."""
    try:
        import transformers
    except ImportError:
        return None
    from pipeline.model.checkpoint import parse_dtype
    from pipeline.model.config import resolve_model_dir

    transformers.logging.set_verbosity_error()  # the load report lists the MTP layer's unused tensors
    transformers.logging.disable_progress_bar()
    path = resolve_model_dir(args.model)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(args.dtype)).eval()


def _fmt(ratio: dict[str, Any]) -> str:
    low, high = ratio["min_max"]
    return f"{ratio['median']:.2f}x ({low:.2f}-{high:.2f})"


def print_report(report: dict[str, Any]) -> None:
    args = report["args"]
    print(
        f"model {report['model']} {args['dtype']}, HiSparse on (hot {args['hot']}), speculative "
        f"{args['spec_steps']} steps, {args['new_tokens']} new tokens, median of {args['repeats']}, "
        f"{report['machine']['threads']} threads"
    )
    headers = [
        "batch",
        "prompt bytes",
        "HF tokens/s",
        "plain tokens/s",
        "spec tokens/s",
        "plain / HF",
        "spec / HF",
        "HF TTFT s",
        "plain TTFT / HF",
        "spec TTFT / HF",
        "same tokens as HF (plain, spec)",
    ]
    rows = [
        [
            r["batch"],
            r["prompt_len"],
            r["hf_tokens_per_s"],
            r["plain_tokens_per_s"],
            r["spec_tokens_per_s"],
            _fmt(r["plain_speed_vs_hf"]),
            _fmt(r["spec_speed_vs_hf"]),
            r["hf_ttft_s"],
            _fmt(r["plain_ttft_vs_hf"]),
            _fmt(r["spec_ttft_vs_hf"]),
            ", ".join("yes" if r[f"{n}_same_tokens_as_hf"] else "no" for n in ("plain", "spec")),
        ]
        for r in report["rows"]
    ]
    print(table(headers, rows))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hispec bench peer", description=__doc__.split("\n\n")[0])
    add_args(parser)
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    hf_model = load_hf(args)
    if hf_model is None:
        print(INSTALL)
        return 2
    from pipeline.model import load_model

    sink = configure_logging(level="warning", stream=io.StringIO())
    model = load_model(args.model, dtype=args.dtype)
    pad_id = model.cfg.eos_token_id if model.cfg.eos_token_id is not None else 0
    workloads = [(b, args.prompt_len) for b in args.concurrency]
    if args.long_prompt_len > 0:
        workloads.append((1, args.long_prompt_len))
    rows = []
    for batch, prompt_len in workloads:
        rows.append(measure(args, model, hf_model, pad_id, batch, prompt_len))
        print(f"batch {batch}, {prompt_len}-byte prompts: done", flush=True)
    sink.close()
    report = {"bench": "peer", "machine": machine(), "model": args.model, "args": vars(args), "rows": rows}
    write_json(args.out, report)
    print_report(report)
    return 0
