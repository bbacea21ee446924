"""Start-up: the engine's first stage, from the user's ``EngineConfig`` to a memory layer ready to serve.

``start`` runs it top to bottom::

    the model        config.json (or the injected model's), its end ids; the device, the ranks
    the plan         the config against the model; every derived size, once  -> EnginePlan
    the machine      the plan's memory against what is free now
    the weights      loaded in the configured dtype (unless injected)
    the memory       allocated from the plan; every device tensor is checked against it
    warm-up          the compiled CPU loops the first step would otherwise compile

The ``EngineConfig`` stays what the user wrote. What start-up derives from it (the speculative
config ``"auto"`` chose, the context limit, the pools and rows, HOT, the ratio, the prefill budget)
is the frozen ``EnginePlan``, made by ``plan_engine`` and nowhere else: ``hispec plan`` and
``preflight`` make it without allocating, the executor makes it and then allocates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import structlog
import torch

import kernels
from kernels import kv_fp8
from kernels.swap_in_policy import DEFAULT_POLICY, near_margin
from pipeline.capacity import DevicePlan, MemoryPlan, ModelDims, kv_format
from pipeline.config import (
    DEFAULT_POOL_TOKENS,
    DEFAULT_PREFILL_BATCH,
    DEFAULT_ROWS,
    EngineConfig,
    SpeculativeConfig,
    check_against_model,
    check_draft_zone,
    hot_for,
    speculative_for,
)
from pipeline.errors import ConfigError
from pipeline.hisparse import prefill_swap
from pipeline.hisparse.coordinator import HiSparseCoordinator
from pipeline.hisparse.trace import TopKTrace, trace_meta
from pipeline.hisparse.transfer import TransferStream
from pipeline.memory.host_pool import HostRows
from pipeline.memory.interface import KVMemory
from pipeline.memory.resident import ResidentMemory
from pipeline.model import DeepseekV32, ModelConfig, load_model
from pipeline.model.checkpoint import parse_dtype
from pipeline.model.fused import fuse_for_inference
from pipeline.model.tokenizer import Tokenizer, tokenizer_for_model
from pipeline.pool_sizes import DEFAULT_RATIO, device_budget, prefill_chunk, size_pools
from pipeline.preflight import check_memory, model_config

log = structlog.get_logger("hispec.config")


@attrs.frozen
class EnginePlan:
    """Every value the runtime reads that the config leaves to the model or the machine, resolved
    once (``plan_engine``). The config's own values are read from the config."""

    # "auto" resolved: SpeculativeConfig() when the model has an MTP layer, else None; its own
    # "auto" limits stay for the device to set (``SpeculativeConfig.for_device``)
    speculative: SpeculativeConfig | None
    max_context_len: int  # tokens one request holds at most, prompt and output
    max_running_requests: int  # request rows: requests admitted at once
    device_pool_tokens: int  # usable physical KV slots on the device (the sink page is extra)
    hot: int  # HOT: hot columns of a request's device buffer, whole pages; 0 without HiSparse
    host_to_device_ratio: int  # logical (and host) locations per device slot; 1 without HiSparse
    device_memory_bytes: int | None  # the device budget, measured once; None: pools sized in tokens
    prefill_budget: int | None  # prompt tokens one prefill forward carries in all; None: no bound
    memory: MemoryPlan  # the memory layer's sizes in tokens (what it allocates)
    device: DevicePlan  # the same in device bytes: every structure, the budget, the seats

    @property
    def draft_tokens(self) -> int:
        """D: tokens a speculative round verifies (0 without speculation)."""
        return self.memory.draft_tokens


@attrs.frozen(eq=False)
class Started:
    """What start-up hands the executor."""

    device: torch.device
    dtype: torch.dtype
    model: DeepseekV32
    tokenizer: Tokenizer
    plan: EnginePlan
    memory: KVMemory  # allocated as ``plan.memory`` says, checked against ``plan.device``
    trace: TopKTrace | None  # every top-k selection, recorded for replay (None: not recorded)


def start(
    config: EngineConfig,
    *,
    model: DeepseekV32 | None = None,
    tokenizer: Tokenizer | None = None,
    transfer: Callable[[str, torch.device], TransferStream] | None = None,
    trace_path: str | None = None,
    check_machine: bool = True,
    host_rows: HostRows | None = None,
) -> Started:
    """The engine's first stage; raises ``ConfigError`` naming the field at the first mistake.

    ``model`` replaces loading ``config.model``; ``tokenizer`` replaces the checkpoint's;
    ``transfer`` builds HiSparse's transfer streams; ``trace_path`` records every top-k selection.
    ``host_rows``: where HiSparse's host pool rows live (a node's ranks share them), else allocated here.
    ``check_machine=False``: the plan's memory was checked against the machine already (a tensor-
    parallel rank: its group checked every rank's share before spawning one, and the ranks' own
    allocations would make a later check refuse what fits).
    The config, already valid (it checks itself when built), is not changed.
    """
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)  # process-wide: torch has no per-thread setting
    device, dtype = torch.device(config.device), parse_dtype(config.dtype)
    model_cfg = model_config(config, model)
    # a budget that is a fraction of the memory free once the weights are loaded is measured after
    # them; any other plan is made, and checked against the machine, before a weight is read
    measured_after_weights = config.device_memory_fraction is not None
    def make_plan(model_cfg: ModelConfig) -> EnginePlan:
        if check_machine:
            return checked_plan(config, model_cfg, log_choices=True)
        return plan_engine(config, model_cfg, log_choices=True)

    plan = None if measured_after_weights else make_plan(model_cfg)
    injected = model is not None
    if model is None:
        model = load_model(config.model, dtype=dtype, device=device)
    if model.dtype != dtype:
        raise ConfigError("dtype", config.dtype, f"the model given is {model.dtype}: they must match")
    if plan is None:
        plan = make_plan(model.cfg)
    fuse_for_inference(model)  # fewer torch calls per layer, same arithmetic (``fused.py``)
    cfg = model.cfg
    if tokenizer is None:
        tokenizer = tokenizer_for_model(
            None if injected else config.model, vocab_size=cfg.vocab_size, eos_token_id=cfg.eos_token_id
        )
    memory = allocate(config, plan, cfg, dtype=dtype, device=device, transfer=transfer, host_rows=host_rows)
    plan.device.check(memory.device_tensors())  # every allocation is what the plan says
    # the compiled CPU loops this run will call, before its first step needs them
    kernels.warm_up(device, dtype, index_heads=cfg.index_n_heads, index_dim=cfg.index_head_dim,
                    swap_in=config.hisparse is not None,
                    attention=(cfg.num_attention_heads, cfg.kv_row_dim, cfg.index_topk))
    hs = config.hisparse
    near = 0 if hs is None else near_margin(hs.near_margin, plan.memory.policy, cfg.index_topk or 0,
                                            tracing=trace_path is not None)
    kernels.log_selected(device, dtype, kernels.AttentionShapes(  # which implementation each op runs
        heads=cfg.num_attention_heads, latent=cfg.kv_lora_rank, rope=cfg.qk_rope_head_dim,
        index_heads=cfg.index_n_heads, index_dim=cfg.index_head_dim, top_k=cfg.index_topk, hot=plan.hot,
        extra=plan.memory.buffer_columns - plan.hot if plan.hot else 0, near=near),
        kv_dtype=kv_fp8.STORAGE if config.kv_cache_dtype != "auto" else None)
    if config.hisparse is not None and device.type == "cpu":
        prefill_swap.warm_up()  # a chunk's grouping of its earlier positions
    trace = TopKTrace(trace_path, meta=trace_meta(config, plan, cfg, dtype)) if trace_path else None
    return Started(device, dtype, model, tokenizer, plan, memory, trace)


def preflight(config: EngineConfig, *, model: DeepseekV32 | None = None) -> EnginePlan:
    """Start-up short of the weights and the memory: the model's files (or the injected model),
    the device, the ranks, the plan, and the plan's memory against what is free now."""
    return checked_plan(config, model_config(config, model), log_choices=False)


def checked_plan(config: EngineConfig, model_cfg: ModelConfig, *, log_choices: bool) -> EnginePlan:
    """``plan_engine``, and the plan's memory against what the machine has free now."""
    plan = plan_engine(config, model_cfg, log_choices=log_choices)
    check_memory(config, plan.device)
    return plan


def allocate(
    config: EngineConfig,
    plan: EnginePlan,
    model_cfg: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    transfer: Callable[[str, torch.device], TransferStream] | None = None,
    host_rows: HostRows | None = None,
) -> HiSparseCoordinator | ResidentMemory:
    """The memory layer of ``plan``: HiSparse's coordinator, or every token's KV resident."""
    # no draft: no MTP rows
    drafts = model_cfg.num_nextn_predict_layers if plan.speculative is not None else 0
    hs = config.hisparse
    fmt = kv_format(model_cfg, dtype, config.kv_cache_dtype)
    if hs is None:
        return ResidentMemory(
            plan=plan.memory, num_layers=model_cfg.num_hidden_layers, num_mtp_layers=drafts,
            row_dim=fmt.row_width, index_dim=fmt.key_width, dtype=fmt.storage_dtype, device=device,
            kv_format=fmt,
        )
    streams: dict[str, Any] = {"transfer": transfer} if transfer is not None else {}
    return HiSparseCoordinator(
        plan=plan.memory, num_layers=model_cfg.num_hidden_layers, row_dim=fmt.row_width,
        index_dim=fmt.key_width, dtype=fmt.storage_dtype, device=device, num_draft_layers=drafts,
        draft_rows_on_host=hs.draft_rows_on_host, draft_keys_on_host=hs.draft_keys_on_host,
        kv_format=fmt, host_rows=host_rows, **streams,
        shared_layers=tuple(i for i, kind in enumerate(model_cfg.indexer_types) if kind == "shared"),
    )


# --- the plan ---------------------------------------------------------------------------------------


def plan_engine(config: EngineConfig, model_cfg: ModelConfig, *, log_choices: bool = True) -> EnginePlan:
    """Every derived value of ``config`` for a model of ``model_cfg`` (its ``ModelConfig``), each
    choice logged (``log_choices``); a ``ConfigError`` names the field a rule rejects.

    * ``speculative="auto"`` -> ``SpeculativeConfig()`` if the model has an MTP layer, else None (an
      MTP layer config.json names but the weights lack counts as none, with the warning
      ``model.mtp_missing``) (``speculative_for``);
    * ``hisparse.device_buffer_size=None`` -> HOT: 128, or the model's ``index_topk`` in whole pages
      when that is more (``HiSparseConfig.hot_for``);
    * the pools (``pipeline.pool_sizes.size_pools``): without a device memory budget, the sizes given
      or 16384 slots, 16 rows and a ratio of 4, and ``max_context_len=None`` the model's positions as
      far as the pools hold; with one, what the budget pays for, the sizes given kept.
    """
    batch_tokens = prefill_budget(config)
    # the config against the model, and the defaults the model decides
    spec = speculative_for(config, model_cfg, log_choice=log_choices)
    check_against_model(config, index_topk=model_cfg.index_topk,
                        has_mtp=model_cfg.num_nextn_predict_layers > 0,
                        max_positions=model_cfg.max_position_embeddings)
    hs = config.hisparse
    hot = hot_for(config, model_cfg, log_choice=log_choices)
    if hs is not None and spec is not None:
        check_draft_zone(spec, config.page_size)
    draft = 0 if spec is None else spec.draft_tokens
    policy = DEFAULT_POLICY if hs is None else hs.policy_for(config.device)
    # the sizes
    dims = ModelDims.of(model_cfg, config.dtype, speculative=spec is not None,
                        draft_rows_on_host=hs is not None and hs.draft_rows_on_host,
                        draft_keys_on_host=hs is not None and hs.draft_keys_on_host,
                        kv_cache_dtype=config.kv_cache_dtype)
    budget = device_budget(config.device_memory_bytes, config.device_memory_fraction, config.device)
    tokens = budget is None  # the pools are sized in tokens: the sizes given, or the defaults
    ratio = None if hs is None else hs.host_to_device_ratio
    sizes = size_pools(
        hisparse=hs is not None, page_size=config.page_size, hot=hot, draft_tokens=draft,
        chunked_prefill_tokens=config.chunked_prefill_tokens, positions=model_cfg.max_position_embeddings,
        budget=budget, dims=dims, max_context_len=config.max_context_len,
        device_pool_tokens=DEFAULT_POOL_TOKENS if tokens and config.device_pool_tokens is None
        else config.device_pool_tokens,
        max_running_requests=DEFAULT_ROWS if tokens and config.max_running_requests is None
        else config.max_running_requests,
        host_to_device_ratio=DEFAULT_RATIO if tokens and ratio is None else ratio,
        residency="always" if hs is None else hs.residency, log_choices=log_choices,
    )
    slots, ratio = sizes.device_pool_tokens, sizes.host_to_device_ratio
    memory = MemoryPlan(
        page_size=config.page_size, hot=hot, buffer_columns=hot + config.page_size if hs is not None else 0,
        top_k=model_cfg.index_topk or 0, device_tokens=slots, logical_tokens=sizes.logical_pool_tokens,
        host_tokens=sizes.logical_pool_tokens if hs is not None else 0, max_context_len=sizes.max_context_len,
        max_running_requests=sizes.max_running_requests, draft_tokens=draft, hisparse=hs is not None,
        prefill_chunk=prefill_chunk(config.chunked_prefill_tokens, sizes.max_context_len),
        prefix_cache=config.prefix_cache, policy=policy, near_margin=None if hs is None else hs.near_margin,
        residency="always" if hs is None else hs.residency,
    )
    return EnginePlan(
        speculative=spec, max_context_len=sizes.max_context_len,
        max_running_requests=sizes.max_running_requests, device_pool_tokens=slots, hot=hot,
        host_to_device_ratio=ratio, device_memory_bytes=budget, prefill_budget=batch_tokens,
        memory=memory, device=DevicePlan.of(memory, dims, budget),
    )


def prefill_budget(config: EngineConfig) -> int | None:
    """``prefill_batch_tokens`` resolved: "auto" is max(2048, the chunk), None with whole prompts."""
    batch, chunk = config.prefill_batch_tokens, config.chunked_prefill_tokens
    if batch != "auto":
        return batch
    return None if chunk is None else max(DEFAULT_PREFILL_BATCH, chunk)
