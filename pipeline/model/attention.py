"""MLA attention with its DSA indexer, in the decode-time absorbed form.

Per token, MLA caches one row ``[kv_a_layernorm(latent) (C) | rotated k_rope (R)]``. A head's key is
``[W_UK[h] @ latent | k_rope]`` and its value ``W_UV[h] @ latent`` (``kv_b_proj`` holds both), so the
score ``q_nope . (W_UK latent)`` equals ``(q_nope @ W_UK) . latent``: the query is absorbed into latent
space once per token and attention runs directly over cached rows; the output is lifted back by W_UV.

The indexer is a second, cheap attention used only to rank past positions: its own single-head key
per token (``LayerNorm(wk(x))``, half-split rope for DeepSeek-V3.2, interleaved for GLM-5),
``index_n_heads`` query heads read from the MLA query latent, and per-head weights
``weights_proj(x) / sqrt(n_heads)``. A ``"shared"`` layer (GLM-5) has no indexer: the backend reuses
the previous full layer's selection for it.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.model.attention_api import AttentionBackend, AttentionInputs
from pipeline.model.config import ModelConfig
from pipeline.model.layers import RMSNorm, rope_half_split, rope_interleaved, wide_dtype


@attrs.frozen
class MlaProjection:
    """The MLA query and the new cache row of each token (leading dims ``...`` = ``[T]`` or ``[B, T]``)."""

    q_resid: Tensor  # [..., q_lora_rank] normalised query latent (the indexer reads it too)
    q_nope: Tensor  # [..., H, qk_nope_head_dim]
    q_rope: Tensor  # [..., H, R] rotated
    latent: Tensor  # [..., C] normalised KV latent
    k_rope: Tensor  # [..., R] rotated shared rope key


@attrs.frozen
class IndexerProjection:
    q: Tensor  # [..., Hi, Di] rotated
    w: Tensor  # [..., Hi] per-head weights, wide dtype
    k: Tensor  # [..., Di] normalised, rotated


class Indexer(nn.Module):
    """The DSA lightning indexer's projections (scoring and top-k live in the backend / kernels)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, cfg.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=1e-6)
        # kept in the wide dtype (HF keeps it in float32), see ``cast_model``
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)

    def project(self, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor) -> IndexerProjection:
        cfg = self.cfg
        r = cfg.qk_rope_head_dim
        rope = rope_interleaved if cfg.indexer_rope == "interleaved" else rope_half_split
        q = self.wq_b(q_resid).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))  # [..., Hi, Di]
        q = torch.cat([rope(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        wide = wide_dtype(x.dtype)
        w = F.linear(x.to(wide), self.weights_proj.weight.to(wide)) * cfg.index_n_heads**-0.5
        return IndexerProjection(q=q, w=w, k=self.key(x, cos, sin))

    def key(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``[..., Di]``: each token's indexer key (normed, rotated)."""
        r = self.cfg.qk_rope_head_dim
        rope = rope_interleaved if self.cfg.indexer_rope == "interleaved" else rope_half_split
        k = self.k_norm(self.wk(x))  # [..., Di]
        k_rot = rope(k[..., None, :r], cos, sin)[..., 0, :]
        return torch.cat([k_rot, k[..., r:]], dim=-1)


class MlaAttention(nn.Module):
    """Multi-head latent attention; parameter names follow HF's ``DeepseekV32Attention``."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.num_attention_heads
        self.num_heads = h  # the heads this module computes (a tensor-parallel shard holds fewer)
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_row_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, cfg.hidden_size, bias=False)
        # a "shared" layer has no indexer weights; it reuses the previous full layer's selection
        self.indexer: Indexer | None = Indexer(cfg) if cfg.indexer_kind(layer) == "full" else None

    # ----- projections shared by inference and training ---------------------------------------
    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> MlaProjection:
        cfg = self.cfg
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).unflatten(-1, (self.num_heads, cfg.qk_head_dim))  # [..., H, qk]
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)  # [..., C + R]
        latent, k_rope = kv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_rope = rope_interleaved(k_rope[..., None, :], cos, sin)[..., 0, :]
        return MlaProjection(
            q_resid=q_resid,
            q_nope=q_nope,
            q_rope=rope_interleaved(q_rope, cos, sin),
            latent=self.kv_a_layernorm(latent),
            k_rope=k_rope,
        )

    def up_weights(self) -> tuple[Tensor, Tensor]:
        """``(W_UK [H, nope, C], W_UV [H, v, C])`` views of ``kv_b_proj``."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    def cache_rows(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor | None]:
        """``x [T, D]`` (normed) -> the rows ``forward`` hands its backend: cache rows ``[T, C + R]``
        and indexer keys ``[T, Di]`` (None without an indexer)."""
        cfg = self.cfg
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_rope = rope_interleaved(k_rope[..., None, :], cos, sin)[..., 0, :]
        kv_rows = torch.cat([self.kv_a_layernorm(latent), k_rope], dim=-1)
        if self.indexer is None:
            return kv_rows, None
        return kv_rows, self.indexer.key(x, cos, sin)

    # ----- inference (absorbed) -----------------------------------------------------------------
    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend, layer: int) -> Tensor:
        """``x [T, D]`` (already normed) -> ``[T, D]``."""
        cfg = self.cfg
        p = self.project(x, cos, sin)
        idx = self.indexer.project(x, p.q_resid, cos, sin) if self.indexer is not None else None
        w_uk, w_uv = self.up_weights()
        inputs = AttentionInputs(
            layer=layer,
            q_latent=torch.einsum("thn,hnc->thc", p.q_nope, w_uk),
            q_rope=p.q_rope,
            kv_rows=torch.cat([p.latent, p.k_rope], dim=-1),
            index_q=None if idx is None else idx.q,
            index_w=None if idx is None else idx.w,
            index_k=None if idx is None else idx.k,
            attn_scale=cfg.attn_scale,
            index_scale=cfg.index_scale,
            top_k=cfg.index_topk,
            reuse_topk=idx is None,
        )
        latent_out = backend.attend(inputs)  # [T, H, C]
        out = torch.einsum("thc,hvc->thv", latent_out.to(x.dtype), w_uv)  # [T, H, v]
        return self.o_proj(out.flatten(-2))
