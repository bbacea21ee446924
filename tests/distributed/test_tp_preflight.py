"""Start-up checks of a tensor-parallel configuration (in one process: nothing is spawned)."""

from __future__ import annotations

import attrs
import pytest
from _engine_util import config

from pipeline import preflight
from pipeline.errors import ConfigError
from pipeline.startup import plan_engine


def test_the_memory_check_counts_every_ranks_memory_layer(tiny_model):
    """The latent KV is replicated: two CPU ranks need the memory layer twice over in RAM."""
    one = config()
    device = plan_engine(one, tiny_model.cfg).device
    total = preflight.estimate_memory(one, device).total_bytes
    two = attrs.evolve(one, tensor_parallel_size=2)
    preflight.check_memory(one, device, host_available=total)
    preflight.check_memory(two, device, host_available=2 * total)
    with pytest.raises(ConfigError, match=r"\(2 ranks\)"):
        preflight.check_memory(two, device, host_available=2 * total - 1)


def test_more_ranks_than_heads_or_devices_are_refused_naming_the_field(tiny_model):
    heads = tiny_model.cfg.num_attention_heads
    with pytest.raises(ConfigError, match="attention heads") as info:
        too_many = attrs.evolve(config(), tensor_parallel_size=heads + 1)
        preflight.check_tensor_parallel(too_many, tiny_model.cfg)
    assert info.value.field == "tensor_parallel_size"
    preflight.check_tensor_parallel(attrs.evolve(config(), tensor_parallel_size=heads), tiny_model.cfg)
