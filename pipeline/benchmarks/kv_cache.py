"""``hispec bench kv-cache``: what an FP8 KV cache does to the output, against bfloat16 KV.

Two measures on held-out prompts, the model's weights and compute in ``--dtype`` (bfloat16):

* **teacher-forced**: one prefill forward over each window with its KV stored as bfloat16 and as
  FP8 (the forward writes every row and then reads them back through the cache, so every attention
  read sees the stored values): top-1 agreement of the next-token predictions, the logit error
  (mean and worst absolute difference, and the mean relative to the logits' spread), the KL
  divergence of FP8's distribution from bfloat16's, and each one's held-out loss;
* **generated**: greedy continuations through the engine with ``kv_cache_dtype="auto"`` and
  ``"fp8_e4m3"``: the share of continuations identical to bfloat16's and the share of tokens
  produced before the first difference.

The numbers are a property of the model and the prompts (nothing here is timed).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from pipeline.benchmarks.common import held_out_prompts, machine, setup, table, write_json
from pipeline.capacity import kv_format
from pipeline.config import EngineConfig, HiSparseConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.model.loader import load_model
from pipeline.model.model import DeepseekV32
from pipeline.model.resident import ForwardLayout, ResidentBackend, ResidentKV
from pipeline.sampling import SamplingParams

KINDS = ("auto", "fp8_e4m3")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hispec bench kv-cache", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="'tiny' (bundled) or an HF-format directory")
    p.add_argument("--dtype", default="bfloat16", help="weights, compute and the unquantized KV")
    p.add_argument("--prompts", type=int, default=16, help="held-out windows")
    p.add_argument("--prompt-len", type=int, default=384)
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated per prompt")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_kv_cache.json", help="JSON results")
    return p.parse_args(argv)


@torch.no_grad()
def window_logits(model: DeepseekV32, ids: list[int], kind: str) -> torch.Tensor:
    """``[T, V]`` float32 logits of one prefill forward over ``ids`` with its KV stored as ``kind``."""
    cfg, n = model.cfg, len(ids)
    fmt = kv_format(cfg, model.dtype, kind)
    layers = cfg.num_cache_layers
    store = ResidentKV(
        kv=torch.zeros(layers, n, fmt.row_width, dtype=fmt.storage_dtype, device=model.device),
        index_k=torch.zeros(layers, n, fmt.key_width, dtype=fmt.storage_dtype, device=model.device),
        req_to_token=torch.full((1, n), -1, dtype=torch.int64, device=model.device),
        format=fmt,
    )
    backend = ResidentBackend(store)
    positions = torch.arange(n, device=model.device)
    backend.begin(ForwardLayout(torch.zeros_like(positions), positions, positions))
    hidden = model.forward(torch.tensor(ids, device=model.device), positions, backend)
    return model.logits(hidden).float()


def teacher_forced(model: DeepseekV32, prompts: list[list[int]]) -> dict[str, float]:
    agree = total = 0
    err_sum = err_max = rel_sum = kl_sum = 0.0
    loss = dict.fromkeys(KINDS, 0.0)
    for ids in prompts:
        ref, fp8 = (window_logits(model, ids, kind) for kind in KINDS)
        agree += int((ref.argmax(-1) == fp8.argmax(-1)).sum())
        total += ref.shape[0]
        diff = (fp8 - ref).abs()
        err_sum += float(diff.mean(-1).sum())
        err_max = max(err_max, float(diff.max()))
        rel_sum += float((diff.mean(-1) / ref.std(-1).clamp_min(1e-12)).sum())
        kl_sum += float(F.kl_div(fp8.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                 reduction="none").sum(-1).sum())
        target = torch.tensor(ids[1:], device=ref.device)
        for kind, logits in zip(KINDS, (ref, fp8), strict=True):
            loss[kind] += float(F.cross_entropy(logits[:-1], target, reduction="sum"))
    predicted = total - len(prompts)
    return {
        "positions": total,
        "top1_agreement": agree / total,
        "logit_abs_error_mean": err_sum / total,
        "logit_abs_error_max": err_max,
        "logit_error_over_spread": rel_sum / total,
        "kl_bf16_to_fp8_mean": kl_sum / total,
        "loss_bf16_kv": loss["auto"] / predicted,
        "loss_fp8_kv": loss["fp8_e4m3"] / predicted,
    }


def generated(model: DeepseekV32, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    for kind in KINDS:
        config = EngineConfig(
            dtype=args.dtype, kv_cache_dtype=kind, max_context_len=args.prompt_len + args.new_tokens + 16,
            max_running_requests=len(prompts), speculative=None, hisparse=HiSparseConfig(),
            seed=args.seed,
        )
        executor = Executor(config, model=model)
        try:
            reqs = SyncDriver(executor).generate(prompts, params)
        finally:
            executor.close()
        failed = [r.error for r in reqs if r.finish_reason != "length"]
        if failed:
            raise RuntimeError(f"kv_cache_dtype={kind}: {failed[0]}")
        outputs[kind] = [r.output_ids for r in reqs]
    same = prefix = 0
    for ref, fp8 in zip(outputs["auto"], outputs["fp8_e4m3"], strict=True):
        same += ref == fp8
        prefix += next((i for i, (a, b) in enumerate(zip(ref, fp8, strict=True)) if a != b), len(ref))
    return {
        "continuations": len(prompts),
        "identical_continuations": same / len(prompts),
        "tokens_before_first_difference": prefix / (len(prompts) * args.new_tokens),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = setup(args.threads)
    model = load_model(args.model, dtype=args.dtype)
    prompts = held_out_prompts(args.prompts, args.prompt_len, args.seed)
    forced = teacher_forced(model, prompts)
    gen = generated(model, args, prompts)
    rows = [[k, v] for k, v in {**forced, **gen}.items()]
    print(f"FP8 KV against {args.dtype} KV: {args.model}, {args.prompts} held-out prompts of "
          f"{args.prompt_len} tokens, {args.new_tokens} greedy tokens each")
    print(table(["measure", "value"], rows))
    write_json(args.out, {"args": vars(args), "machine": {**machine(), "threads": threads},
                          "teacher_forced": forced, "generated": gen})
    return 0


if __name__ == "__main__":
    sys.exit(main())
