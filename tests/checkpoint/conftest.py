"""Checkpoint tests: one user checkpoint built per session (see ``_checkpoint``), the HF oracle
loaded from the same directory, quiet logs, one torch thread."""

from __future__ import annotations

import io

import pytest
import structlog
import torch

from pipeline.logs import configure_logging


@pytest.fixture(autouse=True)
def _quiet_single_thread():
    sink = configure_logging(level="warning", stream=io.StringIO())
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    sink.close()
    structlog.reset_defaults()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from _checkpoint import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("user-checkpoint"))


@pytest.fixture(scope="session")
def hf_tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint.path), local_files_only=True)


@pytest.fixture(scope="session")
def hf_model(checkpoint):
    from transformers import DeepseekV32ForCausalLM

    model = DeepseekV32ForCausalLM.from_pretrained(str(checkpoint.path), dtype=torch.float64)
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    from pipeline.model.tokenizer import load_tokenizer

    return load_tokenizer(checkpoint.path)
