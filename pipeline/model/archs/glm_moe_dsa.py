"""GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2 with interleaved indexer RoPE and shared indexer layers.

A ``"shared"`` layer has no indexer of its own: it attends over the positions the previous
``"full"`` layer of the same forward selected. ``indexer_types`` is read as HF 5.24 reads it: the
list itself, else ``index_topk_pattern`` (a string of ``F`` / ``S`` or a list), else the schedule
``full if max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0`` (defaults 2 and 1, so
every layer is full unless the config says otherwise). The MTP layer always has its own indexer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.model.archs.base import Architecture
from pipeline.model.fields import integer, strings


def _indexer_types(raw: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    if raw.get("indexer_types") is not None:
        return strings(raw["indexer_types"], "indexer_types")
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            return tuple({"F": "full", "S": "shared"}.get(c, c) for c in pattern)
        return strings(pattern, "index_topk_pattern")
    # as HF: below 1 is 1
    freq = max(integer(raw.get("index_topk_freq", 1), "index_topk_freq", minimum=None), 1)
    offset = integer(raw.get("index_skip_topk_offset", 2), "index_skip_topk_offset", minimum=None)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


ARCHITECTURE = Architecture(
    model_type="glm_moe_dsa",
    hf_class="GlmMoeDsaForCausalLM",
    indexer_rope="interleaved",
    defaults={"rms_norm_eps": 1e-5},
    indexer_types=_indexer_types,
    hf_extra=lambda cfg: {"indexer_types": list(cfg.indexer_types)},
)
