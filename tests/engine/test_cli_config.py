"""One function turns command-line options into an ``EngineConfig`` (``pipeline.cli_config``): the
commands' options set their fields, a benchmark's namespace (a few of them) leaves the rest at
the config's defaults, and what the caller fixes itself wins over both."""

from __future__ import annotations

from argparse import Namespace

import attrs

from pipeline.cli_config import default_pool, engine_config
from pipeline.config import DEFAULT_POOL_TOKENS, EngineConfig, HiSparseConfig
from pipeline.generate import build_parser


def test_a_namespace_without_engine_options_gives_the_config_defaults():
    got = engine_config(Namespace(model="tiny", dtype="float64", seed=7, threads=1, repeats=3))
    want = EngineConfig(model="tiny", dtype="float64", seed=7, device_pool_tokens=DEFAULT_POOL_TOKENS)
    assert got == want


def test_what_the_caller_fixes_wins_over_the_options():
    args = build_parser().parse_args(["--no-hisparse", "--max-context-len", "64", "hi"])
    hisparse = HiSparseConfig(device_buffer_size=32)
    got = engine_config(args, hisparse=hisparse, page_size=8, device_pool_tokens=512, max_context_len=128)
    assert (got.hisparse, got.page_size) == (hisparse, 8)
    assert (got.device_pool_tokens, got.max_context_len) == (512, 128)
    assert got == attrs.evolve(engine_config(args), hisparse=hisparse, page_size=8, device_pool_tokens=512,
                               max_context_len=128)


def test_the_pool_default_holds_one_full_context():
    assert default_pool(16, None) == DEFAULT_POOL_TOKENS
    assert default_pool(16, 100) == DEFAULT_POOL_TOKENS
    assert default_pool(16, DEFAULT_POOL_TOKENS + 1) == DEFAULT_POOL_TOKENS + 16
    long = build_parser().parse_args(["--max-context-len", str(DEFAULT_POOL_TOKENS + 1), "hi"])
    assert engine_config(long).device_pool_tokens == DEFAULT_POOL_TOKENS + 16
    budget = build_parser().parse_args(["--device-memory", "64MB", "hi"])
    assert engine_config(budget).device_pool_tokens is None  # the budget sizes the pool


def test_the_commands_options_set_their_fields():
    args = build_parser().parse_args([
        "--no-spec", "--chunked-prefill-tokens", "0", "--prefill-batch-tokens", "0", "--no-mixed-steps",
        "--no-prefix-cache", "--policy", "lru", "--seed", "3", "--tp", "2", "--residency", "dynamic",
        "--no-shared-host-pool", "hi",
    ])
    got = engine_config(args)
    assert not got.shared_host_pool and engine_config(build_parser().parse_args(["hi"])).shared_host_pool
    assert got.hisparse.residency == "dynamic"
    assert engine_config(build_parser().parse_args(["hi"])).hisparse.residency == "always"
    assert got.speculative is None and got.chunked_prefill_tokens is None and got.prefill_batch_tokens is None
    assert not got.mixed_steps and not got.prefix_cache
    assert (got.hisparse.policy, got.seed, got.tensor_parallel_size) == ("lru", 3, 2)
    assert engine_config(build_parser().parse_args(["--num-steps", "2", "hi"])).speculative.num_steps == 2
    assert engine_config(build_parser().parse_args(["hi"])).speculative == "auto"
