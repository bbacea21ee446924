"""``hispec bench gpu-check`` (``make gpu-check``): the prepared device check, one command.

1. The tests marked ``cuda`` (``tests/cuda``): every kernel against its torch reference on the device
   at sizes up to DeepSeek-V3.2's, and the engine on the device (HiSparse == all-resident and
   speculation == plain decoding, greedy; bfloat16 serving; the FP8 KV cache; every pool restored).
2. A benchmark on a random model with V3.2's attention shapes (MLA 512 + 64 with 128 heads, an
   indexer of 64 heads of 128, top-k 2,048, HOT 4,096; a few layers, a tiny MLP and vocabulary, so
   that it measures the attention and the KV cache), bfloat16 weights and FP8 KV, at 32K-token
   contexts:

   * swap-in GB/s: ``swap_in`` calls whose every top-k position misses (host rows in pinned memory,
     as the engine keeps them, which the row-copy kernel reads directly), timed around each call,
     beside the same rows' gathered copy alone and a plain pinned host->device copy of the same
     bytes: the link's limit on this machine; and what made the host copies (the kernel, or torch
     after a failed launch, with the error);
   * decode tokens/s of one request, HiSparse beside all-resident, alternating run by run (the
     order reversed every other repeat): the ratio's median and range, paired repeat by repeat;
   * one device memory budget (about two resident requests of the context): the seats each mode's
     plan holds, and output tokens/s of as many requests as HiSparse seats, all arriving together;
   * dynamic residency: a short sweep of the load at one budget (about two resident requests of a
     shorter context), all-resident, HiSparse and dynamic residency serving 1 to about three times
     what all-resident seats, alternating repeat by repeat, with ``hispec bench capacity``'s paired
     ratios (median and range) at each load.

One table is printed and every figure written as JSON (``--out``). Without a CUDA device the same
script runs at CPU sizes (the tests' bodies on the CPU, contexts of a few hundred tokens), after
saying so. The run keeps to a time budget (``--budget-s``; on CUDA the device check's allowance): a
part that would not fit in what is left is skipped with a line saying so. Exit status 0 only if the
tests passed and no part of the benchmark failed.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import attrs
import torch

from kernels import kv_fp8
from pipeline.benchmarks import capacity
from pipeline.benchmarks.common import machine, median, table, write_json
from pipeline.config import EngineConfig, HiSparseConfig
from pipeline.logs import configure_logging

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests" / "cuda"
KV_CACHE_DTYPE = "fp8_e4m3"  # the benchmark's KV cache: V3.2's FP8 layouts


@attrs.frozen
class Profile:
    """The sizes of one run: V3.2's attention on CUDA, a CPU's few hundred tokens."""

    name: str
    context: int  # tokens of a request: prompt and output
    new_tokens: int  # timed decode steps of the one-request runs
    layers: int
    heads: int
    hidden: int
    q_lora: int
    top_k: int
    hot: int
    page: int
    repeats: int  # alternating decode runs of each mode
    swap_requests: int  # requests of one swap-in call
    swap_calls: int  # timed swap-in calls
    seat_cap: int  # at most this many requests in the budget part
    seat_new_tokens: int  # output tokens of each request there
    sweep_context: int  # tokens of a request in the dynamic residency sweep
    sweep_new_tokens: int  # its output tokens
    sweep_chunk: int  # its chunked_prefill_tokens
    sweep_points: int  # loads, at most 4 (``sweep_counts``)
    sweep_repeats: int  # alternating runs of every variant at each load
    sweep_s: float  # what the sweep aims to take (``fit_sweep`` drops repeats, then loads)
    budget_s: float  # the whole run: tests and benchmark
    tests_s: float  # at most this much of it for the tests


CUDA = Profile(name="cuda", context=32768, new_tokens=64, layers=4, heads=128, hidden=2048, q_lora=1536,
               top_k=2048, hot=4096, page=16, repeats=3, swap_requests=8, swap_calls=24, seat_cap=8,
               seat_new_tokens=32, sweep_context=16384, sweep_new_tokens=32, sweep_chunk=2048,
               sweep_points=4, sweep_repeats=3, sweep_s=60, budget_s=510, tests_s=270)
CPU = Profile(name="cpu", context=640, new_tokens=24, layers=2, heads=4, hidden=128, q_lora=64, top_k=64,
              hot=128, page=16, repeats=3, swap_requests=2, swap_calls=24, seat_cap=6, seat_new_tokens=16,
              sweep_context=512, sweep_new_tokens=8, sweep_chunk=512, sweep_points=3, sweep_repeats=2,
              sweep_s=30, budget_s=200, tests_s=110)
DTYPE = "bfloat16"


def model_dict(p: Profile) -> dict[str, Any]:
    """An HF-style config with V3.2's attention (MLA 512 + 64, nope and value heads of 128, an
    indexer of 64 x 128) and ``p``'s heads, layers and top-k; dense MLPs of 256, 1,024 tokens."""
    return dict(
        model_type="deepseek_v32", vocab_size=1024, hidden_size=p.hidden, intermediate_size=256,
        moe_intermediate_size=64, num_hidden_layers=p.layers, num_attention_heads=p.heads,
        num_key_value_heads=p.heads, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=p.layers, kv_lora_rank=512, q_lora_rank=p.q_lora,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=p.context + 4 * p.page + 1024, index_topk=p.top_k, index_n_heads=64,
        index_head_dim=128, num_nextn_predict_layers=0, eos_token_id=1023, routed_scaling_factor=1.0,
        norm_topk_prob=True, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False,
    )  # fmt: skip


def random_model(p: Profile, device: torch.device, seed: int):
    """The model of ``model_dict(p)`` with random weights drawn on ``device`` (normal(0, 0.02)
    matrices, unit norms, zero biases, as ``init_weights`` draws them on the CPU), in bfloat16."""
    from pipeline.model import DeepseekV32, ModelConfig
    from pipeline.model.checkpoint import parse_dtype

    cfg = ModelConfig.from_hf_dict(model_dict(p))
    with torch.device(device):
        model = DeepseekV32(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model.to_dtype(parse_dtype(DTYPE)).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the time budget ----------------------------------------------------------------------------


class Budget:
    """The run's deadline, and each part's outcome: ran, skipped (no time left) or failed."""

    def __init__(self, seconds: float) -> None:
        self.start = time.perf_counter()
        self.seconds = seconds
        self.outcomes: dict[str, str] = {}
        self.errors: dict[str, str] = {}

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def skip(self, part: str, why: str) -> None:
        self.outcomes[part] = "skipped"
        self.errors[part] = why
        left = f"{self.left():.0f} s of {self.seconds:.0f} s left"
        print(f"[gpu-check] SKIPPED {part}: {why} ({left})", flush=True)

    def run(self, part: str, need_s: float, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """``fn()``'s figures, or None when it was skipped (less than ``need_s`` left) or failed."""
        if self.left() < need_s:
            self.skip(part, f"needs about {need_s:.0f} s")
            return None
        print(f"[gpu-check] {part} ...", flush=True)
        began = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # a failed part is reported, and the others still run
            self.outcomes[part] = "failed"
            self.errors[part] = f"{type(exc).__name__}: {exc}"
            print(f"[gpu-check] FAILED {part}:", file=sys.stderr)
            traceback.print_exc()
            return None
        result["seconds"] = time.perf_counter() - began
        self.outcomes[part] = "ran"
        print(f"[gpu-check] {part}: done in {result['seconds']:.1f} s", flush=True)
        return result


# --- 1. the tests ---------------------------------------------------------------------------------


def run_tests(device: torch.device, timeout_s: float) -> dict[str, Any]:
    """``pytest -m cuda tests/cuda``, its output passed through; on a CPU the bodies run there
    (``HISPEC_TEST_DEVICE=cpu``). A run past ``timeout_s`` is stopped and counts as failed."""
    if not TESTS.is_dir():
        return {"passed": False, "returncode": None, "summary": f"no test folder {TESTS}"}
    env = dict(os.environ)
    if device.type != "cuda":
        env["HISPEC_TEST_DEVICE"] = "cpu"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", str(TESTS)]
    began = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    last = ""
    try:
        assert proc.stdout is not None  # (a pipe was asked for)
        for line in proc.stdout:
            print(line, end="", flush=True)
            if line.strip():
                last = line.strip()
        code = proc.wait()
    finally:
        timed_out = not timer.is_alive()
        timer.cancel()
    seconds = time.perf_counter() - began
    summary = f"stopped after {timeout_s:.0f} s" if timed_out and code != 0 else last.strip("= ")
    return {"passed": code == 0, "returncode": code, "summary": summary, "seconds": seconds,
            "device": "cuda" if device.type == "cuda" else "cpu (HISPEC_TEST_DEVICE=cpu)"}


# --- 2a. swap-in bandwidth ------------------------------------------------------------------------


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    sync(device)
    began = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - began, out


def swap_in_bandwidth(p: Profile, model_cfg, device: torch.device) -> dict[str, Any]:
    """Each request's top-k positions all miss (every call takes the next block of K positions past
    the ones its hot region holds): GB/s of the ``swap_in`` call, of its rows' gathered copy alone,
    and of one contiguous copy of as many bytes (pinned host -> device on CUDA: the link's limit)."""
    from kernels.kv_copy import host_launch_failure, load_rows
    from kernels.swap_in import SwapInResult, swap_in

    r, hot, k, ctx, extra = p.swap_requests, p.hot, p.top_k, p.context, p.page
    blocks = (ctx - hot) // k
    if blocks < 3:
        raise ValueError(f"context {ctx} leaves fewer than 3 blocks of top-k {k} past HOT {hot}")
    # one stored FP8 MLA row: bytes (nothing reads them as numbers here)
    dtype, width = kv_fp8.STORAGE, kv_fp8.row_bytes(model_cfg.kv_lora_rank, model_cfg.qk_rope_head_dim)
    pinned = device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (r * ctx, width), generator=gen, dtype=dtype)
    host = host.pin_memory() if pinned else host
    device_kv = torch.zeros(r * (hot + extra), width, dtype=dtype, device=device)
    cols = torch.arange(hot + extra)
    buffer_tokens = torch.where(cols < hot, cols, -1).int().repeat(r, 1).to(device)
    buffer_locs = (torch.arange(r)[:, None] * (hot + extra) + cols).to(device)
    lru = torch.arange(hot, dtype=torch.int32).repeat(r, 1).to(device)
    req_to_host = (torch.arange(r)[:, None] * ctx + torch.arange(ctx)).to(device)
    seq_lens = torch.full((r, 1), ctx, dtype=torch.int64, device=device)
    req_rows = torch.arange(r, device=device)
    tops = [  # [r, 1, k]: block b's positions, shuffled, for every request
        (hot + b * k + torch.randperm(k, generator=gen)).int().repeat(r, 1).view(r, 1, k).to(device)
        for b in range(blocks)
    ]

    def call(i: int) -> SwapInResult:
        tables = (buffer_tokens, buffer_locs, lru, req_to_host)
        return swap_in(tops[i % blocks], seq_lens, req_rows, *tables, host, device_kv, hot, impl="auto")

    for i in range(2):  # untimed: first calls (a Triton kernel's compilation)
        call(i)
    swap_s, rows, all_missed = [], 0, True
    for i in range(2, 2 + p.swap_calls):
        seconds, res = timed(device, partial(call, i))
        misses = int(res.misses.sum())
        all_missed &= misses == r * k
        swap_s.append(seconds)
        rows = misses
    row_bytes = width * device_kv.element_size()
    nbytes = rows * row_bytes
    # the same rows' gathered copy alone: host rows of one block into the hot slots
    h_slots = (torch.arange(r)[:, None] * ctx + hot + torch.randperm(k, generator=gen)).reshape(-1)
    d_slots = (torch.arange(r)[:, None] * (hot + extra) + torch.randperm(hot, generator=gen)[:k]).reshape(-1)
    d_slots = d_slots.to(device)
    h_slots = h_slots.to(device) if not pinned else h_slots

    def gather() -> None:
        load_rows(device_kv, d_slots, host, h_slots, validate=False)

    gather()
    gather_s = [timed(device, gather)[0] for _ in range(p.swap_calls)]
    src = host[: r * k]  # one contiguous block of the same bytes
    dst = device_kv[: r * k]

    def contiguous() -> None:
        dst.copy_(src, non_blocking=pinned)

    contiguous()
    limit_s = [timed(device, contiguous)[0] for _ in range(p.swap_calls)]

    def gbps(samples: list[float]) -> float:
        return nbytes / median(samples) / 1e9

    return {
        "requests": r, "top_k": k, "hot": hot, "row_bytes": row_bytes, "row_dtype": str(dtype),
        "bytes_per_call": nbytes, "all_missed": all_missed, "calls": p.swap_calls,
        "host_memory": "pinned" if pinned else "cpu",
        "swap_in_gbps": gbps(swap_s), "gather_gbps": gbps(gather_s), "limit_gbps": gbps(limit_s),
        "limit": "pinned host->device copy of one contiguous block of the same bytes" if pinned
        else "a contiguous copy of the same bytes in CPU memory (no link: host and device share it)",
        "swap_in_call_ms": 1e3 * median(swap_s),
        "host_copies": host_copies(pinned, host_launch_failure()),
    }  # fmt: skip


def host_copies(pinned: bool, failure: str | None) -> str:
    """What made the copies with the pinned host rows: the row-copy kernel, or torch after a failed
    launch (``kernels.kv_copy.host_launch_failure``)."""
    if not pinned:
        return "torch or the compiled loop: host and device share the CPU's memory"
    if failure is not None:
        return f"torch: a launch addressing host memory failed ({failure})"
    return "the row-copy kernel, through the pinned rows' device address"


# --- 2b. decode of one request: HiSparse beside resident ------------------------------------------


def decode_configs(p: Profile, device: torch.device) -> dict[str, EngineConfig]:
    pool = -(-(p.context + 4 * p.page) // p.page) * p.page
    resident = EngineConfig(device=device.type, dtype=DTYPE, kv_cache_dtype=KV_CACHE_DTYPE,
                            page_size=p.page, max_context_len=p.context + p.page, max_running_requests=1,
                            device_pool_tokens=pool, speculative=None, hisparse=None)
    hisparse = HiSparseConfig(device_buffer_size=p.hot, host_to_device_ratio=2)
    return {"resident": resident, "hisparse": attrs.evolve(resident, hisparse=hisparse)}


def decode_ratio(p: Profile, model, device: torch.device, budget: Budget, seed: int) -> dict[str, Any]:
    from pipeline.benchmarks.hisparse import decode_run
    from pipeline.executor import Executor

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 1000, (p.context - p.new_tokens,), generator=gen).tolist()
    executors = {name: Executor(cfg, model=model) for name, cfg in decode_configs(p, device).items()}
    try:
        for name, executor in executors.items():  # untimed: the first calls of every kernel
            decode_run(executor, [prompt[: 2 * p.hot]], 2, f"warm-{name}")
        tps: dict[str, list[float]] = {name: [] for name in executors}
        prefill_s: list[float] = []
        misses: list[int] = []
        names = list(executors)
        longest = 0.0
        for repeat in range(p.repeats):
            if repeat and budget.left() < 2.5 * longest + 30:
                print(f"[gpu-check] decode: {repeat} of {p.repeats} repeats (the time budget)", flush=True)
                break
            began = time.perf_counter()
            for name in names if repeat % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                run = decode_run(executors[name], [prompt], p.new_tokens, f"{name}{repeat}")
                prefill_s.append(time.perf_counter() - start - run.seconds)
                tps[name].append(run.tokens / run.seconds)
                if name == "hisparse":
                    misses.append(sum(run.misses))
            longest = max(longest, time.perf_counter() - began)
    finally:
        for executor in executors.values():
            executor.close()
    paired = sorted(h / r for h, r in zip(tps["hisparse"], tps["resident"]))
    return {
        "context": p.context, "new_tokens": p.new_tokens, "repeats": len(paired),
        "tokens_per_s": {name: median(v) for name, v in tps.items()}, "runs": tps,
        "hisparse_over_resident": median(paired), "range": [paired[0], paired[-1]],
        "misses_per_token": median([m / p.new_tokens for m in misses]),
        "prefill_s_per_request": median(prefill_s),
    }  # fmt: skip


# --- 2b'. decode graphs ------------------------------------------------------------------------------

GRAPH_BATCHES = (1, 2, 3)  # buckets 1, 2 and 4 (3 padded to 4)
GRAPH_CONTEXT = 2048  # tokens of a request (the captured indexer scores the table's width)


def graph_run(executor, graphs, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[float, list]:
    """Prefill and stage (untimed), then ``new_tokens`` timed decode steps of the batch, through
    ``graphs`` when given: (seconds, each request's tokens)."""
    from pipeline.benchmarks.hisparse import GREEDY
    from pipeline.driver import prefill_whole
    from pipeline.messages import NewSequence

    if graphs is not None:  # (the executor builds its forwards without graphs)
        executor._forwards = lambda: attrs.evolve(type(executor)._forwards(executor), graphs=graphs)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    prefill_whole(executor, [NewSequence(rid, tuple(p), GREEDY) for rid, p in zip(ids, prompts)])
    executor.wait_staging()
    assert sorted(executor.collect_ready()) == sorted(ids)
    seconds, _ = timed(executor.device, lambda: [executor.decode(ids) for _ in range(new_tokens)])
    tokens = [list(executor.seqs[rid].produced) for rid in ids]
    for rid in ids:
        executor.release(rid)
    return seconds, tokens


def decode_graphs(p: Profile, model, device: torch.device, seed: int) -> dict[str, Any]:
    """Plain decode captured (``pipeline/graphs.py``) for batches of 1, 2 and 3, all-resident (buckets
    1, 2 and 4, 3 padded), HiSparse (one graph per batch size) and dynamic residency with room for
    all (the FULL rows' buckets), each replayed beside the eager step on the same executor settings:
    equal tokens, equal swap-in misses, and decode tokens/s of each."""
    if device.type != "cuda":
        return {"skipped": "no CUDA"}
    from pipeline.executor import Executor
    from pipeline.graphs import DecodeGraphs
    from pipeline.hisparse.coordinator import HiSparseCoordinator
    from pipeline.memory.resident import ResidentMemory

    context = min(GRAPH_CONTEXT, p.context)
    pool = -(-(max(GRAPH_BATCHES) * (context + 2 * p.page)) // p.page) * p.page
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 1000, (context - p.new_tokens,), generator=gen).tolist()
               for _ in range(max(GRAPH_BATCHES))]
    out: dict[str, Any] = {"context": context, "new_tokens": p.new_tokens, "memories": {}}
    configs = decode_configs(p, device)
    hisparse = configs["hisparse"].hisparse
    assert hisparse is not None
    # dynamic residency with room for every request: their rows FULL, the FULL rows' buckets
    dynamic = attrs.evolve(hisparse, residency="dynamic")
    configs["dynamic"] = attrs.evolve(configs["hisparse"], hisparse=dynamic)
    for name, base in configs.items():
        cfg = attrs.evolve(base, max_context_len=context + p.page, max_running_requests=max(GRAPH_BATCHES),
                           device_pool_tokens=pool)
        eager, captured = Executor(cfg, model=model), Executor(cfg, model=model)
        memory = captured.memory
        assert isinstance(memory, ResidentMemory | HiSparseCoordinator)
        graphs = DecodeGraphs(captured.model, memory, buckets=(1, 2, 4))
        batches: dict[int, dict[str, Any]] = {}
        try:
            for n in GRAPH_BATCHES:
                graph_run(eager, None, prompts[:n], 2, f"warm-eager{n}")  # the first calls of every kernel
                graph_run(captured, graphs, prompts[:n], 2, f"warm-graph{n}")  # the capture
                misses = [e.memory.transfer_totals().swap_in[1] for e in (eager, captured)]
                eager_s, eager_tokens = graph_run(eager, None, prompts[:n], p.new_tokens, f"eager{n}")
                graph_s, graph_tokens = graph_run(captured, graphs, prompts[:n], p.new_tokens, f"graph{n}")
                after = [e.memory.transfer_totals().swap_in[1] for e in (eager, captured)]
                batches[n] = {"equal": graph_tokens == eager_tokens,
                              "misses_equal": after[0] - misses[0] == after[1] - misses[1],
                              "eager_tokens_per_s": n * p.new_tokens / eager_s,
                              "graph_tokens_per_s": n * p.new_tokens / graph_s}
        finally:
            eager.close()
            captured.close()
        out["memories"][name] = {"batches": batches, "captured": graphs.captured(),
                                 "refused": dict(graphs.refused)}
    out["equal"] = all(b["equal"] and b["misses_equal"]
                       for m in out["memories"].values() for b in m["batches"].values())
    return out


def graph_rows(graph: dict[str, Any] | None) -> list[list[object]]:
    if graph is None:
        return []
    if "skipped" in graph:
        return [["decode graphs, batches 1, 2, 3", f"skipped: {graph['skipped']}", "", "", ""]]
    rows: list[list[object]] = []
    for name, memory in graph["memories"].items():
        for n, b in memory["batches"].items():
            note = (f"tokens equal: {b['equal']}; misses equal: {b['misses_equal']}; "
                    f"captured {memory['captured']}")
            if memory["refused"]:
                note += f"; eager: {memory['refused']}"
            graph_tps, eager_tps = b["graph_tokens_per_s"], b["eager_tokens_per_s"]
            rows.append([f"{name} graph decode tok/s, {n} requests, {graph['context']} tokens", graph_tps,
                         f"eager {eager_tps:.3g}", graph_tps / eager_tps, note])
    return rows


# --- 2c. one device budget: seats and output tokens/s ---------------------------------------------


def budget_configs(p: Profile, device: torch.device, budget_bytes: int) -> dict[str, EngineConfig]:
    base = EngineConfig(device=device.type, dtype=DTYPE, kv_cache_dtype=KV_CACHE_DTYPE, page_size=p.page,
                        max_context_len=p.context, device_memory_bytes=budget_bytes, speculative=None,
                        hisparse=None)
    hisparse = HiSparseConfig(device_buffer_size=p.hot)  # the ratio: the one that seats the most
    return {"resident": base, "hisparse": attrs.evolve(base, hisparse=hisparse)}


def two_resident_budget(p: Profile, model_cfg, device: torch.device) -> int:
    """The least budget (to 1%) whose resident plan seats two requests of the context, and a
    quarter more: room for two, not three."""
    from pipeline.plan import seats_at

    def seats(b: int) -> int:
        return seats_at(budget_configs(p, device, b)["resident"], model_cfg, p.context) or 0

    low, high = 1 << 20, 1 << 24
    while seats(high) < 2:
        low, high = high, 2 * high
    while high - low > high // 100:
        mid = (low + high) // 2
        low, high = (low, mid) if seats(mid) >= 2 else (mid, high)
    return high * 5 // 4


def at_one_budget(p: Profile, model, device: torch.device, budget: Budget, prefill_s: float | None,
                  seed: int) -> dict[str, Any]:
    from pipeline.plan import seats_at

    budget_bytes = two_resident_budget(p, model.cfg, device)
    configs = budget_configs(p, device, budget_bytes)
    seats = {name: seats_at(cfg, model.cfg, p.context) or 0 for name, cfg in configs.items()}
    count = max(1, min(seats["hisparse"], p.seat_cap))
    per_request = prefill_s if prefill_s is not None else (10.0 if device.type == "cuda" else 2.0)
    fits = int((budget.left() - 20) / (2 * 1.5 * per_request))  # both modes, prefill-bound
    note = ""
    if fits < count:
        note = f"{count} requests would not fit the time budget: {max(fits, 1)}"
        count = max(fits, 1)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 1000, (p.context - p.seat_new_tokens,), generator=gen).tolist()
               for _ in range(count)]
    runs = capacity.strip({name: anyio.run(capacity.run_once, cfg, prompts, p.seat_new_tokens, model)
                           for name, cfg in configs.items()})
    return {
        "budget_bytes": budget_bytes, "context": p.context, "seats": seats, "requests": count,
        "new_tokens": p.seat_new_tokens, "runs": runs, "note": note,
        "tokens_per_s_ratio": runs["hisparse"]["tokens_per_s"] / runs["resident"]["tokens_per_s"],
    }  # fmt: skip


# --- 2d. dynamic residency: the load swept at one budget ------------------------------------------


def sweep_configs(p: Profile, device: torch.device, budget_bytes: int) -> dict[str, EngineConfig]:
    """resident, hisparse and dynamic (HiSparse with ``residency="dynamic"``) at one budget, for
    requests of ``p.sweep_context`` tokens prefilled ``p.sweep_chunk`` at a time."""
    at = attrs.evolve(p, context=p.sweep_context)
    configs = {name: attrs.evolve(cfg, chunked_prefill_tokens=p.sweep_chunk)
               for name, cfg in budget_configs(at, device, budget_bytes).items()}
    hisparse = configs["hisparse"]
    assert hisparse.hisparse is not None  # (budget_configs' HiSparse engine)
    dynamic = attrs.evolve(hisparse.hisparse, residency="dynamic")
    return {**configs, "dynamic": attrs.evolve(hisparse, hisparse=dynamic)}


def sweep_counts(seats: dict[str, int], points: int) -> list[int]:
    """The loads: 1, r (what all-resident seats), top (3r, or HiSparse's seats where fewer: a load
    only HiSparse holds) and one between r and top; 3 points drop the one between, 2 drop r too."""
    r = max(1, seats["resident"])
    top = min(3 * r, seats["hisparse"]) if seats["hisparse"] > r else 3 * r
    ladder = {4: [1, r, (r + top) // 2, top], 3: [1, r, top]}.get(points, [1, top])
    return sorted(set(ladder))


@attrs.frozen
class SweepCosts:
    """What a run of the sweep is expected to take, from a first run of one request of each
    variant and the decode part's step time (0 without it: the decode steps then count as the
    request's)."""

    start_s: dict[str, float]  # variant -> its engine's start and stop
    request_s: dict[str, float]  # variant -> one request's prefill (and the rest of its serving)
    step_s: float  # one decode step of one request
    new_tokens: int

    @classmethod
    def measured(cls, runs: dict[str, tuple[float, float]], step_s: float, new_tokens: int) -> SweepCosts:
        """From each variant's (seconds start to stop, seconds serving) of one request."""
        decode_s = new_tokens * step_s
        return cls(start_s={v: wall - serving for v, (wall, serving) in runs.items()},
                   request_s={v: max(0.0, serving - decode_s) for v, (_, serving) in runs.items()},
                   step_s=step_s, new_tokens=new_tokens)

    def run_s(self, variant: str, count: int, seats: int) -> float:
        """``count`` requests arriving together, ``seats`` at a time: the engine's start, each
        request's prefill, and a wave of decode steps per ``seats`` of them (a batch's step taken
        as one and a half of a single request's)."""
        waves = -(-count // max(1, seats))
        decode_s = self.new_tokens * self.step_s
        return self.start_s[variant] + count * self.request_s[variant] + waves * 1.5 * decode_s

    def sweep_s(self, counts: list[int], seats: dict[str, int], repeats: int) -> float:
        return repeats * sum(self.run_s(v, n, seats[v]) for n in counts for v in self.start_s)


def fit_sweep(p: Profile, costs: SweepCosts, seats: dict[str, int], target_s: float) -> tuple[list[int], int]:
    """The loads and repeats to run: the most points, then the most repeats (at least 2: a range),
    whose expected time fits ``target_s``; the least sweep when none does."""
    for points in range(p.sweep_points, 1, -1):
        counts = sweep_counts(seats, points)
        for repeats in range(p.sweep_repeats, 1, -1):
            if costs.sweep_s(counts, seats, repeats) <= target_s:
                return counts, repeats
    return sweep_counts(seats, 2), 2


def dynamic_sweep(p: Profile, model, device: torch.device, budget: Budget, decode: dict | None,
                  seed: int) -> dict[str, Any]:
    """The sweep, its loads and repeats sized to ``p.sweep_s`` (and to what is left of ``budget``)
    by a first, unmeasured run of one request of each variant; a load that would not fit in what
    is left is skipped, and the ones after it."""
    from pipeline.plan import seats_at

    context, new_tokens = p.sweep_context, p.sweep_new_tokens
    budget_bytes = two_resident_budget(attrs.evolve(p, context=context), model.cfg, device)
    configs = sweep_configs(p, device, budget_bytes)
    seats = {name: seats_at(cfg, model.cfg, context) or 0 for name, cfg in configs.items()}
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 1000, (context - new_tokens,), generator=gen).tolist()
               for _ in range(max(sweep_counts(seats, p.sweep_points)))]
    first: dict[str, tuple[float, float]] = {}
    for name, cfg in configs.items():  # unmeasured: the first calls at these shapes, and the costs
        began = time.perf_counter()
        run = anyio.run(capacity.run_once, cfg, prompts[:1], new_tokens, model)
        first[name] = (time.perf_counter() - began, run["seconds"])
    step_s = 1 / max(decode["tokens_per_s"].values()) if decode is not None else 0.0
    costs = SweepCosts.measured(first, step_s, new_tokens)
    spent = sum(wall for wall, _ in first.values())
    counts, repeats = fit_sweep(p, costs, seats, min(p.sweep_s - spent, budget.left() - 20))
    expected = {n: costs.sweep_s([n], seats, repeats) for n in counts}
    sweep: dict[int, dict[str, Any]] = {}
    note, slower = "", 1.0  # slower: measured over expected, so far
    for n in counts:
        if budget.left() - 15 < expected[n] * slower:
            note = f"loads from {n} requests skipped (the time budget)"
            print(f"[gpu-check] dynamic sweep: {note}", flush=True)
            break
        began = time.perf_counter()
        runs = capacity.run_alternating(configs, prompts[:n], new_tokens, repeats, model)
        sweep[n] = capacity.sweep_point(runs)
        slower = max(slower, (time.perf_counter() - began) / max(expected[n], 1e-9))
    headers, rows = capacity.sweep_rows(sweep, list(configs))
    return {
        "budget_bytes": budget_bytes, "context": context, "new_tokens": new_tokens, "seats": seats,
        "counts": counts, "repeats": repeats, "expected_s": sum(expected.values()), "note": note,
        "costs": attrs.asdict(costs),
        "table": {"headers": headers, "rows": rows}, "points": capacity.sweep_json(sweep),
    }  # fmt: skip


def kernel_choices(p: Profile, device: torch.device) -> list[dict[str, str]] | None:
    """What ``impl="auto"`` runs for the benchmark's attention calls on ``device``, and why (None
    where this build cannot say)."""
    try:
        from kernels.selection import AttentionShapes, select_kernels
    except ImportError:
        return None
    shapes = AttentionShapes(heads=p.heads, latent=512, rope=64, index_heads=64, index_dim=128, top_k=p.top_k,
                             hot=p.hot, extra=p.page)
    try:
        choices = select_kernels(device, torch.bfloat16, shapes, kv_dtype=kv_fp8.STORAGE)
    except Exception as exc:  # (the report goes on without it)
        return [{"op": "?", "impl": "?", "reason": f"{type(exc).__name__}: {exc}"}]
    return [{"op": c.op, "impl": c.impl, "reason": c.reason} for c in choices]


# --- the report -----------------------------------------------------------------------------------


def report_rows(tests: dict[str, Any] | None, swap: dict | None, decode: dict | None,
                seats: dict | None, sweep: dict | None = None) -> list[list[object]]:
    rows: list[list[object]] = []
    if tests is not None:
        rows.append(["tests (-m cuda)", "pass" if tests["passed"] else "FAIL", tests["summary"], "", ""])
    if swap is not None:
        limit, per = swap["limit_gbps"], f"{swap['requests']} x {swap['top_k']} rows of {swap['row_bytes']} B"
        rows.append(["swap-in call, GB/s", swap["swap_in_gbps"], f"limit {limit:.3g}",
                     swap["swap_in_gbps"] / limit, f"{per}, all missed: {swap['all_missed']}"])
        rows.append(["its gathered row copy, GB/s", swap["gather_gbps"], f"limit {limit:.3g}",
                     swap["gather_gbps"] / limit, "load_rows of the same rows"])
    if decode is not None:
        r = decode["tokens_per_s"]
        low, high = decode["range"]
        rows.append([f"decode tok/s, 1 request, {decode['context']} tokens", r["hisparse"],
                     f"resident {r['resident']:.3g}", decode["hisparse_over_resident"],
                     f"range {low:.2f}-{high:.2f}, {decode['repeats']} paired repeats"])
    if seats is not None:
        s, runs = seats["seats"], seats["runs"]
        mib = seats["budget_bytes"] / 2**20
        rows.append([f"seats at {mib:.0f} MiB, {seats['context']} tokens", s["hisparse"],
                     f"resident {s['resident']}", s["hisparse"] / max(1, s["resident"]), "the plans' seats"])
        rows.append([f"output tok/s, {seats['requests']} requests at once", runs["hisparse"]["tokens_per_s"],
                     f"resident {runs['resident']['tokens_per_s']:.3g}", seats["tokens_per_s_ratio"],
                     seats["note"] or f"{seats['new_tokens']} new tokens each, prefill included"])
    if sweep is not None and sweep["points"]:
        rows.append(sweep_row(sweep))
    return rows


def sweep_row(sweep: dict[str, Any]) -> list[object]:
    """The sweep's load where dynamic residency does worst against the better of resident and
    HiSparse (its table follows the report's)."""
    name = f"dynamic / {capacity.BEST}"
    points = sweep["points"]
    n = min(points, key=lambda k: points[k]["ratios"][name]["median"])
    results, ratio = points[n]["results"], points[n]["ratios"][name]
    better = max(results["resident"]["tokens_per_s"], results["hisparse"]["tokens_per_s"])
    counts = sweep["counts"]
    return [f"dynamic sweep, {counts[0]}-{counts[-1]} requests, {sweep['context']} tokens",
            results["dynamic"]["tokens_per_s"], f"better {better:.3g}", ratio["median"],
            f"lowest at {n} requests: range {ratio['low']:.2f}-{ratio['high']:.2f}"]


def benchmark(p: Profile, device: torch.device, budget: Budget, seed: int) -> dict[str, dict | None]:
    """The benchmark's parts in order, each within what is left of ``budget``."""
    cuda = device.type == "cuda"
    out: dict[str, dict | None] = {"swap_in": None, "decode": None, "graphs": None, "budget": None,
                                   "sweep": None}
    built = budget.run("model", 60 if cuda else 10, lambda: {"model": random_model(p, device, seed)})
    if built is None:
        return out
    model = built.pop("model")
    out["swap_in"] = budget.run("swap-in", 30 if cuda else 5, lambda: swap_in_bandwidth(p, model.cfg, device))
    out["decode"] = decode = budget.run("decode", 60 if cuda else 10,
                                        lambda: decode_ratio(p, model, device, budget, seed))
    out["graphs"] = budget.run("decode graphs", 100 if cuda else 0,
                               lambda: decode_graphs(p, model, device, seed))
    prefill = decode["prefill_s_per_request"] if decode is not None else None
    out["budget"] = budget.run("budget", 40 if cuda else 8,
                               lambda: at_one_budget(p, model, device, budget, prefill, seed))
    out["sweep"] = budget.run("dynamic sweep", 30 if cuda else 6,
                              lambda: dynamic_sweep(p, model, device, budget, decode, seed))
    return out


def sweep_caption(sweep: dict[str, Any]) -> str:
    mib = sweep["budget_bytes"] / 2**20
    seats = ", ".join(f"{name} {n}" for name, n in sweep["seats"].items())
    note = f"; {sweep['note']}" if sweep["note"] else ""
    return (f"\ndynamic residency sweep at {mib:.0f} MiB (seats: {seats}), {sweep['context']}-token requests "
            f"({sweep['new_tokens']} new tokens) arriving together, output tok/s with prefill, "
            f"{sweep['repeats']} alternating runs a load; ratios: median (range){note}")


def headline(p: Profile, device: torch.device, seconds: float) -> str:
    sizes = " (CPU sizes)" if device.type != "cuda" else ""
    return (f"device check on {device.type}{sizes}: {p.layers} layers, {p.heads} heads, MLA 512 + 64, "
            f"indexer 64 x 128, top-k {p.top_k}, HOT {p.hot}, {DTYPE} weights, FP8 (e4m3) KV, contexts of "
            f"{p.context} tokens; {seconds:.0f} s")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hispec bench gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-gpu-check.json", help="JSON results")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"seconds for the whole run (default: {CUDA.budget_s:.0f} on CUDA, "
                             f"{CPU.budget_s:.0f} on a CPU)")
    parser.add_argument("--skip-tests", action="store_true", help="the benchmark only")
    parser.add_argument("--skip-bench", action="store_true", help="the tests only")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: 1 on a CPU, torch's own on CUDA; 0: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="(a failed part's traceback is always printed)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    profile = CUDA if cuda else CPU
    threads = args.threads if args.threads is not None else (0 if cuda else 1)
    if threads > 0:  # (on a shared small CPU two busy threads run far slower than one)
        torch.set_num_threads(threads)
    if cuda:
        print(f"[gpu-check] CUDA device: {torch.cuda.get_device_name(device)}", flush=True)
    else:
        print("[gpu-check] no CUDA device: running at CPU sizes", flush=True)
    budget = Budget(args.budget_s if args.budget_s is not None else profile.budget_s)
    tests = None
    if not args.skip_tests:
        print(f"[gpu-check] tests: pytest -m cuda {TESTS.relative_to(ROOT)}", flush=True)
        tests = run_tests(device, min(profile.tests_s, max(budget.left() - 30, 1)))
        budget.outcomes["tests"] = "ran" if tests["passed"] else "failed"
    parts: dict[str, dict | None] = {"swap_in": None, "decode": None, "graphs": None, "budget": None,
                                     "sweep": None}
    if not args.skip_bench:
        sink = configure_logging(level="warning", stream=io.StringIO())
        try:
            parts = benchmark(profile, device, budget, args.seed)
        finally:
            sink.close()
    failed = sorted(part for part, outcome in budget.outcomes.items() if outcome == "failed")
    passed = not failed and (tests is None or tests["passed"])
    seconds = time.perf_counter() - budget.start
    print()
    print(headline(profile, device, seconds))
    print(table(["check", "HiSparse / measured", "baseline", "ratio", "note"],
                report_rows(tests, parts["swap_in"], parts["decode"], parts["budget"], parts["sweep"])
                + graph_rows(parts["graphs"])))
    if parts["sweep"] is not None:
        print(sweep_caption(parts["sweep"]))
        print(table(parts["sweep"]["table"]["headers"], parts["sweep"]["table"]["rows"]))
    for part, why in budget.errors.items():
        print(f"{budget.outcomes[part]}: {part}: {why}")
    if parts["swap_in"] is not None:
        print(f"swap-in limit: {parts['swap_in']['limit']}")
        print(f"host copies: {parts['swap_in']['host_copies']}")
    choices = kernel_choices(profile, device)
    if choices is not None:
        said = "; ".join(f"{c['op']} {c['impl']} ({c['reason']})" for c in choices)
        print(f"kernels at these shapes: {said}")
    print(f"result: {'PASS' if passed else 'FAIL'} ({args.out})")
    write_json(args.out, {
        "bench": "gpu-check", "machine": machine(), "device": device.type, "profile": attrs.asdict(profile),
        "dtype": DTYPE, "kv_cache_dtype": KV_CACHE_DTYPE, "kernels": choices,
        "tests": tests, **parts,
        "outcomes": budget.outcomes, "errors": budget.errors, "seconds": seconds, "passed": passed,
    })  # fmt: skip
    return 0 if passed else 1
