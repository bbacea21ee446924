"""HF transformers' DeepSeek-V3.2 and GLM-MoE-DSA (GLM-5) as float64 oracles.

HF computes RMSNorm, the MoE router, the indexer scores and the eager softmax in float32 whatever the
model dtype, and breaks indexer top-k ties arbitrarily (``torch.topk``). For float64 comparisons the
context manager :func:`hf_float64_patches` swaps those four pieces for versions that compute in
max(float32, dtype) (so float64 stays float64, as hispec does) and pick the top-k with a stable
descending sort (ties to the lower position, hispec's contract). Everything else is HF's own code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

from pipeline.model import DeepseekV32, load_model


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rmsnorm_forward(self, hidden_states):
    in_dtype = hidden_states.dtype
    x = hidden_states.to(_wide(in_dtype))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(in_dtype)


def _router_forward(self, hidden_states):
    x = hidden_states.view(-1, self.hidden_dim)
    wide = _wide(x.dtype)
    logits = F.linear(x.to(wide), self.weight.to(wide))
    scores = logits.sigmoid()
    choice = scores + self.e_score_correction_bias.to(wide)
    per_group = self.num_experts // self.num_group
    group_scores = choice.view(-1, self.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    kept = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, kept, 1)
    mask = mask.unsqueeze(-1).expand(-1, self.num_group, per_group).reshape(-1, self.num_experts)
    choice = choice.masked_fill(~mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if self.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * self.routed_scaling_factor, ids


def _half_split_rope(q, k, cos, sin):
    return hf.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)


def _interleaved_rope(q, k, cos, sin):
    return glm.apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=2)


@torch.no_grad()
def _indexer_forward(
    self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=None
):
    b, s, _ = hidden_states.shape
    cos, sin = position_embeddings
    r = self.qk_rope_head_dim
    q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    rope = _interleaved_rope if isinstance(self, glm.GlmMoeDsaIndexer) else _half_split_rope
    q_rot, k_rot = rope(q[..., :r], k[..., :r], cos, sin)
    q = torch.cat([q_rot, q[..., r:]], dim=-1)
    k = torch.cat([k_rot, k[..., r:]], dim=-1).squeeze(2)
    if cache is not None:
        k = cache.update_indexer(k, self.layer_idx)
    wide = _wide(hidden_states.dtype)
    scores = F.relu(torch.matmul(q.to(wide), k.transpose(-1, -2).to(wide).unsqueeze(1)) * self.softmax_scale)
    weights = F.linear(hidden_states.to(wide), self.weights_proj.weight.to(wide)) * (self.n_heads**-0.5)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if attention_mask.dtype == torch.bool:
        index_scores = index_scores.masked_fill(~attention_mask, float("-inf"))
    else:
        index_scores = index_scores + attention_mask
    topk = min(self.index_topk, index_scores.shape[-1])
    order = torch.sort(index_scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    self.last_topk = order
    return order.to(torch.int32)


def _eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1, dtype=_wide(query.dtype)).to(query.dtype)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


@contextlib.contextmanager
def hf_float64_patches() -> Iterator[None]:
    """Patch HF's DeepSeek-V3.2 and GLM-MoE-DSA classes for wide-dtype numerics and the stable top-k."""
    saved = [
        (hf.DeepseekV32RMSNorm, "forward", _rmsnorm_forward),
        (hf.DeepseekV32TopkRouter, "forward", _router_forward),
        (hf.DeepseekV32Indexer, "forward", _indexer_forward),
        (hf, "eager_attention_forward", _eager_attention),
        (glm.GlmMoeDsaRMSNorm, "forward", _rmsnorm_forward),
        (glm.GlmMoeDsaTopkRouter, "forward", _router_forward),
        (glm.GlmMoeDsaIndexer, "forward", _indexer_forward),
        (glm, "eager_attention_forward", _eager_attention),
    ]
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in saved]
    try:
        for obj, name, new in saved:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in originals:
            setattr(obj, name, old)


def tiny_hf_config(**overrides) -> DeepseekV32Config:
    """A tiny V3.2 config: 3 layers (1 dense, 2 MoE), index_topk 8, built offline."""
    kw = dict(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=512,
        index_topk=8,
        index_n_heads=2,
        index_head_dim=16,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return DeepseekV32Config(**kw)


def tiny_glm_config(**overrides) -> GlmMoeDsaConfig:
    """A tiny GLM-MoE-DSA config: 4 layers (1 dense, 3 MoE), indexers full, shared, full, shared."""
    kw = dict(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=512,
        index_topk=8,
        index_n_heads=2,
        index_head_dim=16,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        indexer_types=["full", "shared", "full", "shared"],
    )
    kw.update(overrides)
    return GlmMoeDsaConfig(**kw)


def random_hf_model(cfg, seed: int):
    """A random HF model in float64, eager attention, with non-trivial norm weights and router biases."""
    torch.manual_seed(seed)
    model = (GlmMoeDsaForCausalLM if isinstance(cfg, GlmMoeDsaConfig) else DeepseekV32ForCausalLM)(cfg)
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms: perturb so a wrong norm placement shows
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
            else:  # larger than HF's 0.02 init: peaked logits, so greedy output is not one repeated token
                p.normal_(0.0, 0.15, generator=gen)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))
    return model.to(torch.float64).eval()


def ours_from_hf(hf_model, tmp: Path) -> DeepseekV32:
    """hispec's model with the HF model's weights, through a real save / load round trip (float64)."""
    hf_model.save_pretrained(tmp)
    return load_model(tmp, dtype=torch.float64)
