"""The value every swap-in implementation returns (its own module, so that the implementations and
the dispatcher in ``kernels.swap_in`` do not import each other)."""

from __future__ import annotations

import attrs
import numpy as np
import torch


@attrs.frozen(eq=False)
class SwapInResult:
    """The outcome of one swap-in call (tensors on the metadata's device)."""

    slots: torch.Tensor  # [B, S, K] int32 physical device slot per entry, -1 invalid/unrecoverable
    steps_done: torch.Tensor  # [B] int32 steps handled before a stop (S when none)
    hits: torch.Tensor  # [B] int32
    misses: torch.Tensor  # [B] int32 rows copied host->device
    unrecoverable: torch.Tensor  # [B] int32
    bytes_copied: torch.Tensor  # [B] int64 misses * row bytes
    # (hits, misses, unrecoverable, bytes) summed over the batch, when an implementation has them
    # as Python numbers anyway (saves a caller the device->host read of the sums)
    totals: tuple[int, int, int, int] | None = None
    # every request handled all its steps (``steps_done == S`` everywhere), when known without a read
    complete: bool | None = None

    def all_steps_done(self, steps: int) -> bool:
        """Every request handled all ``steps`` of its steps: ``complete`` where the implementation
        knew it, else read from ``steps_done``."""
        if self.complete is not None:
            return self.complete
        return bool((self.steps_done == steps).all())

    @classmethod
    def from_counts(cls, slots: torch.Tensor, counts: torch.Tensor, *, row_bytes: int) -> SwapInResult:
        """Build from ``counts [B, 4]`` = (steps_done, hits, misses, unrecoverable)."""
        counts = counts.to(torch.int32)
        return cls(
            slots=slots,
            steps_done=counts[:, 0].clone(),
            hits=counts[:, 1].clone(),
            misses=counts[:, 2].clone(),
            unrecoverable=counts[:, 3].clone(),
            bytes_copied=counts[:, 2].to(torch.int64) * row_bytes,
        )

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
            steps_done=table[:, 0],
            hits=table[:, 1],
            misses=table[:, 2],
            unrecoverable=table[:, 3],
            bytes_copied=table[:, 2].to(torch.int64) * row_bytes,
            totals=(hits, loaded, lost, loaded * row_bytes),
            complete=complete,
        )
