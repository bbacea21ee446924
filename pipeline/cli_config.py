"""Command-line options to an ``EngineConfig``: the one place a command or a benchmark makes one.

``generate``, ``chat`` and ``serve`` share every engine option (``pipeline.generate``'s
``add_engine_arguments``); a benchmark has a few of them (``--model``, ``--dtype``, ``--seed``...)
and sizes the rest itself. So ``engine_config`` reads each option the namespace has, leaves a
field whose option it lacks at ``EngineConfig``'s default, and takes what the caller fixes itself
(``fields``) over both. An option is known by its name (``PLAIN_OPTIONS`` and the flags below): a
benchmark whose option shares a name but not the meaning (``bench tp``'s ``--tp`` lists sizes)
fixes that field itself.
"""

from __future__ import annotations

import argparse
from typing import Any, cast

import attrs

from pipeline.config import DEFAULT_POOL_TOKENS, EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.distributed.environment import tensor_parallel_size

DEFAULT_PAGE_SIZE = cast(int, attrs.fields(EngineConfig).page_size.default)

# option (the namespace's attribute) -> the ``EngineConfig`` field it sets unchanged
PLAIN_OPTIONS = {
    "model": "model",
    "tokenizer": "tokenizer",
    "chat_template": "chat_template",
    "device": "device",
    "dtype": "dtype",
    "kv_cache_dtype": "kv_cache_dtype",
    "page_size": "page_size",
    "max_context_len": "max_context_len",
    "max_running_requests": "max_running_requests",
    "device_memory": "device_memory_bytes",
    "device_memory_fraction": "device_memory_fraction",
    "seed": "seed",
    "tp": "tensor_parallel_size",
}


def chunk_tokens(args: argparse.Namespace) -> int | None:
    """``--chunked-prefill-tokens``: 0 turns chunking off (negative values reach the config's check)."""
    return None if args.chunked_prefill_tokens == 0 else args.chunked_prefill_tokens


def batch_tokens(args: argparse.Namespace) -> int | str | None:
    """``--prefill-batch-tokens``: not given is "auto", 0 is no bound (negative values reach the
    config's check)."""
    given = args.prefill_batch_tokens
    return "auto" if given is None else None if given == 0 else given


def speculative_of(args: argparse.Namespace) -> SpeculativeConfig | str | None:
    """``--no-spec`` and ``--num-steps``: none given is ``"auto"`` (on exactly when the model has an
    MTP layer); ``--num-steps N`` asks for speculation (a model without MTP is then a ``ConfigError``)."""
    if getattr(args, "no_spec", False):
        return None
    steps = getattr(args, "num_steps", None)
    return "auto" if steps is None else SpeculativeConfig(num_steps=steps)


def hisparse_of(args: argparse.Namespace) -> HiSparseConfig | None:
    """``--no-hisparse``, ``--hot``, ``--policy``, ``--near-margin`` and ``--residency`` (those missing:
    their default)."""
    if getattr(args, "no_hisparse", False):
        return None
    return HiSparseConfig(
        device_buffer_size=getattr(args, "hot", None), policy=getattr(args, "policy", "auto"),
        near_margin=getattr(args, "near_margin", None), residency=getattr(args, "residency", "always"),
    )


def default_pool(page_size: int, context: int | None) -> int:
    """The device pool without a memory budget: ``DEFAULT_POOL_TOKENS`` slots, or one full context
    in whole pages if that is more."""
    if context is None:
        return DEFAULT_POOL_TOKENS
    return max(DEFAULT_POOL_TOKENS, -(-context // page_size) * page_size)


# ``Any``: the values go to the attrs-generated ``EngineConfig.__init__``, one type per field
def engine_config(args: argparse.Namespace, **fields: Any) -> EngineConfig:
    """The ``EngineConfig`` of a command's options, ``fields`` over them.

    An option the namespace lacks leaves its field at ``EngineConfig``'s default (``--page-size``
    16, ``--hot`` None, which the engine resolves to 128 or the model's index_topk in whole pages if
    that is more, ``--policy auto``). Without ``--device-pool-tokens`` and without a device memory
    budget the pool is ``default_pool``. No ``--num-steps`` is ``speculative="auto"``."""
    given = vars(args)
    options: dict[str, Any] = {field: given[opt] for opt, field in PLAIN_OPTIONS.items() if opt in given}
    options["speculative"] = speculative_of(args)
    options["hisparse"] = hisparse_of(args)
    if "chunked_prefill_tokens" in given:
        options["chunked_prefill_tokens"] = chunk_tokens(args)
    if "prefill_batch_tokens" in given:
        options["prefill_batch_tokens"] = batch_tokens(args)
    if "no_mixed_steps" in given:
        options["mixed_steps"] = not args.no_mixed_steps
    if "no_prefix_cache" in given:
        options["prefix_cache"] = not args.no_prefix_cache
    if "no_shared_host_pool" in given:
        options["shared_host_pool"] = not args.no_shared_host_pool
    if given.get("cuda_graphs"):
        options["cuda_graphs"] = True
    options["device_pool_tokens"] = given.get("device_pool_tokens")
    options |= fields
    # --tp not given: the launcher's WORLD_SIZE, else 1; given under a launcher, it must equal it
    options["tensor_parallel_size"] = tensor_parallel_size(options.get("tensor_parallel_size"))
    budget = any(options.get(f) is not None for f in ("device_memory_bytes", "device_memory_fraction"))
    if options["device_pool_tokens"] is None and not budget:
        page = options.get("page_size", DEFAULT_PAGE_SIZE)
        options["device_pool_tokens"] = default_pool(page, options.get("max_context_len"))
    return EngineConfig(**options)
