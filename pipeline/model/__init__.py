"""The DeepSeek-V3.2-style model: config, layers, MLA + indexer, MTP, checkpoints, reference decoders."""

from pipeline.model.attention_api import AttentionBackend, AttentionInputs
from pipeline.model.checkpoint import CheckpointError, load_model, save_model
from pipeline.model.config import ModelConfig, ModelConfigError, resolve_model_dir
from pipeline.model.model import DeepseekV32, MtpOutput, init_weights
from pipeline.model.resident import ForwardLayout, ResidentBackend, ResidentKV

__all__ = [
    "AttentionBackend",
    "AttentionInputs",
    "CheckpointError",
    "DeepseekV32",
    "ForwardLayout",
    "ModelConfig",
    "ModelConfigError",
    "MtpOutput",
    "ResidentBackend",
    "ResidentKV",
    "init_weights",
    "load_model",
    "resolve_model_dir",
    "save_model",
]
