"""DeepSeek-V3.2 (``deepseek_v32``): every layer runs its own indexer, half-split indexer RoPE."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.model.archs.base import Architecture


def _indexer_types(raw: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    return ()  # every layer full


ARCHITECTURE = Architecture(
    model_type="deepseek_v32",
    hf_class="DeepseekV32ForCausalLM",
    indexer_rope="half_split",
    defaults={"rms_norm_eps": 1e-6},
    indexer_types=_indexer_types,
    hf_extra=lambda cfg: {},
)
