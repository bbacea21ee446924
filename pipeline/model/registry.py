"""The architectures hispec serves, by ``config.json`` ``model_type``.

Each entry is one small module under ``archs/`` that says how its architecture differs from the
common DeepSeek-V3.2 shape (MLA + DSA indexer + MoE + MTP): the indexer's RoPE layout, which layers
run their own indexer, HF's config defaults that differ, and the extra ``config.json`` keys it
writes. Adding an architecture is one such module plus one line in :data:`ARCHITECTURES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from pipeline.model.config import ModelConfig

INDEXER_ROPES = ("half_split", "interleaved")


@attrs.frozen
class Architecture:
    """How one ``model_type`` maps onto hispec's model."""

    model_type: str
    hf_class: str  # the ``architectures`` entry of its config.json (HF's causal-LM class)
    # layout of the indexer's rotated channels: "half_split" pairs (x_i, x_{i+R/2}), "interleaved"
    # pairs (x_{2i}, x_{2i+1}) as MLA does; MLA itself is interleaved in every architecture
    indexer_rope: str
    # HF's config defaults where they differ between architectures (a config.json value wins)
    defaults: Mapping[str, Any]
    # raw config.json, num_hidden_layers -> per target layer "full" (own indexer) or "shared"
    indexer_types: Callable[[Mapping[str, Any], int], tuple[str, ...]]
    # the config -> the architecture's own config.json keys
    hf_extra: Callable[[ModelConfig], dict[str, Any]]


def _table() -> dict[str, Architecture]:
    from pipeline.model.archs import deepseek_v32, glm_moe_dsa

    return {arch.model_type: arch for arch in (deepseek_v32.ARCHITECTURE, glm_moe_dsa.ARCHITECTURE)}


ARCHITECTURES: dict[str, Architecture] = _table()


class UnsupportedArchitecture(ValueError):
    """A ``model_type`` that is not in the table."""


def architecture(model_type: object) -> Architecture:
    """The table entry of ``model_type``; raises :class:`UnsupportedArchitecture` listing the supported ones."""
    arch = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise UnsupportedArchitecture(
            f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return arch
