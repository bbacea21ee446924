"""Per-layer transfer counters of HiSparse: hits, misses, bytes moved each way."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from kernels.swap_in import SwapInResult


@attrs.define(eq=False)
class LayerCounters:
    """Running totals since the engine started, one entry per layer."""

    num_layers: int
    hits: list[int] = attrs.field(init=False)  # top-k entries resolved without a copy
    misses: list[int] = attrs.field(init=False)  # rows loaded host -> device
    unrecoverable: list[int] = attrs.field(init=False)  # valid positions with no copy anywhere (a bug)
    h2d_bytes: list[int] = attrs.field(init=False)
    d2h_bytes: list[int] = attrs.field(init=False)  # staging copies and backups
    # a prefill chunk's earlier positions found on the device
    prefill_hits: list[int] = attrs.field(init=False)
    prefill_loads: list[int] = attrs.field(init=False)  # rows a prefill loaded host -> device
    prefill_h2d_bytes: list[int] = attrs.field(init=False)
    last_unrecoverable: int = 0  # unrecoverable entries of the latest swap-in call

    def __attrs_post_init__(self) -> None:
        self.hits = [0] * self.num_layers
        self.misses = [0] * self.num_layers
        self.unrecoverable = [0] * self.num_layers
        self.h2d_bytes = [0] * self.num_layers
        self.d2h_bytes = [0] * self.num_layers
        self.prefill_hits = [0] * self.num_layers
        self.prefill_loads = [0] * self.num_layers
        self.prefill_h2d_bytes = [0] * self.num_layers

    def add_swap_in(self, layer: int, result: SwapInResult) -> None:
        totals: Sequence[int] | None = result.totals
        if totals is None:  # one device->host read of four scalars
            sums = [
                result.hits.sum(),
                result.misses.sum(),
                result.unrecoverable.sum(),
                result.bytes_copied.sum(),
            ]
            totals = torch.stack(sums).tolist()
        self.hits[layer] += int(totals[0])
        self.misses[layer] += int(totals[1])
        self.unrecoverable[layer] += int(totals[2])
        self.h2d_bytes[layer] += int(totals[3])
        self.last_unrecoverable = int(totals[2])

    def add_prefill_loads(self, layer: int, hits: int, loads: int, h2d_bytes: int) -> None:
        """Rows a prefill brought to the device outside ``kernels.swap_in``: a chunk's grouped reads of
        earlier positions, a prefix-cache hit's identity columns. Counted apart from the decode and
        verify swap-in figures (which ``hispec replay`` reproduces)."""
        self.prefill_hits[layer] += hits
        self.prefill_loads[layer] += loads
        self.prefill_h2d_bytes[layer] += h2d_bytes

    def add_backup(self, num_bytes_per_layer: int) -> None:
        """A device->host copy of the same tokens in every layer (staging and backups move all layers)."""
        for layer in range(self.num_layers):
            self.d2h_bytes[layer] += num_bytes_per_layer

    def hit_rate(self, layer: int) -> float:
        total = self.hits[layer] + self.misses[layer]
        return self.hits[layer] / total if total else 1.0

    def as_dict(self) -> dict[str, object]:
        return {
            "hits": list(self.hits),
            "misses": list(self.misses),
            "unrecoverable": list(self.unrecoverable),
            "h2d_bytes": list(self.h2d_bytes),
            "d2h_bytes": list(self.d2h_bytes),
            "prefill_hits": list(self.prefill_hits),
            "prefill_loads": list(self.prefill_loads),
            "prefill_h2d_bytes": list(self.prefill_h2d_bytes),
            "hit_rate": [round(self.hit_rate(layer), 4) for layer in range(self.num_layers)],
        }
