"""bfloat16 and float16 serve with HiSparse, as float32 does: greedy output equal to all-resident
at the same dtype, with and without speculation, under every replacement policy, with the prefix
cache; every pool restored. (bfloat16 once failed every request: the compiled one-call layer took
numpy views of its pools, and numpy has no bfloat16; such pools now take the step-by-step path.)"""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import pytest
import torch

from kernels.swap_in_policy import POLICIES
from pipeline.config import HiSparseConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.sampling import SamplingParams

from tiny_models import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from _reliability_util import HOT, small_config

PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, HOT + 3, 3 * HOT + 1)]


def run(model, cfg, batch):
    executor = Executor(cfg, model=model)
    driver = SyncDriver(executor, check=True)
    reqs = driver.generate(batch, PARAMS)
    assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
    # the shared prefix: a second request per prompt reads cached pages
    again = driver.generate(batch, PARAMS)
    assert [r.output_ids for r in again] == [r.output_ids for r in reqs]
    assert executor.pool_counts() == Executor(cfg, model=model).pool_counts()
    executor.close()
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("num_steps", [None, 3], ids=["plain", "speculative"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_hisparse_equals_resident_in_half_precision(dtype, num_steps):
    model = build_tiny_model(dtype=getattr(torch, dtype), seed=2)
    batch = prompts()
    resident = run(model, small_config(hisparse=False, num_steps=num_steps, dtype=dtype), batch)
    hisparse = run(model, small_config(hisparse=True, num_steps=num_steps, dtype=dtype), batch)
    assert hisparse == resident


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_serves_bfloat16(policy):
    model = build_tiny_model(dtype=torch.bfloat16, seed=2)
    batch = prompts()
    resident = run(model, small_config(hisparse=False, num_steps=None, dtype="bfloat16"), batch)
    cfg = attrs.evolve(small_config(num_steps=None, dtype="bfloat16"),
                       hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2, policy=policy))
    assert cfg.hisparse.policy == policy
    assert run(model, cfg, batch) == resident
