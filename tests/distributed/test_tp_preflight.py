"""Start-up checks of a tensor-parallel configuration (in one process: nothing is spawned)."""

from __future__ import annotations

import attrs
import pytest
from _engine_util import config

from pipeline import preflight
from pipeline.errors import ConfigError
from pipeline.startup import plan_engine


def test_the_memory_check_counts_every_ranks_memory_layer(tiny_model):
    """The latent KV is replicated: two CPU ranks need the memory layer twice over in RAM, the host
    pool once when they share it (the default)."""
    one = config()
    device = plan_engine(one, tiny_model.cfg).device
    estimate = preflight.estimate_memory(one, device)
    total = estimate.total_bytes
    pool = next(a.num_bytes for a in estimate.allocations if a.name == "host pool")
    own = attrs.evolve(one, tensor_parallel_size=2, shared_host_pool=False)
    preflight.check_memory(one, device, host_available=total)
    preflight.check_memory(own, device, host_available=2 * total)
    with pytest.raises(ConfigError, match=r"\(2 ranks\)"):
        preflight.check_memory(own, device, host_available=2 * total - 1)
    shared = attrs.evolve(one, tensor_parallel_size=2)
    preflight.check_memory(shared, device, host_available=2 * total - pool)
    with pytest.raises(ConfigError, match=r"\(2 ranks\)"):
        preflight.check_memory(shared, device, host_available=2 * total - pool - 1)


def test_launched_over_machines_the_memory_check_counts_this_machines_ranks(tiny_model, monkeypatch):
    """Four ranks over two machines (a launcher's environment): this machine holds two memory layers."""
    four = attrs.evolve(config(), tensor_parallel_size=4, shared_host_pool=False)
    device = plan_engine(four, tiny_model.cfg).device
    total = preflight.estimate_memory(four, device).total_bytes
    launcher = {"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    preflight.check_memory(four, device, host_available=2 * total)
    with pytest.raises(ConfigError, match=r"\(2 ranks\)"):
        preflight.check_memory(four, device, host_available=2 * total - 1)


def test_data_parallel_replicas_starting_together_must_fit_together(tiny_model):
    """Two replicas of two ranks (each pair sharing a host pool): four memory layers less two host
    pools, all in this machine's memory at once."""
    cfg = attrs.evolve(config(), tensor_parallel_size=2)
    device = plan_engine(cfg, tiny_model.cfg).device
    estimate = preflight.estimate_memory(cfg, device)
    pool = next(a.num_bytes for a in estimate.allocations if a.name == "host pool")
    both = 2 * (2 * estimate.total_bytes - pool)
    preflight.check_memory(cfg, device, host_available=both, replicas=2)
    with pytest.raises(ConfigError, match=r"\(2 replicas of 2 ranks\)"):
        preflight.check_memory(cfg, device, host_available=both - 1, replicas=2)


def test_more_ranks_than_heads_or_devices_are_refused_naming_the_field(tiny_model):
    heads = tiny_model.cfg.num_attention_heads
    with pytest.raises(ConfigError, match="attention heads") as info:
        too_many = attrs.evolve(config(), tensor_parallel_size=heads + 1)
        preflight.check_tensor_parallel(too_many, tiny_model.cfg)
    assert info.value.field == "tensor_parallel_size"
    preflight.check_tensor_parallel(attrs.evolve(config(), tensor_parallel_size=heads), tiny_model.cfg)
