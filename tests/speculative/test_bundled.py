"""The bundled model with its real MTP head: speculative greedy equals plain greedy through the
executor (float64), with and without HiSparse, on held-out text, with prompts on both sides of HOT,
and its drafts really get accepted."""

from __future__ import annotations

import pytest
import torch
from _spec_util import bundled_config, bundled_prompts

from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.model import load_model
from pipeline.sampling import SamplingParams


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", dtype=torch.float64)


@pytest.fixture(scope="module")
def prompts():
    return bundled_prompts()


config = bundled_config


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
