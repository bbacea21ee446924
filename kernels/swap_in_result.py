"""The value every swap-in implementation returns (its own module, so that the implementations and
the dispatcher in ``kernels.swap_in`` do not import each other)."""

from __future__ import annotations

import attrs
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
