"""Building one rank's shard of the model: only its slices are read and kept.

The model is created on the ``meta`` device, sharded (``sharding.shard_model``), given empty storage
of the run dtype, and each tensor is filled from a source with the rank's slice:

* a checkpoint directory (``CheckpointSource``): a slice along the first dimension (vocabulary rows,
  column-split rows, heads of ``q_b_proj`` / ``kv_b_proj``) is one positioned read of its rows; a
  row-split weight (``o_proj``, ``down_proj``) is read whole, one tensor at a time, and narrowed; the
  routed experts of other ranks are never read. FP8 weights are dequantized whole, then narrowed.
* the tensors of a model in memory (``StateDictSource``: tests and benchmarks hand the engine a
  random model; the worker processes get its state dict through shared memory).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from pipeline.distributed.group import TensorGroup
from pipeline.distributed.sharding import ShardSpec, shard_model
from pipeline.model.checkpoint import to_checkpoint_name
from pipeline.model.config import ModelConfig, resolve_model_dir
from pipeline.model.fp8 import FP8_DTYPES, Fp8Config, dequantize_into
from pipeline.model.loader import all_finite, read_model_config
from pipeline.model.model import DeepseekV32
from pipeline.model.weights import CheckpointError, CheckpointFiles

_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


class StateDictSource:
    """The full tensors of a model in memory, by state-dict name."""

    def __init__(self, tensors: dict[str, Tensor]) -> None:
        self.tensors = tensors

    def read(self, name: str, spec: ShardSpec | None) -> Tensor:
        tensor = self.tensors[name]
        return tensor if spec is None else tensor.narrow(spec.dim, spec.start, spec.stop - spec.start)


class CheckpointSource:
    """The tensors of a checkpoint directory (HF names, per-expert or fused experts, FP8 or not)."""

    def __init__(self, files: CheckpointFiles, cfg: ModelConfig, quant: Fp8Config | None) -> None:
        self.files = files
        self.cfg = cfg
        self.quant = quant

    def read(self, name: str, spec: ShardSpec | None) -> Tensor:
        ckpt = to_checkpoint_name(name, self.cfg.num_hidden_layers)
        if not ckpt.endswith(_EXPERTS) or ckpt in self.files:  # the fused spelling is read as one tensor
            return self._tensor(ckpt, spec)
        prefix, kind = ckpt.rsplit(".", 1)
        experts = range(spec.start, spec.stop) if spec is not None else range(self.cfg.n_routed_experts)
        if kind == "down_proj":
            parts = [self._tensor(f"{prefix}.{e}.down_proj.weight", None) for e in experts]
        else:
            parts = [
                torch.cat([self._tensor(f"{prefix}.{e}.{p}_proj.weight", None) for p in ("gate", "up")])
                for e in experts
            ]
        if not parts:
            return torch.empty(0)
        return torch.stack(parts)

    def _tensor(self, ckpt: str, spec: ShardSpec | None) -> Tensor:
        files, where = self.files, str(self.files.path)
        if ckpt not in files:
            raise CheckpointError(f"tensor {ckpt} is missing", where)
        scale = ckpt.removesuffix("weight") + "weight_scale_inv"
        if scale in files:
            if self.quant is None:
                raise CheckpointError(f"{scale} is present but config.json has no quantization_config", where)
            whole = torch.empty(files.entries[ckpt].shape, dtype=torch.float32)
            dequantize_into(whole, files.read(ckpt), files.read(scale), self.quant, ckpt)
        elif files.entries[ckpt].dtype in FP8_DTYPES:
            raise CheckpointError(f"{ckpt} is float8 but has no {scale}", where)
        elif spec is not None and spec.dim == 0:
            return files.read_rows(ckpt, spec.start, spec.stop)
        else:
            whole = files.read(ckpt)
        return whole if spec is None else whole.narrow(spec.dim, spec.start, spec.stop - spec.start)


def build_shard(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, group: TensorGroup, source
) -> DeepseekV32:
    """``group.rank``'s shard of the model, filled from ``source`` (see the module docstring)."""
    with torch.device("meta"):
        model = DeepseekV32(cfg)
    specs = shard_model(model, group)
    model.to_empty(device=device).to_dtype(dtype)
    tied = cfg.tie_word_embeddings
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    checks: list[tuple[str, torch.Tensor]] = []  # (name, is it finite): read back once, at the end
    with torch.no_grad():
        for name, dest in model.state_dict().items():
            if tied and name == "lm_head.weight":
                continue
            src = source.read(name, specs.get(name))
            if tuple(src.shape) != tuple(dest.shape):
                shapes = f"has shape {list(src.shape)}, the shard needs {list(dest.shape)}"
                raise CheckpointError(f"tensor {name} {shapes}", name)
            dest.copy_(src)
            checks.append((name, all_finite(dest)))
    finite = torch.stack([ok for _, ok in checks]).tolist() if checks else []  # one device sync
    bad = [name for (name, _), ok in zip(checks, finite, strict=True) if not ok]
    if bad:  # as the one-process loader says it (``load_weights``): every rank reads the same tensors
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise CheckpointError(f"{len(bad)} tensors hold NaN or Inf ({shown}) when served as {dtype}", bad[0])
    return model.eval()


def load_shard(
    name_or_path: str | Path, dtype: torch.dtype, device: torch.device, group: TensorGroup
) -> DeepseekV32:
    """The rank's shard of the model of an HF-format directory (or a bundled name)."""
    path = resolve_model_dir(name_or_path)
    cfg, quant = read_model_config(path)
    with CheckpointFiles(path) as files:
        return build_shard(cfg, dtype, device, group, CheckpointSource(files, cfg, quant))
