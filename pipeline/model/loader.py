"""Build a model from an HF-format directory: sharded, lazy, FP8-aware.

Steps, each with bounded host memory:

1. ``config.json`` -> :class:`ModelConfig` (a registered architecture, plain or YaRN RoPE) and,
   when present, ``quantization_config`` (FP8 only);
2. the model is created on the ``meta`` device and given empty storage of the run dtype on the
   target device: this is the one model-sized allocation;
3. every checkpoint tensor that a served layer needs is read on its own (``weights.CheckpointFiles``:
   positioned reads, no mapping) straight into its parameter, or into a temporary of that one
   tensor's size and then cast; an FP8 weight is dequantized into its parameter one row of scale
   blocks at a time. Peak host memory is therefore about the model plus the largest tensor.

Every tensor is checked once it is in its parameter (after dequantization, in the dtype it is served
in): one holding NaN or Inf fails the load, a :class:`CheckpointError` listing every such tensor
(``torch.isfinite`` over a tensor just read costs little beside reading it).

Tensors of layers that are not served are skipped unread: layers past the target layers and the
MTP layers kept (``mtp_layers`` can keep fewer than the checkpoint has), the MTP layer's copies of
the embedding and head, the indexer of a GLM-5 shared layer. An MTP layer that ``config.json``
names but the weights lack entirely is not served (``ModelConfig.without_absent_mtp``). Anything
else missing or unknown is a :class:`CheckpointError` in one line.

While the tensors are read, a progress bar (``tqdm``, in bytes) is drawn on stderr when stderr is a
terminal; otherwise nothing is written.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import attrs
import torch
from torch import Tensor
from tqdm import tqdm

from pipeline.model.checkpoint import MTP_SHARED_COPIES, dtype_name, parse_dtype, to_checkpoint_name
from pipeline.model.config import (
    ModelConfig,
    ModelConfigError,
    read_config_json,
    resolve_model_dir,
    tensor_names,
)
from pipeline.model.fp8 import FP8_DTYPES, Fp8Config, QuantizationError, dequantize_into
from pipeline.model.model import DeepseekV32
from pipeline.model.weights import CheckpointError, CheckpointFiles

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_SCALE_SUFFIXES = ("weight_scale_inv", "activation_scale", "input_scale")
_FINITE_CHUNK = 1 << 24  # elements checked for NaN / Inf at once (a bool temporary of 16 MiB at most)


def load_model(
    name_or_path: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    *,
    mtp_layers: int | None = None,
    progress: bool | None = None,
) -> DeepseekV32:
    """The model of an HF-format directory (or a bundled name such as ``"tiny"``).

    ``dtype`` defaults to the checkpoint's own (``config.json`` ``dtype``); FP8 weights are
    dequantized to it. ``mtp_layers`` keeps at most that many MTP layers (their weights are not
    read otherwise). ``progress``: draw a progress bar on stderr while the weights are read (None:
    when stderr is a terminal). Raises :class:`ModelConfigError` (field ``model``) for a config it
    cannot serve and :class:`CheckpointError` (a subclass) for weights it cannot load.
    """
    path = resolve_model_dir(name_or_path)
    cfg, quant = read_model_config(path)
    if mtp_layers is not None:
        cfg = attrs.evolve(
            cfg, num_nextn_predict_layers=min(max(mtp_layers, 0), cfg.num_nextn_predict_layers)
        )
    target = parse_dtype(dtype if dtype is not None else cfg.dtype)
    with torch.device("meta"):
        model = DeepseekV32(cfg)
    # cast before loading, so a float64 checkpoint is not rounded through float32 on the way in
    model.to_empty(device=device).to_dtype(target)
    with torch.no_grad(), CheckpointFiles(path) as files:
        load_weights(model, files, quant, progress=progress)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def read_model_config(path: Path) -> tuple[ModelConfig, Fp8Config | None]:
    """``config.json`` of ``path`` -> the model config as served (an MTP layer the weights lack set
    aside) and the FP8 settings (None = unquantized)."""
    raw = read_config_json(path)
    try:
        cfg, quant = ModelConfig.from_hf_dict(raw), Fp8Config.from_hf_dict(raw)
    except ModelConfigError as exc:
        raise ModelConfigError(f"config.json: {exc.rule}", str(path)) from None
    except QuantizationError as exc:
        raise ModelConfigError(f"config.json: {exc}", str(path)) from None
    return (cfg.without_absent_mtp(tensor_names(path)) if cfg.num_nextn_predict_layers else cfg), quant


def load_weights(
    model: DeepseekV32, files: CheckpointFiles, quant: Fp8Config | None, *, progress: bool | None = None
) -> None:
    """Fill every parameter and buffer of ``model`` from ``files``, one tensor at a time (a progress
    bar on stderr, in bytes read, when ``progress``; None: when stderr is a terminal). Missing or
    unknown tensors, and tensors holding NaN or Inf as served, are one :class:`CheckpointError`."""
    where = str(files.path)
    dests, fused = destinations(model)
    filled: set[str] = set()
    unknown: list[str] = []
    checks: list[tuple[str, Tensor]] = []  # (name, is it finite): read back once, after the last tensor
    served = [name for name in files if is_served(name, model.cfg)]  # a weight's scales with it
    with _progress_bar(sum(files.entries[name].nbytes for name in served), progress) as bar:
        for name in served:
            if not name.endswith(_SCALE_SUFFIXES):
                dest = _load_one(name, files, quant, dests, fused, filled, unknown)
                if dest is not None:
                    checks.append((name, all_finite(dest)))
            bar.update(files.entries[name].nbytes)
    missing = [name for name in dests if name not in filled]
    if missing or unknown:
        parts = [
            _listing(what, names) for what, names in (("missing", missing), ("unexpected", unknown)) if names
        ]
        raise CheckpointError("tensors " + "; ".join(parts), where)
    finite = torch.stack([ok for _, ok in checks]).tolist() if checks else []  # one device sync
    bad = [name for (name, _), ok in zip(checks, finite, strict=True) if not ok]
    if bad:
        raise CheckpointError(
            f"{_listing('tensors hold NaN or Inf', bad)} when served as {dtype_name(model.dtype)}", where
        )


def all_finite(tensor: Tensor) -> Tensor:
    """A bool scalar on ``tensor``'s device: no NaN or Inf in it. Large tensors are checked a slice
    of rows at a time, so the temporary stays small."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    if tensor.numel() <= _FINITE_CHUNK or tensor.ndim == 0:
        return torch.isfinite(tensor).all()
    rows = max(1, _FINITE_CHUNK * tensor.shape[0] // tensor.numel())
    return torch.stack([torch.isfinite(part).all() for part in tensor.split(rows)]).all()


def _progress_bar(total: int, progress: bool | None) -> tqdm:
    """The weights' progress bar (bytes); drawn on stderr only when ``progress``, or with None when
    stderr is a terminal."""
    show = progress if progress is not None else sys.stderr.isatty()
    return tqdm(
        total=total,
        desc="loading weights",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not show,
        leave=False,
        file=sys.stderr,
    )


def _load_one(
    name: str,
    files: CheckpointFiles,
    quant: Fp8Config | None,
    dests: dict[str, Tensor],
    fused: dict[str, tuple[Tensor, tuple[str, ...]]],
    filled: set[str],
    unknown: list[str],
) -> Tensor | None:
    """Read one served checkpoint tensor into its destination (noting what it filled); the
    destination, None for an unknown name."""
    if name in fused:
        dest, names = fused[name]
    elif name in dests:
        dest, names = dests[name], (name,)
    else:
        unknown.append(name)
        return None
    where = str(files.path)
    scale = name.removesuffix("weight") + "weight_scale_inv"
    try:
        if scale in files:
            if quant is None:
                raise CheckpointError(f"{scale} is present but config.json has no quantization_config", where)
            dequantize_into(dest, files.read(name), files.read(scale), quant, name)
        elif files.entries[name].dtype in FP8_DTYPES:
            raise CheckpointError(f"{name} is float8 but has no {scale}", where)
        else:
            files.read_into(name, dest)
    except QuantizationError as exc:
        raise CheckpointError(str(exc), where) from None
    filled.update(names)
    return dest


def is_served(name: str, cfg: ModelConfig) -> bool:
    """False for checkpoint tensors the model never reads (see the module docstring)."""
    if "rotary_emb" in name:
        return False
    m = _LAYER.match(name)
    if m is None:
        return True
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= cfg.num_cache_layers:
        return False
    if layer >= cfg.num_hidden_layers:
        return rest not in MTP_SHARED_COPIES
    return not (cfg.indexer_kind(layer) == "shared" and rest.startswith("self_attn.indexer."))


def destinations(model: DeepseekV32) -> tuple[dict[str, Tensor], dict[str, tuple[Tensor, tuple[str, ...]]]]:
    """Checkpoint name -> the view of a parameter or buffer it is read into.

    Routed experts are fused in the model (``gate_up_proj [E, 2I, D]``, ``down_proj [E, D, I]``)
    and per expert in checkpoints; each per-expert name gets its slice. The second table maps the
    fused spelling (HF's in-memory form, also accepted) to the whole tensor and the per-expert
    names it stands for.
    """
    cfg = model.cfg
    inner = cfg.moe_intermediate_size
    dests: dict[str, Tensor] = {}
    fused: dict[str, tuple[Tensor, tuple[str, ...]]] = {}
    for name, tensor in model.state_dict().items():  # detached views of the parameters' storage
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        ckpt = to_checkpoint_name(name, cfg.num_hidden_layers)
        if ckpt.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            prefix, kind = ckpt.rsplit(".", 1)
            names: list[str] = []
            for e in range(tensor.shape[0]):
                if kind == "gate_up_proj":
                    dests[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :inner]
                    dests[f"{prefix}.{e}.up_proj.weight"] = tensor[e, inner:]
                    names += [f"{prefix}.{e}.gate_proj.weight", f"{prefix}.{e}.up_proj.weight"]
                else:
                    dests[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
                    names.append(f"{prefix}.{e}.down_proj.weight")
            fused[ckpt] = (tensor, tuple(names))
        else:
            dests[ckpt] = tensor
    return dests, fused


def _listing(what: str, names: list[str], shown: int = 4) -> str:
    head = ", ".join(names[:shown]) + (f", ... ({len(names) - shown} more)" if len(names) > shown else "")
    return f"{len(names)} {what} ({head})"
