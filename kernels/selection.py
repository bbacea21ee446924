"""Which implementation each hot-path op runs for a model's shapes, and why.

The op wrappers pick an implementation per call (``impl="auto"``: ``kernels.checks.resolve_impl`` and
each op's ``TRITON_MAX_*`` limits). A run's calls all have the shapes of its model, so the choice is
known at start-up: ``select_kernels`` states it for the swap-in, the sparse MLA and the indexer
top-k the way their wrappers make it, and ``log_selected`` logs it once (``kernels.selected``, one
event per op), at warning level where a CUDA run falls back to the torch path, so that no run falls
back silently.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import attrs
import structlog
import torch

from kernels import kv_fp8
from kernels.checks import triton_available

log = structlog.get_logger("hispec.kernels")


@attrs.frozen
class AttentionShapes:
    """The shapes a model's attention calls have (per rank)."""

    heads: int  # query heads of the sparse MLA
    latent: int  # C: the cached latent's width
    rope: int  # R: the rope key's width
    index_heads: int
    index_dim: int
    top_k: int
    hot: int = 0  # HOT: hot columns of a request's device buffer; 0 without HiSparse (no swap-in)
    extra: int = 0  # newest + draft columns of the buffer (one page)
    near: int = 0  # positions the indexer ranks past the top-k for a near-policy (0: none)


@attrs.frozen
class KernelChoice:
    op: str  # "swap_in", "sparse_mla" or "indexer_topk"
    impl: str  # what ``impl="auto"`` runs: "triton", "torch", "numba", ...
    reason: str


def _op(name: str) -> ModuleType:
    """An op's module (``kernels`` binds the op's name to its function)."""
    return importlib.import_module(f"kernels.{name}")


def _over(limits: list[tuple[str, int, int]]) -> list[str]:
    return [f"{name} {value} > {limit}" for name, value, limit in limits if value > limit]


def swap_in_limits(shapes: AttentionShapes) -> list[str]:
    """The Triton swap-in's limits these shapes exceed (none: it takes them)."""
    swap_op = _op("swap_in")
    return _over([
        ("hot", shapes.hot, swap_op.TRITON_MAX_HOT),
        ("top_k", shapes.top_k, swap_op.TRITON_MAX_TOP_K),
        ("newest/draft columns", shapes.extra, swap_op.TRITON_MAX_EXTRA),
        ("near", shapes.near, swap_op.TRITON_MAX_NEAR),
    ])


def sparse_mla_limits(shapes: AttentionShapes, dtype: torch.dtype, kv_dtype: torch.dtype) -> list[str]:
    """The Triton sparse MLA's limits these shapes and dtypes exceed (an FP8 cache: the FP8
    kernel's, whose module needs ``triton``)."""
    if kv_dtype == kv_fp8.STORAGE:
        fp8_op = _op("sparse_mla_fp8_triton")
        out = ["dtype is float64"] if dtype == torch.float64 else []
        limits = [("latent", shapes.latent, fp8_op.MAX_LATENT), ("rope", shapes.rope, fp8_op.MAX_ROPE)]
        return out + _over(limits)
    mla_op = _op("sparse_mla")
    pairs = (("dtype", dtype), ("kv dtype", kv_dtype))
    out = [f"{name} is float64" for name, dt in pairs if dt == torch.float64]
    return out + _over([
        ("latent", shapes.latent, mla_op.TRITON_MAX_LATENT),
        ("rope", shapes.rope, mla_op.TRITON_MAX_ROPE),
    ])


def indexer_limits(shapes: AttentionShapes, dtype: torch.dtype) -> list[str]:
    """The Triton indexer top-k's limits these shapes and dtypes exceed."""
    indexer_op = _op("indexer_topk")
    out = ["dtype is float64"] if dtype == torch.float64 else []
    return out + _over([
        ("top_k", shapes.top_k, indexer_op.TRITON_MAX_TOP_K),
        ("index heads", shapes.index_heads, indexer_op.TRITON_MAX_HEADS),
        ("index dim", shapes.index_dim, indexer_op.TRITON_MAX_DIM),
    ])


def _cuda_choice(op: str, limits: Callable[[], list[str]], *, fp8: bool = False) -> KernelChoice:
    if not triton_available():
        return KernelChoice(op, "torch", "the triton package is not installed")
    exceeded = limits()
    if exceeded:
        return KernelChoice(op, "torch", "the Triton kernel does not take: " + ", ".join(exceeded))
    if fp8:
        return KernelChoice(op, "triton-fp8", "CUDA, an FP8 cache, within the FP8 Triton kernel's limits")
    return KernelChoice(op, "triton", "CUDA, within the Triton kernel's limits")


def _cpu_choices(dtype: torch.dtype, shapes: AttentionShapes, *, fp8: bool) -> list[KernelChoice]:
    from kernels import indexer_topk_numba, sparse_mla_numba

    compiled = dtype in (torch.float32, torch.float64)
    out = []
    if shapes.hot:
        reason = "CPU: the compiled loops (a few tensor ops for a call wholly on the fast path)"
        out.append(KernelChoice("swap_in", "numba", reason))
    if not compiled:
        reason = f"CPU, {dtype}: the compiled loops read float32/64 only"
        out.append(KernelChoice("sparse_mla", "torch", reason))
        out.append(KernelChoice("indexer_topk", "torch", reason))
        return out
    if fp8:
        out.append(KernelChoice("sparse_mla", "torch", "CPU, an FP8 cache: rows dequantized as gathered"))
    elif sparse_mla_numba.pays_for(shapes.heads, shapes.latent + shapes.rope, shapes.top_k):
        out.append(KernelChoice("sparse_mla", "numba", "CPU, a query small enough for the compiled loop"))
    else:
        out.append(KernelChoice("sparse_mla", "torch", "CPU, a query too large for the compiled loop to pay"))
    if indexer_topk_numba.pays_for(shapes.index_heads, shapes.index_dim):
        out.append(KernelChoice("indexer_topk", "numba+torch",
                                "CPU: decode, verify and short prefill compiled, long prefill by matmuls"))
    else:
        reason = "CPU, an indexer too wide for the compiled loop to pay"
        out.append(KernelChoice("indexer_topk", "torch", reason))
    return out


def select_kernels(
    device: torch.device | str,
    dtype: torch.dtype,
    shapes: AttentionShapes,
    *,
    kv_dtype: torch.dtype | None = None,
) -> tuple[KernelChoice, ...]:
    """What ``impl="auto"`` runs for calls of ``shapes`` in ``dtype`` on ``device`` (the swap-in only
    with HiSparse, ``shapes.hot > 0``); ``kv_dtype``: the cache rows' dtype (``dtype`` if None;
    ``kernels.kv_fp8.STORAGE`` for an FP8 cache, whose keys and rows the FP8 kernels read on CUDA)."""
    kind = torch.device(device).type
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    fp8 = kv_dtype == kv_fp8.STORAGE
    if kind == "cuda":
        out = [_cuda_choice("swap_in", lambda: swap_in_limits(shapes))] if shapes.hot else []
        out.append(_cuda_choice("sparse_mla", lambda: sparse_mla_limits(shapes, dtype, kv_dtype), fp8=fp8))
        out.append(_cuda_choice("indexer_topk", lambda: indexer_limits(shapes, dtype), fp8=fp8))
        return tuple(out)
    if kind == "cpu":
        return tuple(_cpu_choices(dtype, shapes, fp8=fp8))
    ops = (["swap_in"] if shapes.hot else []) + ["sparse_mla", "indexer_topk"]
    return tuple(KernelChoice(op, "torch", f"{kind}: neither CUDA nor CPU") for op in ops)


def log_selected(
    device: torch.device | str,
    dtype: torch.dtype,
    shapes: AttentionShapes,
    *,
    kv_dtype: torch.dtype | None = None,
) -> tuple[KernelChoice, ...]:
    """Log ``select_kernels`` (``kernels.selected``, one event per op; a warning where CUDA falls back
    to torch) and return it."""
    choices = select_kernels(device, dtype, shapes, kv_dtype=kv_dtype)
    cuda = torch.device(device).type == "cuda"
    for c in choices:
        emit = log.warning if cuda and c.impl == "torch" else log.info
        emit("kernels.selected", op=c.op, impl=c.impl, reason=c.reason, device=str(device), dtype=str(dtype),
             **attrs.asdict(shapes))
    return choices
