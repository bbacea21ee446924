"""Top-k trace recording: which positions each layer selected, per request and step.

A JSON-lines file (format of record: ``docs/topk-trace.md``). The first line is a header naming
the configuration the engine ran with, every other line one selection::

    {"trace": "hispec-topk", "version": 2, "hot": 128, "policy": "lru", "row_bytes": 320, ...} {"request":
    "r3", "layer": 1, "phase": "decode", "position": 812, "top_k": [805, 3, 811, ...]} {"request": "r3",
    "layer": 1, "phase": "verify", "step": 2, "position": 815, "top_k": [...], "near": [...]}

``position`` is the query token's position (its visible length is ``position + 1``); ``top_k`` is in
contract order with the -1 padding dropped; ``phase`` is ``prefill`` (a prefill chunk's queries),
``decode`` (one step per request) or ``verify`` (D steps per request, ``step`` = 0..D-1 within the
swap-in call); ``near`` (decode and verify, from version 3) the positions the indexer ranked next
after the top-k (``near_margin`` of them, header), in the same order. The file is what ``hispec
replay`` reads to compare replacement policies on the same selections. A file without a header
(version 1) holds records only, and no ``step``; a version 2 file no ``near``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, TextIO

import torch

from kernels.swap_in_policy import near_margin
from pipeline.capacity import kv_format
from pipeline.config import EngineConfig, SpeculativeConfig
from pipeline.model.config import ModelConfig

FORMAT = "hispec-topk"
VERSION = 3


class TracedPlan(Protocol):
    """What a trace's header reads of an engine's start-up plan (``EnginePlan``)."""

    @property
    def hot(self) -> int: ...

    @property
    def speculative(self) -> SpeculativeConfig | None: ...


def trace_meta(
    config: EngineConfig, plan: TracedPlan, model_cfg: ModelConfig, dtype: torch.dtype
) -> dict[str, object]:
    """The header of a trace recorded by an engine of ``config``, its start-up ``plan`` and a model
    of ``model_cfg``: what a replay needs to model the engine's swap-in."""
    hs = config.hisparse
    spec = plan.speculative
    policy = hs.policy_for(config.device) if hs is not None else None
    margin = (
        0
        if hs is None or policy is None
        else near_margin(hs.near_margin, policy, model_cfg.index_topk, tracing=True)
    )
    return {
        "near_margin": margin,
        "hot": plan.hot if hs is not None else None,
        "policy": policy,
        "page_size": config.page_size,
        "top_k": model_cfg.index_topk,
        "layers": model_cfg.num_hidden_layers,
        "row_bytes": kv_format(model_cfg, dtype, config.kv_cache_dtype).row_bytes,  # as stored
        "draft_tokens": spec.draft_tokens if spec is not None else 0,
    }


class TopKTrace:
    """Appends selections to a JSON-lines file (after a header of ``meta``); ``close`` flushes it."""

    def __init__(self, path: str | Path, *, meta: dict[str, object] | None = None) -> None:
        self.path = Path(path)
        self._file: TextIO = self.path.open("w")
        header = {"trace": FORMAT, "version": VERSION, **(meta or {})}
        self._file.write(json.dumps(header, separators=(",", ":")) + "\n")

    def record(
        self,
        layer: int,
        phase: str,
        labels: list[str],
        positions: torch.Tensor,
        top_k: torch.Tensor,
        *,
        near: torch.Tensor | None = None,
    ) -> None:
        """One forward's selections of ``layer``: row i is request ``labels[i]``'s token at
        ``positions[i]``; a verify's rows are request-major, a request's D steps in order.
        ``near [T, M]``: the positions ranked next (recorded for decode and verify)."""
        rows = top_k.cpu().tolist()
        nears = near.cpu().tolist() if near is not None and phase != "prefill" else [None] * len(rows)
        steps: dict[str, int] = {}  # verify: rows of each request so far in this call
        for label, pos, picked, close in zip(labels, positions.tolist(), rows, nears):
            entry: dict[str, object] = {"request": label, "layer": layer, "phase": phase}
            if phase == "verify":
                step = steps.get(label, 0)
                entry["step"] = step
                steps[label] = step + 1
            entry["position"] = pos
            entry["top_k"] = [t for t in picked if t >= 0]
            if close is not None:
                entry["near"] = [t for t in close if t >= 0]
            self._file.write(json.dumps(entry, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


def read_trace(path: str | Path) -> list[dict]:
    """All selection records of a trace file, in recording order (the header left out)."""
    with Path(path).open() as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [r for r in lines if not (isinstance(r, dict) and r.get("trace") == FORMAT)]


def read_header(path: str | Path) -> dict[str, object]:
    """The header of a trace file (``{}`` for a file recorded without one)."""
    with Path(path).open() as f:
        for line in f:
            if line.strip():
                first = json.loads(line)
                return first if isinstance(first, dict) and first.get("trace") == FORMAT else {}
    return {}
