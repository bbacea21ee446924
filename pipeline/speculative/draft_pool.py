"""The MTP layer's own KV pool: ordinary, all resident, addressed by logical location.

With HiSparse the target's rows are tiered, but the draft layer keeps every row in a pool of its
own, untiered (reading the target's tiered pool would need each logical location translated and
its row swapped in). The draft layer's row for position p of a request lives at that position's
logical location.

So the pool has no token table of its own: it reads the target's (its device mirror), which maps
every position a draft forward reads or writes to its logical location. Every position the draft
layer reads was written by an earlier draft forward of the same request (the draft extend over the
prompt comes first) or, for a prefix-cache hit, by the request that left the shared pages.

With ``rows_on_host`` (``hisparse.draft_rows_on_host``) the rows are host memory (pinned on CUDA)
and only the indexer keys stay on the device: a forward writes its rows to the host, selects its
top-k over the device keys as before, and copies the rows it selected to the device, where sparse
MLA reads them as a compact block (the same rows in the same order, so the same output). On CUDA
the copy needs the selected slots on the host: one synchronisation per draft forward.

With ``keys_on_host`` as well (``hisparse.draft_keys_on_host``) the indexer keys are host memory
too and the pool holds no device memory: a forward's indexer scores its queries over the host keys
on the host (the rows of the token table it reads are copied there), and its top-k positions come
back to the device. The same scores over the same keys, so the same selection.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from kernels.indexer_topk import indexer_topk
from kernels.kv_fp8 import KVCacheFormat
from pipeline.memory.host_pool import host_zeros, pins_for, to_device
from pipeline.model.attention_api import AttentionInputs
from pipeline.model.resident import ForwardLayout, ResidentBackend, ResidentKV


@attrs.define(eq=False)
class ShiftedBackend:
    """Hands the MTP layer's inputs (layer ``offset``) to a store that holds it as layer 0."""

    inner: ResidentBackend
    offset: int

    def attend(self, inputs: AttentionInputs) -> torch.Tensor:
        return self.inner.attend(attrs.evolve(inputs, layer=inputs.layer - self.offset))

    def store_rows(self, layer: int, kv_rows: torch.Tensor, index_k: torch.Tensor | None) -> None:
        self.inner.store_rows(layer - self.offset, kv_rows, index_k)


@attrs.define(eq=False)
class HostRowsBackend(ResidentBackend):
    """A :class:`ResidentBackend` whose KV rows are on the host and whose indexer keys and token
    table are on the device: rows are written to the host (``store_rows`` writes where the store
    keeps them), and a forward's selected rows are copied to the device before sparse MLA."""

    def attend_slots(self, inputs: AttentionInputs, kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        rows, local = gather_rows(kv, slots)
        return super().attend_slots(inputs, rows, local)


@attrs.define(eq=False)
class HostKeysBackend(HostRowsBackend):
    """A :class:`HostRowsBackend` whose indexer keys are on the host too: the indexer runs where the
    keys are, over the token-table rows of the forward's requests (copied there, trimmed to the
    longest visible prefix), and its positions come back to the device (where ``select_slots``
    resolves them on the device's table)."""

    def indexer_positions(self, inputs: AttentionInputs, keys: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        assert layout is not None
        if layout.req_rows.numel() == 0:
            return super().indexer_positions(inputs, keys)
        index_q, index_w = inputs.index_q, inputs.index_w
        if index_q is None or index_w is None:
            raise ValueError(f"layer {inputs.layer} has no indexer queries (reuse_topk={inputs.reuse_topk})")
        host, table = keys.device, self.store.req_to_token
        rows, local = torch.unique(layout.req_rows, return_inverse=True)  # the same request groups
        seq_lens = layout.positions + 1
        width = int(seq_lens.max())
        return indexer_topk(
            index_q.to(host),
            index_w.to(host),
            keys,
            table[rows, :width].to(host),
            local.to(host),
            seq_lens.to(host),
            inputs.top_k,
            inputs.index_scale,
            check=False,
        ).to(table.device)


def gather_rows(kv: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of host ``kv`` that ``slots`` ([T, K], -1 = none) names, on ``slots``' device as one
    ``[T * K, row]`` block, and the slots into that block (-1 kept)."""
    flat = slots.reshape(-1).to(kv.device).clamp(min=0).long()
    rows = to_device(kv, flat, slots.device)  # (through a pinned block towards CUDA)
    local = torch.arange(flat.numel(), device=slots.device, dtype=slots.dtype).view(slots.shape)
    return rows, torch.where(slots >= 0, local, torch.full_like(local, -1))


@attrs.define(eq=False)
class DraftPool:
    num_locations: int
    row_dim: int
    index_dim: int
    first_layer: int  # the model's layer index of the MTP layer (num_hidden_layers)
    # the target's token table where the kernels read it ([rows, max_len] logical locations), read
    # afresh at every forward (a restore may rebuild it): the draft layer's row for position p lives
    # at the target's location of p, so the pool keeps no table of its own
    token_table: Callable[[], torch.Tensor]
    dtype: torch.dtype = torch.float32
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    rows_on_host: bool = False  # the KV rows in host memory (HostRowsBackend)
    keys_on_host: bool = False  # the indexer keys too (HostKeysBackend; needs rows_on_host)
    kv_format: KVCacheFormat | None = None  # how rows and keys are stored (None: in ``dtype``)
    store: ResidentKV = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.keys_on_host and not self.rows_on_host:
            raise ValueError("a draft pool with its keys on the host keeps its rows there too")
        self.store = ResidentKV(
            kv=self._zeros(self.row_dim, on_host=self.rows_on_host),
            index_k=self._zeros(self.index_dim, on_host=self.keys_on_host),
            req_to_token=self.token_table(),
            format=self.kv_format,
        )

    def _zeros(self, width: int, *, on_host: bool) -> torch.Tensor:
        if on_host:  # pinned on CUDA, for the copies to and from the device
            return host_zeros((1, self.num_locations, width), self.dtype, pinned=pins_for(self.device))
        return torch.zeros(1, self.num_locations, width, dtype=self.dtype, device=self.device)

    def backend(self, rows: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor) -> ShiftedBackend:
        """The backend of one draft forward; ``locs`` are the target table's locations of
        ``(rows, positions)`` (where the forward's rows are written)."""
        kind = (HostKeysBackend if self.keys_on_host
                else HostRowsBackend if self.rows_on_host else ResidentBackend)
        self.store.req_to_token = self.token_table()
        inner = kind(self.store, records_layout=False)
        inner.begin(ForwardLayout(rows, positions, locs))
        return ShiftedBackend(inner, self.first_layer)
