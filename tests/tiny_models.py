"""Random tiny models for tests (no checkpoint, no download)."""

from __future__ import annotations

import torch

TINY_CONFIG = dict(
    model_type="deepseek_v32",
    vocab_size=257,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=2048,
    index_topk=8,
    index_n_heads=2,
    index_head_dim=16,
    num_nextn_predict_layers=1,
    eos_token_id=256,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def build_tiny_model(dtype=None, seed: int = 0, **overrides):
    """A random tiny DeepSeek-V3.2-style model (no checkpoint): dense layer 0, MoE layer 1, one MTP layer."""
    from pipeline.model import DeepseekV32, ModelConfig, init_weights

    cfg = ModelConfig.from_hf_dict({**TINY_CONFIG, **overrides})
    model = init_weights(DeepseekV32(cfg), seed=seed)
    return model.to_dtype(dtype if dtype is not None else torch.float64).eval()
