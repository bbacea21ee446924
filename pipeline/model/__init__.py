"""The DeepSeek-V3.2-style model: config, layers, MLA + indexer, MTP, checkpoints, reference decoders.

Architectures (``registry``): ``deepseek_v32`` and ``glm_moe_dsa`` (GLM-5); checkpoints are read by
``load_model`` (sharded, lazy, FP8 block-quantized weights dequantized at load, plain or YaRN RoPE).

The inference contract (``attention_api``): ``DeepseekV32.forward(input_ids, positions, backend)``
returns final-normed hidden states, ``logits(hidden)`` the head's output and
``mtp_forward(next_token_ids, positions, prev_hidden, backend)`` one MTP step; an
``AttentionBackend`` receives one ``AttentionInputs`` per layer. ``ResidentBackend`` over
``ResidentKV`` is the all-resident backend; ``ReferenceDecoder`` / ``ReferenceSpecDecoder`` are the
synchronous oracles built on it.
"""

from pipeline.model.attention_api import AttentionBackend, AttentionInputs
from pipeline.model.checkpoint import save_model
from pipeline.model.config import ModelConfig, ModelConfigError, ModelNotFoundError, resolve_model_dir
from pipeline.model.loader import load_model
from pipeline.model.model import DeepseekV32, MtpOutput, init_weights
from pipeline.model.reference import (
    DecodeSession,
    Generation,
    ReferenceDecoder,
    ReferenceSpecDecoder,
    Sampling,
)
from pipeline.model.registry import ARCHITECTURES
from pipeline.model.resident import ForwardLayout, ResidentBackend, ResidentKV
from pipeline.model.tokenizer import ByteTokenizer, HFTokenizer, StreamDecoder, Tokenizer, load_tokenizer
from pipeline.model.weights import CheckpointError

__all__ = [
    "ARCHITECTURES",
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
    "ModelNotFoundError",
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
