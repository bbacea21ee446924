"""hispec: a DeepSeek-V3.2-style model served with HiSparse and MTP speculative decoding.

The public API is importable from here. Modules that need torch load on first use of a name that
needs them, so ``import pipeline`` and ``from pipeline import Engine, EngineConfig`` stay fast.
Importing never configures logging (see ``configure_logging``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pipeline.capacity import MemoryPlan
from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.errors import ConfigError, EngineClosed, EngineError, HispecError, RequestError, RequestFailed

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "Engine": "pipeline.engine",
    "GenerateResult": "pipeline.messages",
    "RequestOutput": "pipeline.messages",
    "RequestMetrics": "pipeline.request",
    "SamplingParams": "pipeline.sampling",
    "configure_logging": "pipeline.logs",
}

if TYPE_CHECKING:
    from pipeline.engine import Engine
    from pipeline.logs import configure_logging
    from pipeline.messages import GenerateResult, RequestOutput
    from pipeline.request import RequestMetrics
    from pipeline.sampling import SamplingParams


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "ConfigError",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineError",
    "GenerateResult",
    "HiSparseConfig",
    "HispecError",
    "MemoryPlan",
    "RequestError",
    "RequestFailed",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "configure_logging",
]
