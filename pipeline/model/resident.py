"""All-resident KV storage and the attention backend over it (what serving uses when HiSparse is off).

Storage is addressed by **location**, chosen by the caller::

    kv[layer, loc]       = [latent (C) | rope key (R)]      one row per token per layer
    index_k[layer, loc]  = indexer key (Di)
    req_to_token[r, pos] = loc of request row r's token at position pos

``layer`` runs over the target layers and then the MTP layers (``num_cache_layers``). The MTP layer has
its own rows: its row for position p lives at the same location as the target's, in its own layer slice.

Per forward the caller hands the backend a :class:`ForwardLayout` (request row, position and write
location of each token of the flat batch). ``begin`` records ``req_to_token[req_rows, positions] =
write_locs`` before the first layer, so a token can see the batch's own earlier tokens.
"""

from __future__ import annotations

from typing import Literal

import attrs
import numpy as np
import torch
from torch import Tensor

from kernels import hisparse_attend_numba
from kernels.indexer_topk import MATMUL_MIN_QUERIES, indexer_topk
from kernels.kv_fp8 import KVCacheFormat, store_keys, store_rows
from kernels.sparse_mla import sparse_mla
from pipeline.model.attention_api import AttentionInputs
from pipeline.model.config import ModelConfig


@attrs.frozen
class ForwardLayout:
    """Where each token of one forward belongs."""

    req_rows: Tensor  # [T] int64 request row in req_to_token
    positions: Tensor  # [T] int64 position within its request
    write_locs: Tensor  # [T] int64 location its KV rows are written to

    def __attrs_post_init__(self) -> None:
        n = self.req_rows.shape[0]
        if self.positions.shape != (n,) or self.write_locs.shape != (n,):
            raise ValueError("req_rows, positions and write_locs must all be [T]")


@attrs.define(eq=False)
class ResidentKV:
    """Per-layer pools addressed by location, and the request-to-location table."""

    kv: Tensor  # [num_cache_layers, rows, C + R] (an FP8 cache: uint8 rows, ``kernels.kv_fp8``)
    index_k: Tensor  # [num_cache_layers, rows, Di]
    req_to_token: Tensor  # [N, max_ctx] int64 location, -1 = none
    format: KVCacheFormat | None = None  # how rows and keys are stored (None: unquantized)

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        num_rows: int,
        num_requests: int,
        max_ctx: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> ResidentKV:
        layers = cfg.num_cache_layers
        return cls(
            kv=torch.zeros(layers, num_rows, cfg.kv_row_dim, dtype=dtype, device=device),
            index_k=torch.zeros(layers, num_rows, cfg.index_head_dim, dtype=dtype, device=device),
            req_to_token=torch.full((num_requests, max_ctx), -1, dtype=torch.int64, device=device),
        )

    @property
    def num_rows(self) -> int:
        return self.kv.shape[1]


@attrs.define(eq=False)
class ResidentBackend:
    """:class:`~pipeline.model.attention_api.AttentionBackend` over a :class:`ResidentKV`.

    Uses the torch references of ``kernels/`` for the indexer top-k (stable: ties to the lower
    position) and for sparse MLA. A layer with ``reuse_topk`` (GLM-5 "shared") runs no indexer and
    attends over the positions of the last full layer of the same forward.
    """

    store: ResidentKV
    layout: ForwardLayout | None = None
    last_topk: Tensor | None = None  # [T, K] int32 the last full layer's positions, this forward
    # False where ``store.req_to_token`` is another owner's table that already holds the layout's
    # locations (a draft pool reading the target's token table): ``begin`` then leaves it alone
    records_layout: bool = True
    # the numpy views of the pools when ``kernels.hisparse_attend_numba`` serves this forward's
    # layers, False when it cannot, None before the first layer decides
    _compiled: tuple[np.ndarray, np.ndarray] | Literal[False] | None = attrs.field(default=None, init=False)

    def begin(self, layout: ForwardLayout) -> None:
        """Set the layout for the next forward and record its locations in ``req_to_token``."""
        if self.records_layout:
            self.store.req_to_token[layout.req_rows, layout.positions] = layout.write_locs
        self.layout = layout
        self.last_topk = None
        self._compiled = None

    def attend(self, inputs: AttentionInputs) -> Tensor:
        layout = self.layout
        if layout is None:
            raise RuntimeError("ResidentBackend.attend called before begin(layout)")
        if inputs.kv_rows.shape[0] != layout.req_rows.shape[0]:
            raise ValueError("the forward's token count does not match the layout")
        compiled = self._compiled if not inputs.reuse_topk and self._compiled_fits(inputs, layout) else None
        if isinstance(compiled, tuple):
            kv_all, keys_all = compiled
            index_q, index_w, index_k = inputs.indexer_inputs()
            out, self.last_topk = hisparse_attend_numba.attend_resident(
                kv_all, keys_all, inputs.layer, layout.write_locs, inputs.kv_rows, index_k,
                index_q, index_w, self.store.req_to_token, layout.req_rows, layout.positions + 1,
                inputs.index_scale, inputs.top_k, inputs.q_latent, inputs.q_rope, inputs.attn_scale,
            )
            return out
        self.store_rows(inputs.layer, inputs.kv_rows, inputs.index_k)
        slots = self.select_slots(inputs, self.store.index_k[inputs.layer])  # [T, K]
        return self.attend_slots(inputs, self.store.kv[inputs.layer], slots)

    def _compiled_fits(self, inputs: AttentionInputs, layout: ForwardLayout) -> bool:
        """The layer goes to ``kernels.hisparse_attend_numba.attend_resident`` (the writes, the
        indexer's compiled loop, the locations and sparse MLA's compiled loop in one call, the same
        results as the steps of ``attend``): this class itself (the host-row variants move rows
        between memories), CPU pools and tables, shapes both loops take, and at most
        ``MATMUL_MIN_QUERIES`` queries per request (decode, verify, a draft step; a prefill's
        indexer runs on matmuls). Decided at the forward's first layer."""
        if self._compiled is None:
            store = self.store
            ok = (
                type(self) is ResidentBackend
                and not torch.is_grad_enabled()  # (the loops record no gradient)
                and inputs.index_q is not None
                and store.req_to_token.device.type == "cpu"
                and store.req_to_token.dtype == torch.int64
                and hisparse_attend_numba.fits(
                    inputs.q_latent, store.kv, store.index_k, inputs.index_q, store.kv, inputs.top_k
                )
            )
            rows = layout.req_rows
            if ok and rows.numel() > MATMUL_MIN_QUERIES:
                ok = int(torch.bincount(rows).max()) <= MATMUL_MIN_QUERIES
            self._compiled = (store.kv.numpy(), store.index_k.numpy()) if ok else False
        return self._compiled is not False

    def attend_slots(self, inputs: AttentionInputs, kv: Tensor, slots: Tensor) -> Tensor:
        """Sparse MLA of the forward's queries over the rows of ``kv`` (one layer's) that ``slots`` names."""
        return sparse_mla(inputs.q_latent, inputs.q_rope, kv, slots, inputs.attn_scale, check=False)

    def store_rows(self, layer: int, kv_rows: Tensor, index_k: Tensor | None) -> None:
        """Write the forward's rows (``RowStore``), as ``attend`` does before it selects. The rows
        go to wherever the store keeps them (the host, for a draft pool's rows or keys on the host)."""
        layout = self.layout
        if layout is None:
            raise RuntimeError("ResidentBackend.store_rows called before begin(layout)")
        store = self.store
        store_rows(store.format, store.kv[layer], layout.write_locs, kv_rows)
        if index_k is not None:
            store_keys(store.format, store.index_k[layer], layout.write_locs, index_k)

    def select_slots(self, inputs: AttentionInputs, keys: Tensor) -> Tensor:
        """Indexer top-k positions of every token, resolved to locations (-1 = none)."""
        layout = self.layout
        assert layout is not None
        if inputs.reuse_topk:
            if self.last_topk is None:
                raise RuntimeError(f"layer {inputs.layer} reuses a top-k, but no full layer ran before it")
            return positions_to_slots(self.last_topk, self.store.req_to_token, layout.req_rows)
        positions = self.indexer_positions(inputs, keys)
        self.last_topk = positions
        return positions_to_slots(positions, self.store.req_to_token, layout.req_rows)

    def indexer_positions(self, inputs: AttentionInputs, keys: Tensor) -> Tensor:
        """The indexer's top-k positions of every token of the layout: ``[T, K]`` int32, -1 padded."""
        layout = self.layout
        assert layout is not None
        index_q, index_w = inputs.index_q, inputs.index_w
        if index_q is None or index_w is None:
            raise ValueError(f"layer {inputs.layer} has no indexer queries (reuse_topk={inputs.reuse_topk})")
        return indexer_topk(
            index_q,
            index_w,
            keys,
            self.store.req_to_token,
            layout.req_rows,
            layout.positions + 1,
            inputs.top_k,
            inputs.index_scale,
            check=False,
        )


def positions_to_slots(positions: Tensor, req_to_token: Tensor, req_rows: Tensor) -> Tensor:
    """``positions [T, K]`` int32 (-1 = none) -> locations ``[T, K]`` int64 (-1 = none)."""
    pos = positions.long()
    locs = req_to_token[req_rows[:, None], pos.clamp(min=0)]
    return torch.where(pos >= 0, locs, torch.full_like(locs, -1))
