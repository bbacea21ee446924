"""``hispec plan``: what a device budget holds, all-resident beside HiSparse and dynamic residency.

Prints the memory plan for requests of ``--context`` tokens: every device structure with its bytes
per unit (device slot, logical location, request row) and in total, how many such requests each
layout seats at once and which pool or structure stops them, how an engine of dynamic residency
moves from all FULL (whole contexts on the device) to all HOT (hot buffers) as requests arrive, and
what ``host_to_device_ratio``, HOT and the page size trade at the same budget. Nothing is loaded but
the model's ``config.json``. ``--residency`` is the HiSparse engine's (``hisparse.residency``): the
HiSparse section describes that engine; the seats of both residencies and the dynamic residency
section are printed either way.

    hispec plan --device-memory 64MB --context 2048
    hispec plan --device-memory 64MB --context 2048 --ratio 16 --no-spec --json plan.json
    hispec plan --device-memory 32MB --context 2048 --no-spec --residency dynamic

Without ``--hot`` the plan takes the engine's default HOT, raised to the model's ``index_topk``
(rounded up to whole pages) when the indexer selects more: the hot region holds a step's whole
top-k. A value the model or the engine cannot run with is a ``ConfigError`` naming the option.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Literal

import attrs

from kernels.kv_fp8 import KV_CACHE_DTYPES
from pipeline.capacity import ARENA, ArenaSpace, DevicePlan, format_bytes, parse_bytes
from pipeline.config import (
    DEFAULT_CHUNK,
    DEFAULT_HOT,
    RESIDENCIES,
    EngineConfig,
    HiSparseConfig,
    SpeculativeConfig,
)
from pipeline.errors import ConfigError
from pipeline.startup import plan_engine


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The engine options that shape the plan (shared with ``hispec bench capacity``)."""
    p.add_argument("--model", default="tiny", help="'tiny' (bundled) or an HF-format directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="how KV rows are stored: auto (= --dtype) or fp8_e4m3 (V3.2's FP8 layouts)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--device-memory", type=parse_bytes, default=None, metavar="BYTES",
                   help="device memory budget of the KV memory layer (e.g. 64MB, 2GiB)")
    p.add_argument("--device-memory-fraction", type=float, default=None, metavar="F",
                   help="CUDA: the budget as a fraction of the free device memory")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--hot", type=int, default=128, help="HiSparse device buffer (hot columns) per request")
    p.add_argument("--ratio", type=int, default=None,
                   help="HiSparse host_to_device_ratio (default: with a budget, the one that seats the most)")
    p.add_argument("--no-spec", action="store_true", help="plain decoding (no draft layer KV)")
    p.add_argument("--draft-rows-on-host", action="store_true",
                   help="HiSparse: the draft layer's KV rows in host memory (hisparse.draft_rows_on_host)")
    p.add_argument("--draft-keys-on-host", action="store_true",
                   help="with --draft-rows-on-host, its indexer keys too (hisparse.draft_keys_on_host)")
    p.add_argument("--num-steps", type=int, default=None, help="draft steps per round (default 3 with MTP)")
    p.add_argument("--chunked-prefill-tokens", type=int, default=DEFAULT_CHUNK, metavar="N",
                   help=f"prefill chunk (default {DEFAULT_CHUNK}; 0 = whole prompts)")
    p.add_argument("--max-context-len", type=int, default=None, help="default: --context")
    p.add_argument("--device-pool-tokens", type=int, default=None, help="override: device slots")
    p.add_argument("--max-running-requests", type=int, default=None, help="override: request rows")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, required=True, help="tokens of one request (prompt and output)")
    add_plan_arguments(p)
    p.set_defaults(hot=None)
    p.add_argument("--residency", default="always", choices=list(RESIDENCIES),
                   help="the HiSparse engine's hisparse.residency (the dynamic residency figures are "
                        "printed either way)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks on one node: each holds this device plan; the host pool "
                        "is counted once per node (shared) or once a rank (--no-shared-host-pool)")
    p.add_argument("--no-shared-host-pool", action="store_true",
                   help="with --tp: each rank keeps its own HiSparse host pool")
    p.add_argument("--json", metavar="FILE", help="also write the plans as JSON")
    return p


def default_hot(model_cfg: Any, page_size: int) -> int:
    """HOT when none is given: the engine's default, or the model's top-k when it selects more,
    in whole pages."""
    return -(-max(DEFAULT_HOT, model_cfg.index_topk or 0) // page_size) * page_size


def check_arguments(args: argparse.Namespace, model_cfg: Any) -> None:
    """The options against each other and the model, each mistake a ``ConfigError`` naming its
    option (before any plan is made, so none reads a context the model has no positions for)."""
    positions = model_cfg.max_position_embeddings
    top_k = model_cfg.index_topk or 0
    for name, value in (("--context", args.context), ("--max-context-len", args.max_context_len)):
        if value is None:
            continue
        if value < 1:
            raise ConfigError(name, value, "must be >= 1")
        if value > positions:
            raise ConfigError(name, value, f"must be <= the model's max_position_embeddings ({positions})")
    if args.max_context_len is not None and args.max_context_len < args.context:
        raise ConfigError("--max-context-len", args.max_context_len, f"must be >= --context ({args.context})")
    if args.page_size < 1:
        raise ConfigError("--page-size", args.page_size, "must be >= 1")
    if getattr(args, "tp", 1) < 1:
        raise ConfigError("--tp", args.tp, "must be >= 1")
    if args.hot is None:
        return
    if args.hot < top_k:
        raise ConfigError("--hot", args.hot, f"must be >= the model's index_topk ({top_k}): the hot region "
                          "holds a step's whole top-k "
                          f"(leave --hot out for {default_hot(model_cfg, args.page_size)})")
    if args.hot % args.page_size:
        raise ConfigError("--hot", args.hot, f"must be a multiple of --page-size ({args.page_size})")


def plan_config(
    args: argparse.Namespace, *, hisparse: bool, context: int, residency: str | None = None
) -> EngineConfig:
    """The ``EngineConfig`` the options describe, HiSparse on or off; ``residency`` over
    ``--residency`` (which a parser may lack: then "always")."""
    if args.no_spec:
        spec: SpeculativeConfig | Literal["auto"] | None = None
    else:
        spec = "auto" if args.num_steps is None else SpeculativeConfig(num_steps=args.num_steps)
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        page_size=args.page_size,
        max_context_len=args.max_context_len or context,
        device_memory_bytes=args.device_memory,
        device_memory_fraction=args.device_memory_fraction,
        device_pool_tokens=args.device_pool_tokens,
        max_running_requests=args.max_running_requests,
        chunked_prefill_tokens=args.chunked_prefill_tokens or None,
        hisparse=HiSparseConfig(device_buffer_size=args.hot, host_to_device_ratio=args.ratio,
                                draft_rows_on_host=args.draft_rows_on_host,
                                draft_keys_on_host=args.draft_keys_on_host,
                                residency=residency or str(getattr(args, "residency", "always")))
        if hisparse else None,
        speculative=spec,
    )


def device_plan(config: EngineConfig, model_cfg: Any) -> DevicePlan:
    """The device side of the plan an engine of ``config`` starts with (``plan_engine``)."""
    return plan_engine(config, model_cfg, log_choices=False).device


def seats_at(config: EngineConfig, model_cfg: Any, context: int) -> int | None:
    """Seats of ``context`` at ``config``'s budget (None: the budget holds no request)."""
    try:
        return device_plan(config, model_cfg).seats(context).running
    except ConfigError:
        return None


def at_budget(config: EngineConfig, hisparse: HiSparseConfig, page_size: int) -> EngineConfig:
    """``config`` with ``hisparse`` and ``page_size``, its pools sized by its budget alone (the
    token overrides dropped)."""
    return attrs.evolve(
        config, hisparse=hisparse, page_size=page_size, device_pool_tokens=None, max_running_requests=None
    )


def trade_offs(
    config: EngineConfig, model_cfg: Any, context: int, ratio: int
) -> dict[str, dict[int, int | None]]:
    """HiSparse seats at the same budget as one knob moves (the others as given; ``ratio``: the
    plan's host_to_device_ratio)."""
    hs = config.hisparse
    if hs is None:
        raise ValueError("trade_offs: the knobs it moves are HiSparse's; config.hisparse is None")
    page = config.page_size
    hot_now = hs.hot_for(model_cfg.index_topk, page)
    out: dict[str, dict[int, int | None]] = {"host_to_device_ratio": {}, "hot": {}, "page_size": {}}
    for r in sorted({1, 2, 4, 8, 16, 32, ratio}):
        cfg = at_budget(config, attrs.evolve(hs, host_to_device_ratio=r), page)
        out["host_to_device_ratio"][r] = seats_at(cfg, model_cfg, context)
    for hot in sorted({page * k for k in (4, 8, 16, 32)} | {hot_now, 2 * hot_now}):
        if hot < (model_cfg.index_topk or 0):
            continue
        cfg = at_budget(config, attrs.evolve(hs, device_buffer_size=hot), page)
        out["hot"][hot] = seats_at(cfg, model_cfg, context)
    for size in sorted({16, 32, 64, page}):
        if hot_now % size:
            continue
        try:
            cfg = at_budget(config, hs, size)
        except ConfigError:  # e.g. the draft zone of a smaller page cannot hold the verify tokens
            continue
        out["page_size"][size] = seats_at(cfg, model_cfg, context)
    return out


def full_trade_offs(
    config: EngineConfig, model_cfg: Any, context: int, ratios: list[int]
) -> dict[int, tuple[int, int] | None]:
    """Dynamic residency at the same budget for each ratio: (seats, requests FULL at once); a
    smaller ratio seats fewer and leaves a larger device pool (None: the budget holds no request)."""
    hs = config.hisparse
    assert hs is not None  # (the HiSparse config)
    out: dict[int, tuple[int, int] | None] = {}
    for r in ratios:
        dynamic = attrs.evolve(hs, host_to_device_ratio=r, residency="dynamic")
        cfg = at_budget(config, dynamic, config.page_size)
        try:
            plan = device_plan(cfg, model_cfg)
        except ConfigError:
            out[r] = None
            continue
        out[r] = (plan.seats(context).running, plan.full_seats(context))
    return out


def describe(name: str, plan: DevicePlan, context: int) -> list[str]:
    p = plan.plan
    s = plan.seats(context)
    held = plan.request_bytes(context)
    one = sum(held.values())
    lines = [f"{name}: device pool {p.device_tokens} slots"
             + (f", {p.logical_tokens} logical locations" if p.hisparse else "")
             + f", {p.max_running_requests} request rows; {format_bytes(plan.total_bytes)} in all"
             + (f" of a {format_bytes(plan.budget)} budget" if plan.budget else "")]
    lines.append(
        f"  {'structure':<40} {'grows with':<17} {'bytes/unit':>10} {'total':>10} {'one request':>12}"
    )
    for st in plan.structures:
        lines.append(f"  {st.name:<40} {st.unit:<17} {st.unit_bytes:>10} {format_bytes(st.num_bytes):>10} "
                     f"{held[st.name] / one:>11.0%}")
    limit = ", ".join(f"{pool} {n}" for pool, n in s.by_pool.items())
    lines.append(f"  one request of {context} tokens holds {format_bytes(one)} of device memory")
    lines.append(f"  seats for {context}-token requests: {s.seats} (pools: {limit}; stopped by {s.limit}); "
                 f"running at once: {s.running}")
    biggest, share = plan.largest(context)
    lines.append(f"  the largest structure of a request: {biggest} ({share:.0%} of its device bytes)")
    return lines + describe_arena(plan)


def describe_arena(plan: DevicePlan) -> list[str]:
    """Dynamic residency: how the one device arena holds the KV rows and the indexer keys."""
    if not any(s.name == ARENA for s in plan.structures):
        return []
    p = plan.plan
    arena = ArenaSpace.of(p, plan.dims.row_bytes, plan.dims.key_bytes)
    return [f"  the device arena: {arena.num_frames} frames of {arena.pages_per_frame} pages, the bytes of "
            f"{p.device_tokens} KV rows and {p.logical_tokens} locations' indexer keys; the keys take frames "
            "from the bottom, KV rows from the top, and a frame no page uses goes back to either"]


def fewer_full(dynamic: DevicePlan, full: int, resident: int) -> str:
    """Why dynamic residency runs fewer requests FULL than all-resident seats, where it does: what
    it keeps for every seat outside the arena (an all-HOT load's memory)."""
    if full >= resident:
        return ""
    held = dynamic.request_bytes(dynamic.plan.max_context_len)
    draft = sum(v for k, v in held.items() if k.startswith("draft layer"))
    if draft:
        return ("; the draft layer's all-resident KV, outside the arena, is kept for every seat "
                "(--draft-rows-on-host --draft-keys-on-host move it to the host)")
    return "; the arena is cut into whole frames, and the keys' frames are kept for every request held"


def describe_dynamic(plan: DevicePlan, context: int, *, pools: bool) -> list[str]:
    """How an engine of dynamic residency holds requests of ``context`` tokens as more arrive (its
    pools too when ``pools``: they are not printed above)."""
    p = plan.plan
    title = "dynamic residency (hisparse.residency=\"dynamic\")"
    if pools:
        title += (f": device pool {p.device_tokens} slots, {p.logical_tokens} logical locations, "
                  f"{p.max_running_requests} request rows; {format_bytes(plan.total_bytes)} in all")
    lines = [title if pools else f"{title}, as load grows:"]
    if pools:
        lines += describe_arena(plan)
    lines.append("  a request is admitted FULL (its whole context's KV rows in the arena, no swap-in) while "
                 "the arena holds them beside every request's indexer keys, HOT (its hot buffer) otherwise; "
                 "under pressure FULL requests are demoted, largest first, and promoted back when memory "
                 "returns (docs/residency.md)")
    lines.append(f"  {'requests':>10} {'FULL':>6} {'HOT':>6} {'KV rows':>13} {'device bytes held':>18}")
    for step in plan.load_table(context):
        lines.append(f"  {step['requests']:>10} {step['full']:>6} {step['hot']:>6} "
                     f"{step['device_slots']:>13} {format_bytes(step['device_bytes']):>18}")
    return lines


def report(args: argparse.Namespace, model_cfg: Any) -> tuple[str, dict[str, object]]:
    context = args.context
    plans: dict[str, DevicePlan] = {}
    configs = {"resident": plan_config(args, hisparse=False, context=context),
               "hisparse": plan_config(args, hisparse=True, context=context)}
    dynamic_engine = getattr(args, "residency", "always") == "dynamic"
    other = "always" if dynamic_engine else "dynamic"  # the other residency's figures, beside the engine's
    configs[other] = plan_config(args, hisparse=True, context=context, residency=other)
    if not configs["hisparse"].has_budget:  # token settings: compare at what the HiSparse pools take
        plans["hisparse"] = device_plan(configs["hisparse"], model_cfg)
        budget = plans["hisparse"].total_bytes
        configs = {
            k: attrs.evolve(c, device_memory_bytes=budget, device_pool_tokens=None, max_running_requests=None)
            for k, c in configs.items()
        }
    for name, cfg in configs.items():
        plans[name] = device_plan(cfg, model_cfg)
    dims = plans["hisparse"].dims
    lines = [f"model {args.model}: {dims.num_layers} target layers, MLA rows of {dims.row_dim}, "
             f"indexer keys of {dims.index_dim}, {args.dtype}, KV cache {args.kv_cache_dtype} "
             f"({dims.row_bytes} + {dims.key_bytes} bytes a layer a position), "
             f"draft layers kept: {dims.mtp_layers}; "
             f"budget {format_bytes(plans['hisparse'].budget or 0)}; requests of {context} tokens", ""]
    lines += [*describe("all-resident", plans["resident"], context), ""]
    ratio = plan_engine(configs["hisparse"], model_cfg, log_choices=False).host_to_device_ratio
    chosen = "" if args.ratio else ", chosen for the budget"
    residency = ", residency dynamic" if dynamic_engine else ""
    title = (f"HiSparse (HOT {args.hot}, page {args.page_size}, host_to_device_ratio {ratio}{chosen}"
             f"{residency})")
    if getattr(args, "hot_chosen", False) and args.hot > DEFAULT_HOT:
        lines.append(f"--hot unset: HOT {args.hot} holds the model's index_topk of {model_cfg.index_topk} "
                     f"(the default {DEFAULT_HOT} cannot)")
    lines += [*describe(title, plans["hisparse"], context), ""]
    dynamic, always = plans.get("dynamic", plans["hisparse"]), plans.get("always", plans["hisparse"])
    lines += [*describe_dynamic(dynamic, context, pools=not dynamic_engine), ""]
    r, h = plans["resident"].seats(context).running, always.seats(context).running
    lines.append(f"HiSparse seats {h} requests to resident's {r}" + (f" ({h / r:.2f}x)" if r else ""))
    full = dynamic.full_seats(context)
    lines.append(f"dynamic residency seats {dynamic.seats(context).running}, of which up to {full} "
                 f"FULL at once (all-resident: {r})" + fewer_full(dynamic, full, r))
    trades = trade_offs(configs.get("always", configs["hisparse"]), model_cfg, context, ratio)
    lines.append("what the knobs trade (HiSparse seats at this budget, the other knobs as given):")
    for knob, row in trades.items():
        lines.append(f"  {knob:<22} " + "  ".join(f"{k}: {'-' if v is None else v}" for k, v in row.items()))
    ratios = list(trades["host_to_device_ratio"])
    dynamic_trades = full_trade_offs(configs["hisparse"], model_cfg, context, ratios)
    lines.append("  dynamic residency, host_to_device_ratio -> seats / FULL at once: " + "  ".join(
        f"{k}: {'-' if v is None else f'{v[0]}/{v[1]}'}" for k, v in dynamic_trades.items()))
    lines += notes(plans["hisparse"], context)
    shared = not getattr(args, "no_shared_host_pool", False)  # (a parser without the options: one rank)
    host = host_memory(plans["hisparse"], getattr(args, "tp", 1), shared)
    lines += ["", *describe_host(host)]
    payload = {
        "context": context,
        "hot": args.hot,
        "plans": {k: p.as_dict(context) for k, p in plans.items()},
        "trade_offs": trades,
        "dynamic_trade_offs": dynamic_trades,
        "host": attrs.asdict(host),
    }
    return "\n".join(lines), payload


@attrs.frozen
class HostMemory:
    """The HiSparse host pool on one node of ``tp`` ranks."""

    tp: int
    shared: bool  # the node's ranks hold one pool between them (``shared_host_pool``, more than one rank)
    pool_bytes: int  # one pool's rows
    node_bytes: int  # what the node holds: one pool when shared, one a rank when not


def host_memory(plan: DevicePlan, tp: int, shared: bool) -> HostMemory:
    """The host pool of ``plan`` on a node of ``tp`` ranks: counted once when they share it (the
    default), once a rank when each keeps its own."""
    pool = plan.dims.num_layers * plan.plan.host_tokens * plan.dims.row_bytes  # (``kv_cache``'s host_bytes)
    shared = shared and tp > 1
    return HostMemory(tp, shared, pool, pool if shared else pool * tp)


def describe_host(host: HostMemory) -> list[str]:
    tp = host.tp
    if tp == 1:
        how = "one rank"
    elif host.shared:
        how = f"--tp {tp}: one pool shared by the node's {tp} ranks, counted once"
    else:
        how = f"--tp {tp}, --no-shared-host-pool: each rank its own pool, counted {tp} times"
    lines = [f"host memory (HiSparse host pool): {format_bytes(host.pool_bytes)} a pool; "
             f"{format_bytes(host.node_bytes)} a node ({how})"]
    if tp > 1:
        lines.append(f"  every one of the {tp} ranks holds the device plan above (each keeps the whole MLA "
                     "latent KV)")
    return lines


def notes(plan: DevicePlan, context: int) -> list[str]:
    p = plan.plan
    s = plan.seats(context)
    cols = p.buffer_columns
    need = -(-(context + p.draft_tokens) // p.page_size) * p.page_size
    balanced = need / cols
    out = [
        f"  a request holds {cols} device slots (HOT + page) and {need} logical locations: a "
        f"host_to_device_ratio near {balanced:.1f} uses both pools evenly at this context",
    ]
    if s.limit == "logical locations":
        out.append("  the logical pool stops the seats: raise host_to_device_ratio (the indexer keys of "
                   "every location stay on the device, so each location costs device memory too)")
    held = plan.request_bytes(context)
    draft = sum(v for k, v in held.items() if k.startswith("draft layer"))
    if draft and not plan.dims.draft_rows_on_host:
        out.append(f"  the draft layer's all-resident KV takes {draft / sum(held.values()):.0%} of a "
                   "request's device bytes (--no-spec frees it; --draft-rows-on-host moves its rows to "
                   "the host)")
    elif draft:
        out.append("  the draft layer's rows are on the host; its indexer keys take "
                   f"{draft / sum(held.values()):.0%} of a request's device bytes "
                   "(--draft-keys-on-host moves the keys too)")
    elif plan.dims.draft_keys_on_host:
        out.append("  the draft layer's rows and indexer keys are on the host (it reads the target's token "
                   "table): speculation holds no device bytes per location beyond plain decoding's")
    return out


def main(argv: list[str] | None = None) -> int:
    from pipeline.preflight import read_model_config

    args = build_parser().parse_args(argv)
    model_cfg = read_model_config(args.model)
    check_arguments(args, model_cfg)
    args.hot_chosen = args.hot is None
    if args.hot is None:
        args.hot = default_hot(model_cfg, args.page_size)
    text, payload = report(args, model_cfg)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0
