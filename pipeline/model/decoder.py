"""One decoder layer (pre-norm MLA + MLP) and the MTP layer built around one.

MTP (DeepSeek-V3 multi-token prediction), as HF transformers 5.24 defines it (``MtpLayer``):

    h_in  = eh_proj(cat[enorm(embed(next_token)), hnorm(prev_hidden)])     # embedding first
    h_out = shared_head.norm(decoder_layer(h_in))
    logits = lm_head(h_out)                                                # the target's head

``prev_hidden`` is the target's **final-normed** hidden state (HF feeds ``hidden_states[-1]``, which it
ties to ``last_hidden_state``, i.e. after ``model.norm``). In a chain, a later draft step feeds the
previous step's ``h_out`` (also normed) in its place.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from pipeline.model.attention import MlaAttention
from pipeline.model.attention_api import AttentionBackend
from pipeline.model.config import ModelConfig
from pipeline.model.layers import DenseMLP, RMSNorm
from pipeline.model.moe import MoE


class FastPath(Protocol):
    """A layer's inference forward, attached by ``pipeline.model.fused.fuse_for_inference``: the
    same results as the module path while ``current`` holds."""

    def current(self) -> bool: ...

    def __call__(
        self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend, layer: int
    ) -> Tensor: ...

    def cache_rows(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor | None]: ...


class DecoderLayer(nn.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``; names follow HF's ``DeepseekV32DecoderLayer``."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MlaAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            MoE(cfg) if cfg.mlp_kind(layer) == "sparse" else DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        )
        self.fused: FastPath | None = None  # the inference fast path (``fuse_for_inference``)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend, layer: int) -> Tensor:
        fused = self.fused
        if fused is not None and not torch.is_grad_enabled() and fused.current():
            return fused(x, cos, sin, backend, layer)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, layer)
        return x + self.mlp(self.post_attention_layernorm(x))

    def cache_rows(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor | None]:
        """``x [T, D]`` -> the cache rows ``[T, C + R]`` and indexer keys ``[T, Di]`` (None for a
        shared layer) that ``forward`` hands its backend, computed alone: what a backend stores
        for tokens whose outputs nobody reads."""
        fused = self.fused
        if fused is not None and not torch.is_grad_enabled() and fused.current():
            return fused.cache_rows(x, cos, sin)
        return self.self_attn.cache_rows(self.input_layernorm(x), cos, sin)


class SharedHead(nn.Module):
    """The MTP layer's output norm (``shared_head.norm``); the head itself is the target's ``lm_head``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MtpLayer(nn.Module):
    """One MTP depth. Its decoder layer has its own MLA, indexer and MLP (MoE when experts exist)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = DecoderLayer(cfg, layer)
        self.shared_head = SharedHead(cfg)

    def combine(self, embeds: Tensor, prev_hidden: Tensor) -> Tensor:
        """``[..., D]`` x2 -> ``[..., D]``: the decoder layer's input."""
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))

    def forward(
        self,
        embeds: Tensor,
        prev_hidden: Tensor,
        cos: Tensor,
        sin: Tensor,
        backend: AttentionBackend,
        layer: int,
    ) -> Tensor:
        h = self.block(self.combine(embeds, prev_hidden), cos, sin, backend, layer)
        return self.shared_head.norm(h)

    def cache_rows(
        self, embeds: Tensor, prev_hidden: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """What ``forward`` stores in the MTP layer's cache for these tokens, computed alone."""
        return self.block.cache_rows(self.combine(embeds, prev_hidden), cos, sin)
