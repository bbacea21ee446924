"""The bundled model with its real MTP head: speculative greedy equals plain greedy through the
executor (float64), with and without HiSparse, on held-out text, with prompts on both sides of HOT,
and its drafts really get accepted."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.model import load_model
from pipeline.model.corpus import build_corpus
from pipeline.sampling import SamplingParams

HOT = 64


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", dtype=torch.float64)


@pytest.fixture(scope="module")
def prompts():
    held = build_corpus().held_out
    starts = torch.nonzero(held[:-400] == 10).reshape(-1)[[3, 50, 400]] + 1
    lens = (40, HOT + 9, 3 * HOT)
    return [held[int(s) : int(s) + n].tolist() for s, n in zip(starts, lens)]


def config(hisparse: bool, num_steps: int | None) -> EngineConfig:
    return EngineConfig(
        dtype="float64",
        page_size=8,
        max_context_len=512,
        max_running_requests=3,
        device_pool_tokens=1024,
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2) if hisparse else None,
        speculative=SpeculativeConfig(num_steps=num_steps, max_batch_size=None, timed=False, min_accept_length=None) if num_steps else None,
    )


def generate(model, cfg, prompts):
    executor = Executor(cfg, model=model)
    reqs = SyncDriver(executor, check=True).generate(
        prompts, SamplingParams(max_new_tokens=40, ignore_eos=True)
    )
    executor.close()
    return [r.output_ids for r in reqs], executor


@pytest.mark.parametrize("hisparse", [False, True], ids=["resident", "hisparse"])
def test_speculative_greedy_equals_plain_greedy_on_the_bundled_model(model, prompts, hisparse):
    plain, _ = generate(model, config(hisparse, None), prompts)
    spec, executor = generate(model, config(hisparse, 3), prompts)
    assert spec == plain
    assert executor.spec_counters.accept_length > 1.5, "the trained MTP head must get drafts accepted"
