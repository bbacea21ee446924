"""hispec: a DeepSeek-V3.2-style model served with HiSparse and MTP speculative decoding.

The public API is importable from here; heavy modules load on first use.
"""

from pipeline.config import EngineConfig, HiSparseConfig, MemoryPlan, SpeculativeConfig
from pipeline.errors import ConfigError, HispecError, RequestError

__all__ = [
    "ConfigError",
    "EngineConfig",
    "HiSparseConfig",
    "HispecError",
    "MemoryPlan",
    "RequestError",
    "SpeculativeConfig",
]
