"""Helpers of the reliability suite."""

from __future__ import annotations

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig

PAGE, HOT = 8, 16


def small_config(*, hisparse: bool = True, num_steps: int | None = 3, **overrides) -> EngineConfig:
    """float64 (the random tiny model's dtype), pages of 8, HOT 16, a 1024-token device pool."""
    fields = dict(
        dtype="float64",
        page_size=PAGE,
        max_context_len=320,
        max_running_requests=8,
        device_pool_tokens=1024,
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2) if hisparse else None,
        speculative=SpeculativeConfig(
            num_steps=num_steps,
            max_batch_size=None,
            timed=False,
            min_accept_length=None,
            plain_tail=False,
            plain_while_prefilling=False,
        )
        if num_steps
        else None,
    )
    return EngineConfig(**{**fields, **overrides})
