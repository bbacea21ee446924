"""Where the tokens of one forward write their rows (shared by both KV memories)."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class WriteTargets:
    """Where the tokens of one decode/verify forward write their rows."""

    locs: torch.Tensor  # [T] int64 logical locations (indexer keys)
    slots: torch.Tensor  # [T] int64 device slots (MLA rows)


@attrs.frozen
class VerifyLayout:
    """Where the verify tokens of one speculative step live (request-major, D per request)."""

    targets: WriteTargets  # [B * D]
    draft_tokens: int  # D
    rows: tuple[int, ...] = ()  # the request rows, in the order of ``targets``
    # ``targets.slots`` as host numbers, where the memory found them on the host (HiSparse): what
    # finalize reads instead of the device; None: read them back
    host_slots: tuple[int, ...] | None = None
