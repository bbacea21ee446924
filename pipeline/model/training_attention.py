"""MLA + indexer attention for training: full windows ``[B, T]``, dense or top-k sparse.

A query may see keys from more than one pass over the window (the chained MTP passes, see
``training.py``), so keys come as a :class:`KeySet` concatenated along the key axis and visibility as
an ``allowed [1 or B, T, S']`` mask; for an ordinary layer the key set is the layer's own tokens and
``allowed`` is the causal mask.

* dense: every allowed key; the indexer's KL target is the attention distribution over them;
* sparse: the indexer's top-k allowed keys only (chosen without gradient over all allowed keys); the
  KL is taken over the chosen set, the indexer's scores recomputed with gradient there.

The indexer reads detached inputs, so its only gradient is its KL; the KL target (the main attention
probabilities summed over heads, renormalised) is detached too.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.indexer_topk import topk_positions
from pipeline.model.attention import IndexerProjection, MlaAttention, MlaProjection
from pipeline.model.layers import wide_dtype

# attention modes: dense; indexer top-k (torch.topk); indexer top-k with the serving tie-break
DENSE, SPARSE, SPARSE_STABLE = "dense", "sparse", "sparse-stable"

# With at most this many keys the sparse mode runs as masked dense attention (faster for short
# windows); beyond, attention gathers each query's top-k rows (linear in the key count).
_GATHER_MIN_KEYS = 512


@attrs.frozen
class KeySet:
    """What a query can attend to and score: per key, its cache row parts and indexer key."""

    latent: Tensor  # [B, S, C]
    k_rope: Tensor  # [B, S, R]
    index_k: Tensor  # [B, S, Di]
    pos: Tensor  # [S] int64 sequence position of each key (the stable tie-break orders by it)

    @staticmethod
    def concat(sets: list[KeySet]) -> KeySet:
        if len(sets) == 1:
            return sets[0]
        dims = {"latent": 1, "k_rope": 1, "index_k": 1, "pos": 0}
        return KeySet(**{f: torch.cat([getattr(s, f) for s in sets], dim=d) for f, d in dims.items()})


@attrs.define
class LayerStats:
    """Side results collected while running the layers of one training forward."""

    kl: list[Tensor] = attrs.Factory(list)  # per attention call: scalar indexer KL
    counts: dict = attrs.Factory(dict)  # MoE module -> [E] tokens routed to each expert


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


def attention(
    attn: MlaAttention,
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    allowed: Tensor,
    mode: str,
    stats: LayerStats,
    earlier: list[KeySet] | None = None,
) -> tuple[Tensor, KeySet]:
    """``x [B, T, D]`` (normed) -> (``[B, T, D]``, this call's own keys). Keys: ``earlier`` + own,
    in order."""
    if attn.indexer is None:
        raise ValueError("training attention needs a layer with its own indexer")
    p = attn.project(x, cos, sin)
    idx = attn.indexer.project(x.detach(), p.q_resid.detach(), cos, sin)
    own = KeySet(
        latent=p.latent, k_rope=p.k_rope, index_k=idx.k, pos=torch.arange(x.shape[1], device=x.device)
    )
    keys = KeySet.concat([*(earlier or []), own])
    allowed = allowed.expand(x.shape[0], -1, -1)
    if mode == DENSE:
        return _masked(attn, p, idx, keys, allowed, stats), own
    pos, valid = _select(idx, keys, allowed, attn.cfg.index_topk, mode == SPARSE_STABLE)
    if keys.latent.shape[1] <= _GATHER_MIN_KEYS:
        hits = torch.zeros(allowed.shape, dtype=torch.int32, device=x.device)
        mask = hits.scatter_add_(-1, pos, valid.to(torch.int32)) > 0  # invalid entries add nothing
        return _masked(attn, p, idx, keys, mask, stats), own
    return _gathered(attn, p, idx, keys, pos, valid, stats), own


@torch.no_grad()
def _select(
    idx: IndexerProjection, keys: KeySet, allowed: Tensor, top_k: int, stable: bool
) -> tuple[Tensor, Tensor]:
    """Top-k allowed keys per query: indices ``[B, T, K]`` int64 and validity, K = min(top_k, S).

    ``stable`` orders ties by key position (each query sees at most one key per position), exactly the
    serving rule; otherwise ``torch.topk`` picks among ties.
    """
    wide = wide_dtype(idx.q.dtype)
    q = idx.q.to(wide).transpose(1, 2)  # [B, Hi, T, Di]
    k = keys.index_k.to(wide).transpose(1, 2)[:, None]  # [B, 1, Di, S]
    w = idx.w.to(wide)
    scale = idx.q.shape[-1] ** -0.5
    scores = torch.zeros(q.shape[0], q.shape[2], k.shape[-1], dtype=wide, device=q.device)
    for h in range(q.shape[1]):  # one head at a time: no [B, Hi, T, S] temporary
        scores.addcmul_(torch.matmul(q[:, h : h + 1], k)[:, 0].mul_(scale).relu_(), w[:, :, h, None])
    scores.masked_fill_(~allowed, float("-inf"))
    count = min(top_k, scores.shape[-1])
    if stable:
        by_pos = torch.sort(keys.pos, stable=True).indices  # [S] key indices in position order
        picked = topk_positions(scores[..., by_pos], count).long()
        return by_pos[picked.clamp(min=0)], picked >= 0
    top = scores.topk(count, dim=-1)
    return top.indices, top.values > float("-inf")


def _masked(
    attn: MlaAttention,
    p: MlaProjection,
    idx: IndexerProjection,
    keys: KeySet,
    mask: Tensor,
    stats: LayerStats,
) -> Tensor:
    """Expanded-form attention where ``mask [B, T, S]`` allows; ``[B, H, T, S]`` logits."""
    cfg = attn.cfg
    scores = index_scores(idx.q, idx.w, keys.index_k, cfg.index_scale)  # [B, T, S]
    w_uk, w_uv = attn.up_weights()
    k_nope = torch.einsum("bsc,hnc->bhsn", keys.latent, w_uk)  # [B, H, S, nope]
    value = torch.einsum("bsc,hvc->bhsv", keys.latent, w_uv)  # [B, H, S, v]
    logits = torch.einsum("bthn,bhsn->bhts", p.q_nope, k_nope)
    logits = logits + torch.einsum("bthr,bsr->bhts", p.q_rope, keys.k_rope)
    logits = (logits * cfg.attn_scale).masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(logits.to(wide_dtype(logits.dtype)), dim=-1).to(logits.dtype)  # [B, H, T, S]
    out = torch.einsum("bhts,bhsv->bthv", probs, value).flatten(-2)
    target = probs.detach().sum(1)
    stats.kl.append(indexer_kl(scores, target / target.sum(-1, keepdim=True), mask))
    return attn.o_proj(out)


def _gathered(
    attn: MlaAttention,
    p: MlaProjection,
    idx: IndexerProjection,
    keys: KeySet,
    pos: Tensor,
    valid: Tensor,
    stats: LayerStats,
) -> Tensor:
    """Absorbed-form attention over each query's gathered top-k rows; ``[B, T, H, K]`` logits."""
    cfg = attn.cfg
    rows = torch.arange(pos.shape[0], device=pos.device)[:, None, None]
    wide = wide_dtype(idx.q.dtype)
    k_sel = keys.index_k[rows, pos].to(wide)  # [B, T, K, Di]
    dots = torch.einsum("bthd,btkd->bthk", idx.q.to(wide), k_sel) * cfg.index_scale
    scores = torch.einsum("bthk,bth->btk", F.relu(dots), idx.w.to(wide))  # [B, T, K]
    w_uk, w_uv = attn.up_weights()
    q_latent = torch.einsum("bthn,hnc->bthc", p.q_nope, w_uk)
    lat = keys.latent[rows, pos]  # [B, T, K, C]
    logits = torch.einsum("bthc,btkc->bthk", q_latent, lat)
    logits = logits + torch.einsum("bthr,btkr->bthk", p.q_rope, keys.k_rope[rows, pos])
    logits = (logits * cfg.attn_scale).masked_fill(~valid[:, :, None], float("-inf"))
    probs = torch.softmax(logits.to(wide_dtype(logits.dtype)), dim=-1).to(logits.dtype)  # [B, T, H, K]
    out = torch.einsum("bthk,btkc->bthc", probs, lat)
    out = torch.einsum("bthc,hvc->bthv", out, w_uv).flatten(-2)
    target = probs.detach().sum(2)
    stats.kl.append(indexer_kl(scores, target / target.sum(-1, keepdim=True), valid))
    return attn.o_proj(out)
