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


# ----- the checkpoints users bring (``_checkpoint.build_saved_checkpoint``), one per session ----------
@pytest.fixture(scope="session")
def trained_tokenizer():
    from _checkpoint import train_tokenizer

    return train_tokenizer()


@pytest.fixture(scope="session")
def deepseek_checkpoint(tmp_path_factory, trained_tokenizer):
    """(a) DeepSeek-V3.2 as ``save_pretrained`` writes it: bfloat16, two shards, no MTP layer."""
    from _checkpoint import build_saved_checkpoint

    return build_saved_checkpoint(tmp_path_factory.mktemp("saved") / "deepseek", tokenizer=trained_tokenizer)


@pytest.fixture(scope="session")
def deepseek_mtp_checkpoint(tmp_path_factory, trained_tokenizer):
    """(b) the same with a DeepSeek-style MTP layer in a third shard."""
    from _checkpoint import build_saved_checkpoint

    out = tmp_path_factory.mktemp("saved") / "deepseek-mtp"
    return build_saved_checkpoint(out, mtp=True, seed=1, tokenizer=trained_tokenizer)


@pytest.fixture(scope="session")
def glm_checkpoint(tmp_path_factory, trained_tokenizer):
    """(c) GLM-5 (``glm_moe_dsa``) as ``save_pretrained`` writes it."""
    from _checkpoint import build_saved_checkpoint

    out = tmp_path_factory.mktemp("saved") / "glm"
    return build_saved_checkpoint(out, model_type="glm_moe_dsa", seed=2, tokenizer=trained_tokenizer)


@pytest.fixture(scope="session")
def resaved_checkpoint(tmp_path_factory, deepseek_checkpoint):
    """(d) an MTP layer named in config.json (``num_nextn_predict_layers: 1``), none in the weights."""
    from _checkpoint import resave_without_mtp

    return resave_without_mtp(deepseek_checkpoint, tmp_path_factory.mktemp("saved") / "resaved")
