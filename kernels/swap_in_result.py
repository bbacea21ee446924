"""The value every swap-in implementation returns (its own module, so that the implementations and
the dispatcher in ``kernels.swap_in`` do not import each other)."""

from __future__ import annotations

import attrs
import numpy as np
import torch


@attrs.frozen(eq=False)
class SwapInResult:
    """The outcome of one swap-in call (tensors on the metadata's device).

    The per-request counts live in one ``[B, 4]`` table; ``steps_done``, ``hits``, ``misses``,
    ``unrecoverable`` and ``bytes_copied`` are views of it, formed when read (a decode step reads
    only the sums, which the CPU implementations hand over as ``totals``)."""

    slots: torch.Tensor  # [B, S, K] int32 physical device slot per entry, -1 invalid/unrecoverable
    counts: torch.Tensor  # [B, 4] int32 (steps handled before a stop, hits, misses, unrecoverable)
    row_bytes: int  # bytes of one copied row (``device_kv``'s last dimension)
    # (hits, misses, unrecoverable, bytes) summed over the batch, when an implementation has them
    # as Python numbers anyway (saves a caller the device->host read of the sums)
    totals: tuple[int, int, int, int] | None = None
    # every request handled all its steps (``steps_done == S`` everywhere), when known without a read
    complete: bool | None = None

    @property
    def steps_done(self) -> torch.Tensor:  # [B] int32 steps handled before a stop (S when none)
        return self.counts[:, 0]

    @property
    def hits(self) -> torch.Tensor:  # [B] int32
        return self.counts[:, 1]

    @property
    def misses(self) -> torch.Tensor:  # [B] int32 rows copied host->device
        return self.counts[:, 2]

    @property
    def unrecoverable(self) -> torch.Tensor:  # [B] int32
        return self.counts[:, 3]

    @property
    def bytes_copied(self) -> torch.Tensor:  # [B] int64 misses * row bytes
        return self.counts[:, 2].to(torch.int64) * self.row_bytes

    def all_steps_done(self, steps: int) -> bool:
        """Every request handled all ``steps`` of its steps: ``complete`` where the implementation
        knew it, else read from ``steps_done``."""
        if self.complete is not None:
            return self.complete
        return bool((self.steps_done == steps).all())

    @classmethod
    def from_counts(
        cls, slots: torch.Tensor, counts: torch.Tensor, *, row_bytes: int,
        totals: tuple[int, int, int, int] | None = None,
    ) -> SwapInResult:
        """Build from ``counts [B, 4]`` = (steps_done, hits, misses, unrecoverable), copied (the
        caller may reuse its buffer)."""
        return cls(slots=slots, counts=counts.to(torch.int32, copy=True), row_bytes=row_bytes, totals=totals)

    @classmethod
    def from_arrays(
        cls, slots: np.ndarray, counts: np.ndarray, *, row_bytes: int,
        totals: tuple[int, int, int] | None = None, complete: bool | None = None,
    ) -> SwapInResult:
        """Build from numpy ``slots [B, S, K]`` int32 and ``counts [B, 4]`` (int32 is taken without
        a copy) = (steps_done, hits, misses, unrecoverable), with ``totals`` (the CPU
        implementations): the (hits, misses, unrecoverable) sums when the caller has them already."""
        table = torch.from_numpy(counts if counts.dtype == np.int32 else counts.astype(np.int32))
        hits, loaded, lost = totals if totals is not None else (int(v) for v in counts[:, 1:].sum(0))
        return cls(
            slots=torch.from_numpy(slots),
            counts=table,
            row_bytes=row_bytes,
            totals=(hits, loaded, lost, loaded * row_bytes),
            complete=complete,
        )
