"""Batched training forward ``[B, T]`` over the inference model's own modules.

Training reuses every parameter of :class:`~pipeline.model.model.DeepseekV32` (the projections,
norms, MLPs, head and MTP layer), so a trained model saves and reloads with no conversion.
Attention (``training_attention.py``) runs in one of DeepSeek-V3.2's two training modes: ``DENSE``
(warm-up; the indexer learns to imitate dense attention) or ``SPARSE`` (each query sees only its
indexer top-k keys); ``SPARSE_STABLE`` is the sparse mode with the serving tie-break, for evaluation.

The MTP layer is trained by next-next-token prediction on the target's final-normed hidden states (not
detached, as in DeepSeek-V3). With ``mtp_steps > 1`` it is also trained the way chain drafting uses
it: pass j feeds the MTP layer its own previous output instead of the target's hidden state, and
attends over exactly the keys a chain step j sees at serving time (slots ``<= t-j+1`` written by the
draft extend = pass 1, slot ``t-j+i`` by pass i)::

    query (pass j, slot t) sees key (pass i, slot s)  iff  s <= t  and  i == max(1, j - (t - s))
"""

from __future__ import annotations

from typing import cast

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.model.decoder import DecoderLayer, MtpLayer
from pipeline.model.model import DeepseekV32
from pipeline.model.moe import MoE
from pipeline.model.training_attention import DENSE, SPARSE, SPARSE_STABLE, KeySet, LayerStats, attention

__all__ = ["DENSE", "SPARSE", "SPARSE_STABLE", "TrainOutput", "mtp_chain", "mtp_hidden", "target_hidden",
           "train_forward"]


@attrs.frozen
class TrainOutput:
    loss: Tensor  # scalar: lm + mtp_weight * sum(mtp_losses) + kl_weight * indexer KL
    lm_loss: Tensor  # scalar, nats per token
    mtp_losses: tuple[Tensor, ...]  # per chain step (step 1 first); empty without an MTP layer
    kl_loss: Tensor  # scalar, summed over attention calls, mean over queries
    expert_counts: dict[MoE, Tensor]  # per MoE module: [E] tokens routed to each expert (all passes)

    @property
    def mtp_loss(self) -> Tensor:
        return self.mtp_losses[0] if self.mtp_losses else torch.zeros(())


def _mlp(layer: DecoderLayer, x: Tensor, stats: LayerStats) -> Tensor:
    mlp = layer.mlp
    if not isinstance(mlp, MoE):
        return mlp(x)
    flat = x.reshape(-1, x.shape[-1])
    ids, weights = mlp.gate(flat)
    count = torch.bincount(ids.reshape(-1), minlength=mlp.gate.weight.shape[0]).detach()
    stats.counts[mlp] = stats.counts[mlp] + count if mlp in stats.counts else count
    out = mlp.experts(flat, ids, weights).view_as(x)
    if mlp.shared_experts is not None:
        out = out + mlp.shared_experts(x)
    return out


def _layer(layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, allowed: Tensor, mode: str,
           stats: LayerStats, earlier: list[KeySet] | None = None) -> tuple[Tensor, KeySet]:
    attn_out, own = attention(
        layer.self_attn, layer.input_layernorm(x), cos, sin, allowed, mode, stats, earlier
    )
    x = x + attn_out
    return x + _mlp(layer, layer.post_attention_layernorm(x), stats), own


def _causal(t: int, device: torch.device) -> Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()[None]  # [1, T, S]


def target_hidden(model: DeepseekV32, ids: Tensor, mode: str, stats: LayerStats | None = None) -> Tensor:
    """``ids [B, T]`` -> final-normed hidden ``[B, T, D]`` (positions 0..T-1)."""
    stats = stats if stats is not None else LayerStats()
    t = ids.shape[1]
    x = model.model.embed_tokens(ids)
    cos, sin = model.rope(torch.arange(t, device=ids.device), x.dtype)  # [T, R]
    causal = _causal(t, ids.device)
    for layer in model.model.layers:
        x, _ = _layer(
            cast(DecoderLayer, layer), x, cos, sin, causal, mode, stats
        )  # (ModuleList items: Module)
    return model.model.norm(x)


def _chain_allowed(slots: int, step: int, device: torch.device) -> Tensor:
    """``[1, S, step * S]``: which (pass, slot) keys a pass-``step`` query at each slot sees (pass-major)."""
    t = torch.arange(slots, device=device)[:, None, None]
    i = torch.arange(1, step + 1, device=device)[None, :, None]
    s = torch.arange(slots, device=device)[None, None, :]
    allowed = (s <= t) & (i == (step - (t - s)).clamp(min=1))
    return allowed.reshape(1, slots, step * slots)


def mtp_chain(
    model: DeepseekV32,
    ids: Tensor,
    hidden: Tensor,
    mode: str,
    steps: int = 1,
    stats: LayerStats | None = None,
) -> list[Tensor]:
    """Chain passes of MTP depth 0 over a window: pass j's slot t reads token ``ids[t + 1]`` and predicts
    ``ids[t + 2]``; pass 1 pairs it with ``hidden[:, t]``, pass j > 1 with pass j-1's output at slot t-1.
    Returns each pass's normed output ``[B, T-1, D]`` (pass j's slots below j-1 are padding)."""
    stats = stats if stats is not None else LayerStats()
    mtp = cast(MtpLayer, model.mtp[0])  # (an nn.ModuleList's items are typed as Module)
    slots = ids.shape[1] - 1
    embeds = model.model.embed_tokens(ids[:, 1:])
    cos, sin = model.rope(torch.arange(slots, device=ids.device), embeds.dtype)
    prev = hidden[:, :slots]
    keys: list[KeySet] = []
    outs: list[Tensor] = []
    for step in range(1, steps + 1):
        allowed = _chain_allowed(slots, step, ids.device)
        x, own = _layer(mtp.block, mtp.combine(embeds, prev), cos, sin, allowed, mode, stats, keys)
        out = mtp.shared_head.norm(x)
        keys.append(own)
        outs.append(out)
        prev = F.pad(out[:, :-1], (0, 0, 1, 0))  # slot t reads slot t-1's output
    return outs


def mtp_hidden(
    model: DeepseekV32, ids: Tensor, hidden: Tensor, mode: str, stats: LayerStats | None = None
) -> Tensor:
    """MTP depth 0 over a window (chain step 1 only); returns ``[B, T-1, D]``."""
    return mtp_chain(model, ids, hidden, mode, 1, stats)[0]


def train_forward(
    model: DeepseekV32,
    ids: Tensor,
    *,
    mode: str,
    mtp_weight: float = 0.3,
    mtp_steps: int = 1,
    kl_weight: float = 1.0,
) -> TrainOutput:
    """Losses for a batch of token windows ``ids [B, T]`` (each window starts at position 0)."""
    stats = LayerStats()
    hidden = target_hidden(model, ids, mode, stats)  # [B, T, D]
    logits = model.logits(hidden[:, :-1])
    lm = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    mtp: list[Tensor] = []
    if len(model.mtp) and ids.shape[1] > mtp_steps + 1:
        for step, h in enumerate(mtp_chain(model, ids, hidden, mode, mtp_steps, stats), start=1):
            mtp_logits = model.logits(h[:, step - 1 : -1])  # valid slots t >= step-1 predict ids[t + 2]
            mtp.append(F.cross_entropy(mtp_logits.flatten(0, 1).float(), ids[:, step + 1 :].flatten()))
    kl = torch.stack(stats.kl).sum()
    loss = lm + mtp_weight * sum(mtp, torch.zeros((), device=ids.device)) + kl_weight * kl
    return TrainOutput(
        loss=loss,
        lm_loss=lm.detach(),
        mtp_losses=tuple(m.detach() for m in mtp),
        kl_loss=kl.detach(),
        expert_counts=stats.counts,
    )
