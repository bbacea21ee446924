"""Top-k trace recording: which positions each layer selected, per request and step.

One JSON object per line::

    {"request": "r3", "layer": 1, "phase": "decode", "position": 812, "top_k": [805, 3, 811, ...]}

``position`` is the query token's position (its visible length is ``position + 1``); ``top_k`` is in
contract order with the -1 padding dropped; ``phase`` is ``prefill`` (dense in device, no swap-in),
``decode`` (one step per request) or ``verify`` (D steps per request). The file is what an offline replay reads to compare
replacement policies (LRU, CLOCK, Belady's MIN) on the same selections.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

import torch


class TopKTrace:
    """Appends selections to a JSON-lines file; ``close`` flushes it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: TextIO = self.path.open("w")
        self.num_records = 0

    def record(
        self, layer: int, phase: str, labels: list[str], positions: torch.Tensor, top_k: torch.Tensor
    ) -> None:
        rows = top_k.cpu().tolist()
        for label, pos, picked in zip(labels, positions.tolist(), rows):
            entry = {
                "request": label,
                "layer": layer,
                "phase": phase,
                "position": pos,
                "top_k": [t for t in picked if t >= 0],
            }
            self._file.write(json.dumps(entry, separators=(",", ":")) + "\n")
        self.num_records += len(rows)

    def close(self) -> None:
        self._file.close()


def read_trace(path: str | Path) -> list[dict]:
    """All records of a trace file, in recording order."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
