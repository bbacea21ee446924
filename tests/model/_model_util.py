"""Helpers shared by the model tests: tiny random models and one-call forwards over a resident store."""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from pipeline.model import (
    AttentionInputs,
    DeepseekV32,
    ForwardLayout,
    ModelConfig,
    ResidentBackend,
    ResidentKV,
    init_weights,
)


def tiny_config(**overrides) -> ModelConfig:
    """2 target layers (dense, MoE) + 1 MTP layer, index_topk 8, byte vocab with <eos> = 256."""
    kw = dict(
        vocab_size=257, hidden_size=48, intermediate_size=96, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, n_shared_experts=1, n_routed_experts=4,
        routed_scaling_factor=1.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_layer_types=("dense", "sparse"), hidden_act="silu",
        max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, index_topk=8,
        index_head_dim=16, index_n_heads=2, tie_word_embeddings=False, eos_token_id=256,
        num_nextn_predict_layers=1,
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def random_model(cfg: ModelConfig | None = None, seed: int = 0, std: float = 0.15) -> DeepseekV32:
    """A float64 random model; a large init std gives peaked, varied logits (greedy is not constant)."""
    model = init_weights(DeepseekV32(cfg or tiny_config()), seed=seed, std=std)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))
    return model.to_dtype(torch.float64).eval()


def new_backend(model: DeepseekV32, num_rows: int = 1024, num_requests: int = 4, max_ctx: int = 512):
    store = ResidentKV.allocate(model.cfg, num_rows, num_requests, max_ctx, model.dtype)
    return RecordingBackend(store)


@attrs.define(eq=False)
class RecordingBackend(ResidentBackend):
    """A resident backend that also keeps each layer's indexer top-k positions of the last forward."""

    topk: dict[int, Tensor] = attrs.Factory(dict)

    def select_slots(self, inputs: AttentionInputs, keys: Tensor) -> Tensor:
        slots = super().select_slots(inputs, keys)
        self.topk[inputs.layer] = self.last_topk  # a shared layer's is the full layer's, reused
        return slots


def run(model: DeepseekV32, backend: ResidentBackend, ids, positions, rows=None, locs=None) -> Tensor:
    """One target forward of a flat batch; returns logits ``[T, V]``. Defaults: request 0, loc = position."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    positions = torch.as_tensor(positions, dtype=torch.int64)
    rows = torch.zeros_like(positions) if rows is None else torch.as_tensor(rows, dtype=torch.int64)
    locs = positions.clone() if locs is None else torch.as_tensor(locs, dtype=torch.int64)
    backend.begin(ForwardLayout(req_rows=rows, positions=positions, write_locs=locs))
    with torch.no_grad():
        return model.logits(model(ids, positions, backend))


def prefill_logits(model: DeepseekV32, ids) -> Tensor:
    """Logits of one request's full prefill."""
    n = len(ids)
    return run(model, new_backend(model, num_rows=n, num_requests=1, max_ctx=n), ids, torch.arange(n))
