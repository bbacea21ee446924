"""The contract between the model and an attention backend (one layer, one forward).

The model never sees KV storage. For each layer it computes the queries, the new tokens' cache rows
and indexer keys, and hands them to the backend as :class:`AttentionInputs`; the backend returns the
attention output in latent space and the model applies W_UV and ``o_proj``.

The flat batch: ``T`` tokens from any number of requests, in any order. The backend already knows,
because the caller prepared it for this forward, which request each token belongs to, its position,
and where its rows are written. Prefill (extend), decode and multi-token verify are all this one
call; a token at position ``p`` sees positions ``0..p`` of its request (causal, its own row included).

What the backend must do, per layer:

1. write ``kv_rows[t]`` and ``index_k[t]`` at token t's location;
2. score every visible position s of token t's request with the indexer,
   ``sum_h relu(index_q[t, h] . k_index[s] * index_scale) * index_w[t, h]``, and keep the ``top_k``
   best: score descending, ties to the lower position (the top-k contract, docs/invariants.md); on a
   layer with ``reuse_topk`` (a GLM-5 "shared" layer, which has no indexer) reuse instead the
   positions the previous layer of this forward selected, which is always a full layer's selection
   or itself reused from one;
3. resolve those positions to cache rows and run absorbed MLA over them:
   ``softmax((q_latent . row[:C] + q_rope . row[C:]) * attn_scale) @ row[:C]``.
"""

from __future__ import annotations

from typing import Protocol

import attrs
from torch import Tensor


@attrs.frozen
class AttentionInputs:
    """What the model hands the backend for one layer, all tokens of the flat batch."""

    layer: int  # 0..num_hidden_layers-1 for the target; num_hidden_layers (+ depth) for the MTP layer
    q_latent: Tensor  # [T, H, kv_lora_rank] absorbed nope query (q_nope @ W_UK)
    q_rope: Tensor  # [T, H, qk_rope_head_dim] rotated
    kv_rows: Tensor  # [T, kv_lora_rank + qk_rope_head_dim] the new tokens' cache rows
    # the three indexer tensors are None exactly when reuse_topk is set
    index_q: Tensor | None  # [T, index_n_heads, index_head_dim] rotated
    index_w: Tensor | None  # [T, index_n_heads] per-head weights (weights_proj(x) * n_heads**-0.5)
    index_k: Tensor | None  # [T, index_head_dim] the new tokens' indexer keys (normed, rotated)
    attn_scale: float  # MLA softmax scale
    index_scale: float  # indexer softmax_scale (applied inside the relu)
    top_k: int  # index_topk
    reuse_topk: bool = False  # a shared layer: no indexer pass, reuse the previous layer's top-k

    def indexer_inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(index_q, index_w, index_k)`` of a layer that runs its indexer (not ``reuse_topk``)."""
        if self.index_q is None or self.index_w is None or self.index_k is None:
            raise ValueError(f"layer {self.layer} has no indexer inputs (reuse_topk={self.reuse_topk})")
        return self.index_q, self.index_w, self.index_k


class AttentionBackend(Protocol):
    """Owns the KV storage and the batch layout of the current forward."""

    def attend(self, inputs: AttentionInputs) -> Tensor:
        """Store the new rows, select the top-k positions, attend. Returns ``[T, H, kv_lora_rank]``."""
        ...


class RowStore(AttentionBackend, Protocol):
    """A backend that also stores tokens' rows without attending (the MTP layer's backends): for
    the tokens of a forward whose outputs nobody reads, only their cache rows matter."""

    def store_rows(self, layer: int, kv_rows: Tensor, index_k: Tensor | None) -> None:
        """Write ``kv_rows [T, C + R]`` and ``index_k [T, Di]`` at the forward's tokens' locations."""
        ...
