"""Each rank reads its shard straight from the checkpoint: the same tensors as slicing the whole
model, for a plain float64 checkpoint and for an FP8 one (dequantized, then narrowed). In one
process: building a shard runs no collective, so a stand-in group (rank, size) is enough."""

from __future__ import annotations

import types

import pytest
import torch
from _checkpoints import write_fp8_checkpoint
from _model_util import random_model, tiny_config

from pipeline.distributed.loading import StateDictSource, build_shard, load_shard
from pipeline.distributed.sharding import ShardSpec, shard_model, shard_range
from pipeline.model import DeepseekV32, load_model
from pipeline.model.checkpoint import save_model

CFG = dict(num_attention_heads=3, n_routed_experts=6, n_group=3, intermediate_size=97)


def group(rank: int, size: int = 2):
    return types.SimpleNamespace(rank=rank, size=size)


@pytest.mark.parametrize("fp8", [False, True], ids=["float64", "fp8"])
def test_a_shard_read_from_the_checkpoint_is_the_slice_of_the_whole(tmp_path, fp8):
    save_model(random_model(tiny_config(**CFG)), tmp_path / "src", max_shard_bytes=100_000)
    path = tmp_path / "src"
    if fp8:
        write_fp8_checkpoint(path, tmp_path / "fp8", max_shard_bytes=100_000)
        path = tmp_path / "fp8"
    whole = load_model(path, dtype=torch.float64)
    for rank in range(2):
        source = StateDictSource(whole.state_dict())
        want = build_shard(whole.cfg, torch.float64, torch.device("cpu"), group(rank), source)
        got = load_shard(path, torch.float64, torch.device("cpu"), group(rank)).state_dict()
        assert set(got) == set(want.state_dict())
        for name, tensor in want.state_dict().items():
            assert torch.equal(got[name], tensor), name


def test_every_rank_holds_its_slice_and_together_they_hold_the_model():
    cfg = tiny_config(**CFG)
    with torch.device("meta"):
        model = DeepseekV32(cfg)
    whole = {name: t.shape for name, t in model.state_dict().items()}
    covered: dict[str, int] = {}
    for rank in range(2):
        with torch.device("meta"):
            shard = DeepseekV32(cfg)
        specs = shard_model(shard, group(rank))
        for name, tensor in shard.state_dict().items():
            spec = specs.get(name)
            if spec is None:
                assert tensor.shape == whole[name], name  # replicated
                continue
            assert isinstance(spec, ShardSpec) and tensor.shape[spec.dim] == spec.stop - spec.start, name
            covered[name] = covered.get(name, 0) + spec.stop - spec.start
    assert covered and all(n == whole[name][specs[name].dim] for name, n in covered.items())
    # the attention heads, experts and vocabulary of this model split unevenly
    assert shard_range(3, 2, 0) == (0, 1) and shard_range(257, 2, 1) == (128, 257)
    assert "model.layers.0.self_attn.indexer.wq_b.weight" not in specs  # the indexer is replicated
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" not in specs  # so is the latent KV



def test_a_shard_holding_nan_or_inf_fails_its_load_naming_the_tensors():
    """As the one-process loader: a rank's tensors that hold NaN or Inf are a CheckpointError."""
    from pipeline.model.weights import CheckpointError

    whole = random_model(tiny_config(**CFG))
    state = dict(whole.state_dict())
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].clone()
    state["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    state["model.norm.weight"] = torch.full_like(state["model.norm.weight"], float("inf"))
    with pytest.raises(CheckpointError) as err:
        build_shard(whole.cfg, torch.float64, torch.device("cpu"), group(0), StateDictSource(state))
    assert "model.layers.0.mlp.up_proj.weight" in str(err.value) and "model.norm.weight" in str(err.value)
