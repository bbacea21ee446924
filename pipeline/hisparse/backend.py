"""The DSA attention backend over HiSparse memory.

Per layer it stores the new tokens' rows, runs the indexer over each token's visible positions, and
attends over the selected rows:

* **prefill** (dense in device): a position's row is found through ``logical_to_physical``;
* **decode / verify**: the tokens are request-major, ``steps`` per request (1 for decode, D for a
  verify); their top-k sets go through the coordinator's swap-in, which returns device slots,
  loading misses from host. A verify whose steps do not all fit the hot region in one call is
  resolved in rounds: attention runs for the steps resolved so far before the next round may evict
  their columns.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import torch

from kernels.indexer_topk import indexer_topk
from kernels.sparse_mla import sparse_mla
from kernels.swap_in import SwapInResult
from pipeline.hisparse.trace import TopKTrace
from pipeline.model.attention_api import AttentionInputs


class SwapInMemory(Protocol):
    """What the backend reads of the coordinator: the pools, the token table, the map, swap-in."""

    device_kv: torch.Tensor  # [L, physical rows, row_dim]
    index_k: torch.Tensor  # [L, logical rows, index_dim]
    alloc: Any  # HiSparseAllocator (``lookup``: logical location -> physical slot)

    @property
    def req_to_token(self) -> torch.Tensor: ...

    @property
    def req_to_token_device(self) -> torch.Tensor: ...  # the same table, where the kernels run

    def swap_in(
        self, layer: int, top_k_pos: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor
    ) -> SwapInResult: ...


@attrs.define(eq=False)
class HiSparseBackend:
    """``AttentionBackend`` for one forward of the target model over HiSparse memory."""

    coord: SwapInMemory
    req_rows: torch.Tensor  # [T] int64 request row of each token
    positions: torch.Tensor  # [T] int64
    write_locs: torch.Tensor  # [T] int64 logical location (indexer key)
    write_slots: torch.Tensor  # [T] int64 device slot (MLA row)
    steps: int = 0  # 0 = prefill; else tokens per request, request-major
    trace: TopKTrace | None = None
    labels: dict[int, str] | None = None  # request id of each request row, for the trace
    # [T, K] int32 the last full layer's top-k of this forward; a shared layer (``reuse_topk``)
    # swaps these positions into its own buffer instead of running an indexer pass
    last_topk: torch.Tensor | None = None

    def attend(self, inputs: AttentionInputs) -> torch.Tensor:
        layer = inputs.layer
        kv = self.coord.device_kv[layer]  # [rows, C + R]
        keys = self.coord.index_k[layer]  # [logical rows, Di]
        kv[self.write_slots] = inputs.kv_rows.to(kv.dtype)
        if inputs.reuse_topk:
            if self.last_topk is None:
                raise RuntimeError(f"layer {layer} reuses a top-k, but no full layer ran before it")
            return self._attend_selected(inputs, layer, kv, self.last_topk)
        keys[self.write_locs] = inputs.index_k.to(keys.dtype)
        top = indexer_topk(
            inputs.index_q,
            inputs.index_w,
            keys,
            self.coord.req_to_token_device,
            self.req_rows,
            self.positions + 1,
            inputs.top_k,
            inputs.index_scale,
            check=False,
        )  # [T, K] int32 positions
        self.last_topk = top
        return self._attend_selected(inputs, layer, kv, top)

    def _attend_selected(
        self, inputs: AttentionInputs, layer: int, kv: torch.Tensor, top: torch.Tensor
    ) -> torch.Tensor:
        if self.trace is not None:
            phase = "prefill" if self.steps == 0 else "decode" if self.steps == 1 else "verify"
            self.trace.record(layer, phase, self._trace_labels(), self.positions, top)
        if self.steps == 0:
            locs = self.coord.req_to_token_device[self.req_rows[:, None], top.long().clamp(min=0)]
            slots = torch.where(top >= 0, self.coord.alloc.lookup(locs.cpu()).to(locs.device), -1)
            return sparse_mla(inputs.q_latent, inputs.q_rope, kv, slots, inputs.attn_scale, check=False)
        return self._attend_swapped(inputs, layer, kv, top)

    def _attend_swapped(
        self, inputs: AttentionInputs, layer: int, kv: torch.Tensor, top: torch.Tensor
    ) -> torch.Tensor:
        steps = self.steps
        batch = top.shape[0] // steps
        rows = self.req_rows.reshape(batch, steps)[:, 0].contiguous()
        top3 = top.reshape(batch, steps, -1)  # [B, S, K]
        seq_lens = (self.positions + 1).reshape(batch, steps)  # [B, S]
        result = self.coord.swap_in(layer, top3, seq_lens, rows)
        if bool((result.steps_done == steps).all()):  # the common case: one call resolved every step
            slots = result.slots.reshape(batch * steps, -1)
            return sparse_mla(inputs.q_latent, inputs.q_rope, kv, slots, inputs.attn_scale, check=False)
        # Resolve the rest in rounds; attention for the steps resolved so far runs before the next
        # round may evict their columns.
        out = torch.zeros_like(inputs.q_latent)  # [T, H, C]
        pending = torch.ones(batch, steps, dtype=torch.bool, device=top.device)
        step_ids = torch.arange(steps, device=top.device)[None, :]
        while True:
            done_now = pending & (step_ids < result.steps_done[:, None])
            idx = torch.nonzero(done_now.reshape(-1)).reshape(-1)  # flat token indices resolved now
            slots = result.slots.reshape(batch * steps, -1)[idx]
            out[idx] = sparse_mla(inputs.q_latent[idx], inputs.q_rope[idx], kv, slots, inputs.attn_scale, check=False)
            pending &= ~done_now
            if not bool(pending.any()):
                return out
            result = self.coord.swap_in(layer, top3, torch.where(pending, seq_lens, 0), rows)

    def _trace_labels(self) -> list[str]:
        labels = self.labels or {}
        return [labels.get(row, str(row)) for row in self.req_rows.tolist()]
