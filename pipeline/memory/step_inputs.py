"""Small host values a step sends to the device, without a CPU wait.

A decode step sends a few integers per request to the device: its token ids, positions and request
rows, where its rows are written, the tables' changed entries. A copy from pageable host memory
waits for its stream before it starts, so on CUDA each such ``.to(device)`` is a CPU wait on all
the work queued before it. ``to_device`` writes them into one pinned block and copies it with
``non_blocking=True`` instead: one asynchronous copy. torch's pinned-block cache keeps the block
from being reused until that copy has run (it records an event on the copy's stream), so the block
may be dropped at once. Elsewhere each column is the host tensor itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pins_for(device: torch.device) -> bool:
    """Whether host tensors that copies to and from ``device`` read or write are pinned: on CUDA."""
    return device.type == "cuda"


def to_device(
    device: torch.device, *columns: Sequence[int] | torch.Tensor, dtype: torch.dtype = torch.int64
) -> list[torch.Tensor]:
    """Each of ``columns`` (a list of ints or a 1-D host tensor) as a ``dtype`` tensor on ``device``:
    towards CUDA through one pinned block and one asynchronous copy (the results are views of it);
    elsewhere as host tensors. (A column already off the host is only cast.)"""
    values = [torch.as_tensor(column, dtype=dtype) for column in columns]
    if not pins_for(device) or any(value.device.type != "cpu" for value in values):
        return [value.to(device) for value in values]
    sizes = [value.numel() for value in values]
    block = torch.empty(sum(sizes), dtype=dtype, pin_memory=True)
    torch.cat([value.reshape(-1) for value in values], out=block)
    return list(block.to(device, non_blocking=True).split(sizes))
