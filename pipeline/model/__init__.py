"""The DeepSeek-V3.2-style model: config, layers, MLA + indexer, MTP, checkpoints, reference decoders.

The inference contract (``attention_api``): ``DeepseekV32.forward(input_ids, positions, backend)``
returns final-normed hidden states, ``logits(hidden)`` the head's output and
``mtp_forward(next_token_ids, positions, prev_hidden, backend)`` one MTP step; an
``AttentionBackend`` receives one ``AttentionInputs`` per layer. ``ResidentBackend`` over
``ResidentKV`` is the all-resident backend; ``ReferenceDecoder`` / ``ReferenceSpecDecoder`` are the
synchronous oracles built on it.
"""

from pipeline.model.attention_api import AttentionBackend, AttentionInputs
from pipeline.model.checkpoint import CheckpointError, load_model, save_model
from pipeline.model.config import ModelConfig, ModelConfigError, resolve_model_dir
from pipeline.model.model import DeepseekV32, MtpOutput, init_weights
from pipeline.model.reference import (
    DecodeSession,
    Generation,
    ReferenceDecoder,
    ReferenceSpecDecoder,
    Sampling,
)
from pipeline.model.resident import ForwardLayout, ResidentBackend, ResidentKV
from pipeline.model.tokenizer import ByteTokenizer, HFTokenizer, StreamDecoder, Tokenizer, load_tokenizer

__all__ = [
    "AttentionBackend",
    "AttentionInputs",
    "ByteTokenizer",
    "CheckpointError",
    "DecodeSession",
    "DeepseekV32",
    "ForwardLayout",
    "Generation",
    "HFTokenizer",
    "ModelConfig",
    "ModelConfigError",
    "MtpOutput",
    "ReferenceDecoder",
    "ReferenceSpecDecoder",
    "ResidentBackend",
    "ResidentKV",
    "Sampling",
    "StreamDecoder",
    "Tokenizer",
    "init_weights",
    "load_model",
    "load_tokenizer",
    "resolve_model_dir",
    "save_model",
]
