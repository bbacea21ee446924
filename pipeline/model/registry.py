"""The architectures hispec serves, by ``config.json`` ``model_type``.

Each entry is one small module under ``archs/`` that says how its architecture differs from the
common DeepSeek-V3.2 shape (MLA + DSA indexer + MoE + MTP): the indexer's RoPE layout, which layers
run their own indexer, HF's config defaults that differ, and the extra ``config.json`` keys it
writes. Adding an architecture is one such module plus one line in :data:`ARCHITECTURES`.
"""

from __future__ import annotations

from pipeline.model.archs import deepseek_v32, glm_moe_dsa
from pipeline.model.archs.base import INDEXER_ROPES, Architecture


def _table() -> dict[str, Architecture]:
    return {arch.model_type: arch for arch in (deepseek_v32.ARCHITECTURE, glm_moe_dsa.ARCHITECTURE)}


ARCHITECTURES: dict[str, Architecture] = _table()

__all__ = ["ARCHITECTURES", "INDEXER_ROPES", "Architecture", "UnsupportedArchitecture", "architecture"]


class UnsupportedArchitecture(ValueError):
    """A ``model_type`` that is not in the table."""


def architecture(model_type: object) -> Architecture:
    """The table entry of ``model_type``; raises :class:`UnsupportedArchitecture` listing the
    supported ones."""
    arch = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise UnsupportedArchitecture(
            f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return arch
