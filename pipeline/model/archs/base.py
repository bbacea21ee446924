"""What one architecture entry holds (its own module, imported by the entries and the registry)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

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
    hf_extra: Callable[[Any], dict[str, Any]]  # takes the ModelConfig
