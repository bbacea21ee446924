"""Sparse MLA attention in the absorbed form (decode, verify and prefill).

Every cached row of a layer is ``[latent (C) | rope key (R)]``: the normalised KV latent and the
rotated shared rope key of one token. A query head attends over the rows named by ``slots``:

    logit[t, h, i] = (q_latent[t, h] . row[i, :C] + q_rope[t, h] . row[i, C:]) * scale
    out[t, h]      = sum_i softmax_i(logit[t, h, :]) * row[i, :C]

Entries of ``slots`` equal to -1 are masked out. The output stays in latent space; the model applies
the value up-projection (W_UV) and the output projection.
"""

from __future__ import annotations

import torch


def sparse_mla_reference(
    q_latent: torch.Tensor,  # [T, H, C] absorbed query
    q_rope: torch.Tensor,  # [T, H, R] rotated rope query
    kv: torch.Tensor,  # [rows, C + R] cache rows of one layer
    slots: torch.Tensor,  # [T, K] rows to attend, -1 = masked
    scale: float,
) -> torch.Tensor:  # [T, H, C]
    """Plain torch reference; a query with no valid slot yields zeros."""
    c = q_latent.shape[-1]
    valid = slots >= 0  # [T, K]
    rows = kv[slots.clamp(min=0).long()]  # [T, K, C + R]
    logits = torch.einsum("thc,tkc->thk", q_latent, rows[..., :c])
    logits = logits + torch.einsum("thr,tkr->thk", q_rope, rows[..., c:])
    logits = (logits * scale).masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # all-masked rows
    return torch.einsum("thk,tkc->thc", probs, rows[..., :c])
