"""Per-layer transfer counters of HiSparse: hits, misses, bytes moved each way."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from kernels.swap_in import SwapInResult
from pipeline.memory.interface import Transfers


@attrs.define(eq=False)
class LayerCounters:
    """Running totals since the engine started, one entry per layer.

    A swap-in whose counts are on a device (no ``totals`` handed over) is added there, into one
    ``[layers, 4]`` tensor, and read back at the first read of any figure (``settle``): one
    device->host read per step instead of one per layer, and none inside the forward (the decode
    step's own read of its sampled tokens has waited for the device already). Its unrecoverable
    check (``add_swap_in``'s ``on_unrecoverable``) runs then too.

    The per-layer lists are for reading: a figure changes through the ``add_*`` methods, each of which
    counts a change (``_version``), and ``as_dict`` and ``totals`` are built again only after one (the
    engine's statistics snapshot asks for them after every step)."""

    num_layers: int
    # keep swap-in counts on their device until read: None = wherever they are not on the CPU (where
    # a read costs nothing); True / False force it
    defer: bool | None = None
    _hits: list[int] = attrs.field(init=False)  # top-k entries resolved without a copy
    _misses: list[int] = attrs.field(init=False)  # rows loaded host -> device
    _unrecoverable: list[int] = attrs.field(init=False)  # valid positions with no copy anywhere (a bug)
    _h2d_bytes: list[int] = attrs.field(init=False)
    d2h_bytes: list[int] = attrs.field(init=False)  # staging copies and backups
    # a prefill chunk's earlier positions found on the device
    prefill_hits: list[int] = attrs.field(init=False)
    prefill_loads: list[int] = attrs.field(init=False)  # rows a prefill loaded host -> device
    prefill_h2d_bytes: list[int] = attrs.field(init=False)
    # deferred swap-in counts: [layers, 4] int64 (hits, misses, unrecoverable, bytes) on their device
    _pending: torch.Tensor | None = attrs.field(default=None, init=False)
    _dirty: bool = attrs.field(default=False, init=False)  # counts added since the last ``settle``
    # the unrecoverable checks of the deferred calls: (layer, check), run by ``settle`` for a layer
    # whose calls left any
    _checks: list[tuple[int, Callable[[], None]]] = attrs.field(factory=list, init=False)
    _version: int = attrs.field(default=0, init=False)  # changes of any figure so far
    # (version, value) of the last ``as_dict`` and ``totals``
    _figures: tuple[int, dict[str, object]] | None = attrs.field(default=None, init=False)
    _sums: tuple[int, tuple[Transfers, Transfers]] | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        self._hits = [0] * self.num_layers
        self._misses = [0] * self.num_layers
        self._unrecoverable = [0] * self.num_layers
        self._h2d_bytes = [0] * self.num_layers
        self.d2h_bytes = [0] * self.num_layers
        self.prefill_hits = [0] * self.num_layers
        self.prefill_loads = [0] * self.num_layers
        self.prefill_h2d_bytes = [0] * self.num_layers

    @property
    def hits(self) -> list[int]:
        self.settle()
        return self._hits

    @property
    def misses(self) -> list[int]:
        self.settle()
        return self._misses

    @property
    def unrecoverable(self) -> list[int]:
        self.settle()
        return self._unrecoverable

    @property
    def h2d_bytes(self) -> list[int]:
        self.settle()
        return self._h2d_bytes

    def add_swap_in(
        self, layer: int, result: SwapInResult, on_unrecoverable: Callable[[], None] | None = None
    ) -> None:
        """Count one swap-in call of ``layer``; ``on_unrecoverable()`` runs when the call left a valid
        position unresolved (at once, or at ``settle`` for a deferred call: it must not depend on
        state the next calls change)."""
        totals: Sequence[int] | None = result.totals
        if totals is None:
            sums = torch.stack([
                result.hits.sum(),
                result.misses.sum(),
                result.unrecoverable.sum(),
                result.bytes_copied.sum(),
            ]).to(torch.int64)
            device = sums.device
            if self.defer or (self.defer is None and device.type != "cpu"):
                if self._pending is None or self._pending.device != device:
                    self.settle()
                    self._pending = torch.zeros(self.num_layers, 4, dtype=torch.int64, device=device)
                self._pending[layer] += sums  # (the same tensor all along: a graph may record this)
                self._dirty = True
                if on_unrecoverable is not None:
                    self._checks.append((layer, on_unrecoverable))
                return
            totals = sums.tolist()  # (a CPU tensor: nothing to wait for)
        self._add(layer, totals)
        if int(totals[2]) and on_unrecoverable is not None:
            on_unrecoverable()

    def _add(self, layer: int, totals: Sequence[int]) -> None:
        self._version += 1
        self._hits[layer] += int(totals[0])
        self._misses[layer] += int(totals[1])
        self._unrecoverable[layer] += int(totals[2])
        self._h2d_bytes[layer] += int(totals[3])

    def settle(self) -> None:
        """Read the deferred swap-in counts (one device->host read) into the totals and run the
        unrecoverable checks of the layers that left any; nothing when none is pending."""
        pending, checks = self._pending, self._checks
        if pending is None or not self._dirty:
            return
        table = pending.tolist()
        with torch.inference_mode():  # (made inside a forward, it is an inference tensor)
            pending.zero_()
        self._dirty, self._checks = False, []
        for layer, totals in enumerate(table):
            self._add(layer, totals)
        for layer, check in checks:
            if table[layer][2]:
                check()

    # --- a CUDA graph's swap-ins (``pipeline/graphs.py``) -------------------------------------------

    def snapshot(self) -> tuple[torch.Tensor | None, bool, int]:
        """The deferred counts as they are now, before a capture's warm-up steps (which run the same
        step again) and its recording (``restore``)."""
        pending = None if self._pending is None else self._pending.clone()
        return pending, self._dirty, len(self._checks)

    def restore(self, snap: tuple[torch.Tensor | None, bool, int]) -> list[tuple[int, Callable[[], None]]]:
        """Back to ``snap``: the deferred counts written in place (a recorded graph adds into this very
        tensor), the checks registered since dropped and returned (the last ones, the recording's,
        are what each replay's calls register: ``replayed``)."""
        pending, dirty, num_checks = snap
        if self._pending is not None:
            with torch.inference_mode():
                if pending is None:
                    self._pending.zero_()
                else:
                    self._pending.copy_(pending)
        self._dirty = dirty
        since, self._checks = self._checks[num_checks:], self._checks[:num_checks]
        return since

    def replayed(self, checks: list[tuple[int, Callable[[], None]]]) -> None:
        """A graph replay has added its swap-ins' counts on the device: read them at the next
        ``settle``, with ``checks`` (the recorded calls', over the graph's own tensors)."""
        if self._pending is None:
            return
        self._dirty = True
        self._checks.extend(checks)

    def add_prefill_loads(self, layer: int, hits: int, loads: int, h2d_bytes: int) -> None:
        """Rows a prefill brought to the device outside ``kernels.swap_in``: a chunk's grouped reads of
        earlier positions, a prefix-cache hit's identity columns. Counted apart from the decode and
        verify swap-in figures (which ``hispec replay`` reproduces)."""
        self._version += 1
        self.prefill_hits[layer] += hits
        self.prefill_loads[layer] += loads
        self.prefill_h2d_bytes[layer] += h2d_bytes

    def add_backup(self, num_bytes_per_layer: int) -> None:
        """A device->host copy of the same tokens in every layer (staging and backups move all layers)."""
        self._version += 1
        for layer in range(self.num_layers):
            self.d2h_bytes[layer] += num_bytes_per_layer

    def totals(self) -> tuple[Transfers, Transfers]:
        """All layers summed: (hits, misses, bytes) of the swap-ins, (hits, loads, bytes) of the
        prefills."""
        self.settle()
        if self._sums is None or self._sums[0] != self._version:
            sums = (
                (sum(self._hits), sum(self._misses), sum(self._h2d_bytes)),
                (sum(self.prefill_hits), sum(self.prefill_loads), sum(self.prefill_h2d_bytes)),
            )
            self._sums = (self._version, sums)
        return self._sums[1]

    def hit_rate(self, layer: int) -> float:
        self.settle()
        return _rate(self._hits[layer], self._misses[layer])

    def as_dict(self) -> dict[str, object]:
        """Every figure, per layer: one dict, built again only after a change, so a caller must not
        change it (``Engine.stats`` hands out copies)."""
        self.settle()  # (once: the lists below are the settled totals)
        if self._figures is not None and self._figures[0] == self._version:
            return self._figures[1]
        figures: dict[str, object] = {
            "hits": list(self._hits),
            "misses": list(self._misses),
            "unrecoverable": list(self._unrecoverable),
            "h2d_bytes": list(self._h2d_bytes),
            "d2h_bytes": list(self.d2h_bytes),
            "prefill_hits": list(self.prefill_hits),
            "prefill_loads": list(self.prefill_loads),
            "prefill_h2d_bytes": list(self.prefill_h2d_bytes),
            "hit_rate": [round(_rate(h, m), 4) for h, m in zip(self._hits, self._misses)],
        }
        self._figures = (self._version, figures)
        return figures


def _rate(hits: int, misses: int) -> float:
    return hits / (hits + misses) if hits + misses else 1.0
