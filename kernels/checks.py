"""Argument checks shared by the op wrappers, and the torch/Triton dispatch rule.

Every wrapper checks shapes, dtypes and strides before it launches anything, and names the offending
argument in a ``ValueError``: a Triton kernel reads out of bounds silently (in the interpreter too),
so a wrong shape must never reach one. Checks that need the *values* of an index tensor cost a
device->host synchronisation on CUDA; they live in ``check_index_range`` / ``check_unique`` and the
wrappers run them only where the op's contract says so (or when asked with ``validate=True``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

import torch

IMPLS = ("auto", "torch", "triton")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= max(n, 1) (Triton block sizes must be powers of two)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it is an optional dependency)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_impl(impl: str, tensors: Sequence[torch.Tensor], *, triton_fits: bool = True) -> str:
    """Pick ``"torch"`` or ``"triton"`` for one call.

    ``auto`` means Triton when every tensor that the kernel reads or writes is on CUDA, Triton is
    installed and the shapes fit the kernel's size limits (``triton_fits``); the torch reference
    otherwise. An explicit ``"triton"`` on CPU tensors is allowed only under the interpreter.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    on_cuda = all(t.is_cuda for t in tensors)
    if impl == "auto":
        return "triton" if on_cuda and triton_fits and triton_available() else "torch"
    if impl == "triton":
        if not triton_available():
            raise ValueError("impl='triton' needs the triton package")
        if not on_cuda and not interpreting():
            raise ValueError("impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
        if not triton_fits:
            raise ValueError("impl='triton': these shapes exceed the kernel's size limits (see docs)")
    return impl


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | Sequence[int] | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    contiguous_last: bool = False,
) -> torch.Tensor:
    """Check one argument; ``None`` in ``shape`` means "any size". Returns the tensor."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            raise ValueError(
                f"{name} must have {' or '.join(map(str, allowed))} dims, got shape {tuple(t.shape)}"
            )
    if dtype is not None:
        allowed_dt = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed_dt:
            raise ValueError(f"{name} must have dtype {' or '.join(map(str, allowed_dt))}, got {t.dtype}")
    if shape is not None and (
        t.dim() != len(shape) or any(w is not None and w != s for w, s in zip(shape, t.shape))
    ):
        want = ", ".join("*" if w is None else str(w) for w in shape)
        raise ValueError(f"{name} must have shape ({want}), got {tuple(t.shape)}")
    if contiguous_last and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got strides {t.stride()}")
    return t


def check_same_device(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """All tensors on one device (the metadata of an op lives beside the rows it addresses)."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        listing = ", ".join(f"{n}={t.device}" for n, t in zip(names, tensors))
        raise ValueError(f"these arguments must share a device: {listing}")


def check_index_range(name: str, idx: torch.Tensor, upper: int, *, allow_negative: bool = False) -> None:
    """Values in ``[0, upper)`` (or -1 where ``allow_negative``). Synchronises on CUDA."""
    if idx.numel() == 0:
        return
    vals = idx[idx >= 0] if allow_negative else idx
    low_ok = bool((idx >= -1).all()) if allow_negative else bool((idx >= 0).all())
    if not low_ok or (vals.numel() and int(vals.max()) >= upper):
        lo, hi = int(idx.min()), int(idx.max())
        bound = "-1 or [0" if allow_negative else "[0"
        raise ValueError(f"{name} values must lie in {bound}, {upper}), got min {lo}, max {hi}")


def check_unique(name: str, idx: torch.Tensor, *, ignore_negative: bool = False) -> None:
    """No value twice (negative values ignored where asked). Synchronises on CUDA."""
    vals = idx[idx >= 0] if ignore_negative else idx.reshape(-1)
    if vals.numel() != torch.unique(vals).numel():
        raise ValueError(f"{name} must not repeat a value")
