"""The whole model: embeddings, decoder layers, final norm, head, and the MTP layer(s).

Inference interface (flat batches, one code path for prefill, decode and multi-token verify)::

    hidden = model.forward(input_ids [T], positions [T], backend)        # [T, D], final-normed
    logits = model.logits(hidden)                                        # [T, V]
    out    = model.mtp_forward(next_token_ids [T], positions [T], hidden, backend)   # MtpOutput
    model.mtp_store(next_token_ids [T], positions [T], hidden, backend)            # MTP rows only

``hidden`` serves both the head and the MTP layer (HF's MTP reads the final-normed hidden state).
The backend is prepared by the caller for this forward (which request, position and location each
token has); the model calls ``backend.attend`` once per layer, layer ids ``0..L-1`` for the target and
``L + depth`` for MTP depth ``depth``.

Module and parameter names mirror HF's ``DeepseekV32ForCausalLM`` (``model.layers.3.self_attn...``), so a
state dict maps onto HF checkpoints by name; the MTP layers live under ``mtp.*`` here and under
``model.layers.{L + depth}.*`` in checkpoints (see ``checkpoint.py``).
"""

from __future__ import annotations

from typing import cast

import attrs
import torch
from torch import Tensor, nn

from pipeline.model.attention_api import AttentionBackend, RowStore
from pipeline.model.config import ModelConfig
from pipeline.model.decoder import DecoderLayer, MtpLayer
from pipeline.model.layers import RMSNorm, rope_cos_sin, wide_dtype

# parameters HF keeps in float32 whatever the model dtype; here: in the wide dtype
_WIDE_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")


@attrs.frozen
class MtpOutput:
    hidden: Tensor  # [T, D] normed by shared_head.norm; the next chain step's prev_hidden
    logits: Tensor  # [T, V]


class Backbone(nn.Module):
    """HF's ``model.*``: embeddings, target layers, final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV32(nn.Module):
    """A DeepSeek-V3.2-style causal LM with MTP layers, driven through an :class:`AttentionBackend`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = nn.ModuleList(
            MtpLayer(cfg, cfg.num_hidden_layers + d) for d in range(cfg.num_nextn_predict_layers)
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``positions [...]`` -> ``(cos, sin) [..., R]`` in ``dtype`` (angles always float32, as HF).

        Plain RoPE or YaRN (``ModelConfig.rope``); attention and indexer share these.
        """
        cached = self.__dict__.get("_rope_freqs")  # the config is frozen: computed once
        if cached is None or cached[0].device != positions.device:
            rope = self.cfg.rope
            inv_freq = rope.inv_freq(self.cfg.qk_rope_head_dim).to(positions.device)
            cached = self.__dict__["_rope_freqs"] = (inv_freq, rope.cos_sin_factor())
        return rope_cos_sin(positions, cached[0], dtype, cached[1])

    def forward(self, input_ids: Tensor, positions: Tensor, backend: AttentionBackend) -> Tensor:
        """``input_ids, positions [T] int64`` -> final-normed hidden states ``[T, D]``."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, backend, i)
        return self.model.norm(x)

    def logits(self, hidden: Tensor) -> Tensor:  # [T, D] -> [T, V]
        return self.lm_head(hidden)

    def mtp_forward(
        self,
        next_token_ids: Tensor,
        positions: Tensor,
        prev_hidden: Tensor,
        backend: AttentionBackend,
        depth: int = 0,
    ) -> MtpOutput:
        """One MTP step over a flat batch.

        Row t pairs ``prev_hidden[t]`` (the hidden state that predicted ``next_token_ids[t]``) with the
        embedding of ``next_token_ids[t]`` and predicts the token after it. ``positions[t]`` is the
        position of ``prev_hidden[t]``'s token: the MTP layer's KV for that row lives at that position
        (SGLang's convention; HF shifts MTP positions by +1, which RoPE's relative form makes
        equivalent up to rounding).
        """
        if not 0 <= depth < len(self.mtp):
            raise ValueError(f"model has {len(self.mtp)} MTP layers, asked for depth {depth}")
        embeds = self.model.embed_tokens(next_token_ids)
        cos, sin = self.rope(positions, embeds.dtype)
        layer = self.cfg.num_hidden_layers + depth
        hidden = self.mtp[depth](embeds, prev_hidden.to(embeds.dtype), cos, sin, backend, layer)
        return MtpOutput(hidden=hidden, logits=self.logits(hidden))

    def mtp_store(
        self,
        next_token_ids: Tensor,
        positions: Tensor,
        prev_hidden: Tensor,
        backend: RowStore,
        depth: int = 0,
    ) -> None:
        """The MTP layer's cache rows of ``mtp_forward`` over the same inputs, stored through
        ``backend.store_rows`` and nothing more: no attention, MLP or head. For the tokens of a
        draft extend whose proposals nobody reads (a row depends on its own token alone)."""
        if not 0 <= depth < len(self.mtp):
            raise ValueError(f"model has {len(self.mtp)} MTP layers, asked for depth {depth}")
        embeds = self.model.embed_tokens(next_token_ids)
        cos, sin = self.rope(positions, embeds.dtype)
        mtp = cast(MtpLayer, self.mtp[depth])  # (an nn.ModuleList's items are typed as Module)
        kv_rows, index_k = mtp.cache_rows(embeds, prev_hidden.to(embeds.dtype), cos, sin)
        backend.store_rows(self.cfg.num_hidden_layers + depth, kv_rows, index_k)

    def to_dtype(self, dtype: torch.dtype) -> DeepseekV32:
        """Cast in place; the router and indexer weights stay in the wide dtype (as HF keeps them in
        float32)."""
        self.to(dtype)
        wide = wide_dtype(dtype)
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if name.endswith(_WIDE_SUFFIXES):
                tensor.data = tensor.data.to(wide)
        return self


def init_weights(model: DeepseekV32, seed: int, std: float = 0.02) -> DeepseekV32:
    """Deterministic random init (normal(0, std) matrices, unit norms, zero biases), as HF initialises."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.zeros_like(p) if name.endswith("bias") else torch.ones_like(p))
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * std)
    return model
