"""Batched training forward ``[B, T]`` over the inference model's own modules.

Training reuses every parameter of :class:`~pipeline.model.model.DeepseekV32` (the projections,
norms, MLPs, head and MTP layer), so a trained model saves and reloads with no conversion. Attention
is computed in the expanded (non-absorbed) form, which is the same function and cheaper for full
sequences: per head, ``key = [W_UK latent | k_rope]`` and ``value = W_UV latent``.

Two attention modes, DeepSeek-V3.2's two training stages at small scale:

* ``mode=DENSE`` (dense warm-up): causal dense attention. The indexer reads detached inputs and is
  trained only by ``KL(p || softmax(index_scores))``, ``p`` the main attention's probabilities summed
  over heads and renormalised (detached).
* ``mode=SPARSE`` (or ``SPARSE_STABLE``, the serving tie-break, for evaluation): each query attends only to its indexer top-k positions (``index_topk``); the KL is
  taken over that selected set, again with detached indexer inputs.

The MTP layer (if any) is trained by next-next-token prediction on the target's final-normed hidden
states (not detached, as in DeepSeek-V3), with its own attention and indexer in the same mode.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.indexer_topk import stable_topk_positions
from pipeline.model.attention import IndexerProjection, MlaAttention, MlaProjection
from pipeline.model.decoder import DecoderLayer
from pipeline.model.layers import wide_dtype
from pipeline.model.model import DeepseekV32
from pipeline.model.moe import MoE

# attention modes: dense causal; indexer top-k (torch.topk); indexer top-k with the serving tie-break
DENSE, SPARSE, SPARSE_STABLE = "dense", "sparse", "sparse-stable"


@attrs.frozen
class TrainOutput:
    loss: Tensor  # scalar: lm + mtp_weight * mtp + kl_weight * indexer KL
    lm_loss: Tensor  # scalar, nats per token
    mtp_loss: Tensor  # scalar (0 without an MTP layer)
    kl_loss: Tensor  # scalar, summed over layers, mean over queries
    expert_counts: list[Tensor]  # per MoE layer (target then MTP): [E] tokens routed to each expert


@attrs.define
class _Aux:
    """Side results collected while running the layers."""

    kl: list[Tensor] = attrs.Factory(list)
    counts: list[Tensor] = attrs.Factory(list)


def index_scores(q: Tensor, w: Tensor, k: Tensor, scale: float) -> Tensor:
    """``q [B, T, Hi, Di]``, ``w [B, T, Hi]``, ``k [B, S, Di]`` -> ``[B, T, S]`` in the wide dtype."""
    wide = wide_dtype(q.dtype)
    dots = torch.einsum("bthd,bsd->bhts", q.to(wide), k.to(wide)) * scale
    return torch.einsum("bhts,bth->bts", F.relu(dots), w.to(wide))


def indexer_kl(scores: Tensor, probs: Tensor, mask: Tensor) -> Tensor:
    """Mean over queries of ``KL(p || softmax(scores))`` restricted to ``mask``; ``probs`` sums to 1 there."""
    logq = torch.log_softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).masked_fill(~mask, 0.0)
    kl = (torch.xlogy(probs, probs) - probs * logq).sum(-1)
    return kl.mean()


# At or below this window length the sparse mode runs as masked dense attention (faster for short
# windows); above it, attention gathers each query's top-k rows (linear in the window length).
_GATHER_MIN_LEN = 512


def _attention(attn: MlaAttention, x: Tensor, cos: Tensor, sin: Tensor, causal: Tensor, mode: str, aux: _Aux):
    """``x [B, T, D]`` (normed) -> ``[B, T, D]``."""
    p = attn.project(x, cos, sin)
    idx = attn.indexer.project(x.detach(), p.q_resid.detach(), cos, sin)
    if mode == DENSE:
        return _masked_attention(attn, p, idx, causal.expand(x.shape[0], -1, -1), aux)
    pos, valid = _select(idx, causal, attn.cfg.index_topk, mode == SPARSE_STABLE)
    if x.shape[1] <= _GATHER_MIN_LEN:
        hits = torch.zeros(valid.shape[:2] + causal.shape[-1:], dtype=torch.int32, device=x.device)
        mask = hits.scatter_add_(-1, pos, valid.to(torch.int32)) > 0  # invalid entries add nothing
        return _masked_attention(attn, p, idx, mask, aux)
    return _gathered_attention(attn, p, idx, pos, valid, aux)


@torch.no_grad()
def _select(idx: IndexerProjection, causal: Tensor, top_k: int, stable: bool) -> tuple[Tensor, Tensor]:
    """Top-k positions ``[B, T, K]`` int64 and their validity (bool), K = min(top_k, T)."""
    wide = wide_dtype(idx.q.dtype)
    q = idx.q.to(wide).transpose(1, 2)  # [B, Hi, T, Di]
    keys = idx.k.to(wide).transpose(1, 2)[:, None]  # [B, 1, Di, S]
    w = idx.w.to(wide)
    scores = torch.zeros(q.shape[0], q.shape[2], keys.shape[-1], dtype=wide, device=q.device)
    for h in range(q.shape[1]):  # one head at a time: no [B, Hi, T, S] temporary
        dots = torch.matmul(q[:, h : h + 1], keys)[:, 0].mul_(idx_scale_of(idx)).relu_()
        scores.addcmul_(dots, w[:, :, h, None])
    scores.masked_fill_(~causal, float("-inf"))
    k = min(top_k, scores.shape[-1])
    if stable:
        pos = stable_topk_positions(scores, k).long()
        return pos.clamp(min=0), pos >= 0
    top = scores.topk(k, dim=-1)
    return top.indices, top.values > float("-inf")


def idx_scale_of(idx: IndexerProjection) -> float:
    return idx.q.shape[-1] ** -0.5


def _masked_attention(attn: MlaAttention, p: MlaProjection, idx: IndexerProjection, mask: Tensor, aux: _Aux):
    """Expanded-form attention where ``mask [B, T, S]`` allows; ``[B, H, T, S]`` logits."""
    cfg = attn.cfg
    scores = index_scores(idx.q, idx.w, idx.k, cfg.index_scale)  # [B, T, S]
    w_uk, w_uv = attn.up_weights()
    k_nope = torch.einsum("bsc,hnc->bhsn", p.latent, w_uk)  # [B, H, S, nope]
    value = torch.einsum("bsc,hvc->bhsv", p.latent, w_uv)  # [B, H, S, v]
    logits = torch.einsum("bthn,bhsn->bhts", p.q_nope, k_nope)
    logits = logits + torch.einsum("bthr,bsr->bhts", p.q_rope, p.k_rope)
    logits = (logits * cfg.attn_scale).masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(logits.to(wide_dtype(logits.dtype)), dim=-1).to(logits.dtype)  # [B, H, T, S]
    out = torch.einsum("bhts,bhsv->bthv", probs, value).flatten(-2)
    target = probs.detach().sum(1)
    aux.kl.append(indexer_kl(scores, target / target.sum(-1, keepdim=True), mask))
    return attn.o_proj(out)


def _gathered_attention(
    attn: MlaAttention, p: MlaProjection, idx: IndexerProjection, pos: Tensor, valid: Tensor, aux: _Aux
):
    """Absorbed-form attention over the gathered top-k rows of each query; ``[B, T, H, K]`` logits.

    The indexer's gradient comes from its scores recomputed at the K chosen positions only.
    """
    cfg = attn.cfg
    rows = torch.arange(pos.shape[0], device=pos.device)[:, None, None]
    wide = wide_dtype(idx.q.dtype)
    k_sel = idx.k[rows, pos].to(wide)  # [B, T, K, Di]
    dots = torch.einsum("bthd,btkd->bthk", idx.q.to(wide), k_sel) * cfg.index_scale
    scores = torch.einsum("bthk,bth->btk", F.relu(dots), idx.w.to(wide))  # [B, T, K]
    w_uk, w_uv = attn.up_weights()
    q_latent = torch.einsum("bthn,hnc->bthc", p.q_nope, w_uk)
    lat = p.latent[rows, pos]  # [B, T, K, C]
    logits = torch.einsum("bthc,btkc->bthk", q_latent, lat)
    logits = logits + torch.einsum("bthr,btkr->bthk", p.q_rope, p.k_rope[rows, pos])
    logits = (logits * cfg.attn_scale).masked_fill(~valid[:, :, None], float("-inf"))
    probs = torch.softmax(logits.to(wide_dtype(logits.dtype)), dim=-1).to(logits.dtype)  # [B, T, H, K]
    out = torch.einsum("bthk,btkc->bthc", probs, lat)
    out = torch.einsum("bthc,hvc->bthv", out, w_uv).flatten(-2)
    target = probs.detach().sum(2)
    aux.kl.append(indexer_kl(scores, target / target.sum(-1, keepdim=True), valid))
    return attn.o_proj(out)


def _mlp(layer: DecoderLayer, x: Tensor, aux: _Aux) -> Tensor:
    mlp = layer.mlp
    if not isinstance(mlp, MoE):
        return mlp(x)
    flat = x.reshape(-1, x.shape[-1])
    ids, weights = mlp.gate(flat)
    aux.counts.append(torch.bincount(ids.reshape(-1), minlength=mlp.gate.weight.shape[0]).detach())
    out = mlp.experts(flat, ids, weights).view_as(x)
    if mlp.shared_experts is not None:
        out = out + mlp.shared_experts(x)
    return out


def _layer(layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, causal: Tensor, mode: str, aux: _Aux):
    x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, causal, mode, aux)
    return x + _mlp(layer, layer.post_attention_layernorm(x), aux)


def target_hidden(model: DeepseekV32, ids: Tensor, mode: str, aux: _Aux | None = None) -> Tensor:
    """``ids [B, T]`` -> final-normed hidden ``[B, T, D]`` (positions 0..T-1)."""
    aux = aux if aux is not None else _Aux()
    t = ids.shape[1]
    x = model.model.embed_tokens(ids)
    cos, sin = model.rope(torch.arange(t, device=ids.device), x.dtype)  # [T, R]
    causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()[None]  # [1, T, S]
    for layer in model.model.layers:
        x = _layer(layer, x, cos, sin, causal, mode, aux)
    return model.model.norm(x)


def mtp_hidden(
    model: DeepseekV32, ids: Tensor, hidden: Tensor, mode: str, aux: _Aux | None = None, depth: int = 0
) -> Tensor:
    """MTP over a sequence: slot t pairs ``hidden[:, t]`` with ``ids[:, t + 1]``; returns ``[B, T-1, D]``."""
    aux = aux if aux is not None else _Aux()
    mtp = model.mtp[depth]
    t = ids.shape[1] - 1
    embeds = model.model.embed_tokens(ids[:, 1:])
    cos, sin = model.rope(torch.arange(t, device=ids.device), embeds.dtype)
    causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()[None]
    x = _layer(mtp.block, mtp.combine(embeds, hidden[:, :t]), cos, sin, causal, mode, aux)
    return mtp.shared_head.norm(x)


def train_forward(
    model: DeepseekV32,
    ids: Tensor,
    *,
    mode: str,
    mtp_weight: float = 0.3,
    kl_weight: float = 1.0,
) -> TrainOutput:
    """Losses for a batch of token windows ``ids [B, T]`` (each window starts at position 0)."""
    aux = _Aux()
    hidden = target_hidden(model, ids, mode, aux)  # [B, T, D]
    logits = model.logits(hidden[:, :-1])
    lm = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    mtp = torch.zeros((), device=ids.device)
    if len(model.mtp) and ids.shape[1] > 2:
        h = mtp_hidden(model, ids, hidden, mode, aux)  # [B, T-1, D]
        mtp_logits = model.logits(h[:, :-1])  # slot t predicts ids[t + 2]
        mtp = F.cross_entropy(mtp_logits.flatten(0, 1).float(), ids[:, 2:].flatten())
    kl = torch.stack(aux.kl).sum()
    loss = lm + mtp_weight * mtp + kl_weight * kl
    return TrainOutput(loss=loss, lm_loss=lm.detach(), mtp_loss=mtp.detach(), kl_loss=kl.detach(),
                       expert_counts=aux.counts)
