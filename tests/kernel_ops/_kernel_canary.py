"""Canary helpers for the Triton kernels under the interpreter.

A Triton kernel reads and writes out of bounds silently (in the interpreter too, which runs on the
tensors' own storage), so the tests surround every buffer a kernel touches with canary memory:

* ``embed(x, pad, fill)``: a copy of ``x`` living inside a larger tensor of ``fill`` (``pad[d]``
  extra elements after dim ``d``, and ``lead`` whole slices before dim 0), so that the kernel gets
  the same values with padded strides, and any read outside the view meets the canary;
* ``CanaryOutputs``: the kernel wrappers allocate their outputs themselves (no ``out=`` argument),
  so this replaces the module's ``torch`` by a proxy whose ``empty`` / ``empty_like`` hand out
  contiguous views in the middle of a flat buffer of a sentinel; after the call every element of
  each output must have been written (no sentinel left) and the flat canaries around it untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch


def _pad(n: int) -> int:
    """Sentinel elements before and after an output of ``n`` elements: more than a kernel that
    ignored its masks would overrun by (a whole block past the end), so that such a write lands in
    the sentinel rather than in someone else's memory."""
    return 4 * n + 4096


def embed(x: torch.Tensor, pad: Sequence[int], fill: Callable | float, *, lead: int = 0) -> torch.Tensor:
    """``x`` as a view into a tensor ``lead + x.shape[0] + pad[0]`` x ``x.shape[1] + pad[1]`` x ...
    whose other elements are ``fill`` (a scalar, or ``fill(shape, dtype)`` giving the full tensor)."""
    assert len(pad) == x.dim()
    shape = [s + p for s, p in zip(x.shape, pad)]
    shape[0] += lead
    full = fill(tuple(shape), x.dtype) if callable(fill) else torch.full(shape, fill, dtype=x.dtype)
    index = (slice(lead, lead + x.shape[0]), *(slice(0, s) for s in x.shape[1:]))
    view = full[index]
    view.copy_(x)
    return view


def root(x: torch.Tensor) -> torch.Tensor:
    """The tensor a view (from ``embed``) lives in."""
    return x if x._base is None else x._base


def snapshot(args: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of every argument's whole storage (its canaries included), for ``assert_unchanged``."""
    return {name: root(t).clone() for name, t in args.items()}


def assert_unchanged(args: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    """No argument, nor the canary memory around it, was written (NaN canaries compare equal)."""
    for name, t in args.items():
        torch.testing.assert_close(
            root(t), before[name], rtol=0, atol=0, equal_nan=True, msg=f"{name} changed"
        )


def sentinel(dtype: torch.dtype) -> float | int:
    return float("nan") if dtype.is_floating_point else -7


class _TorchProxy:
    def __init__(self, owner: CanaryOutputs) -> None:
        self._owner = owner

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def empty(self, *size, dtype=None, device=None, **kwargs):
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else tuple(size)
        return self._owner.allocate(shape, dtype or torch.get_default_dtype(), device)

    def empty_like(self, x, *, dtype=None, device=None, **kwargs):
        return self._owner.allocate(tuple(x.shape), dtype or x.dtype, device or x.device)


class CanaryOutputs:
    """Install with ``monkeypatch.setattr(module, "torch", outputs.proxy)``; then ``check()``."""

    def __init__(self) -> None:
        self.proxy = _TorchProxy(self)
        self.allocated: list[tuple[torch.Tensor, torch.Tensor, float | int]] = []  # (flat, view, fill)

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        n = math.prod(shape)
        fill = sentinel(dtype)
        pad = _pad(n)
        flat = torch.full((n + 2 * pad,), fill, dtype=dtype, device=device)
        view = flat[pad : pad + n].view(shape)
        self.allocated.append((flat, view, fill))
        return view

    def check(self) -> None:
        assert self.allocated, "the kernel allocated no output through torch.empty / empty_like"
        for flat, view, fill in self.allocated:
            pad = _pad(view.numel())
            outside = torch.cat([flat[:pad], flat[-pad:]])
            written = view.reshape(-1)
            if isinstance(fill, float):
                assert bool(outside.isnan().all()), f"a write outside an output of shape {tuple(view.shape)}"
                assert not bool(written.isnan().any()), (
                    f"a NaN in an output of shape {tuple(view.shape)}: not written, or computed from a canary"
                )
            else:
                assert bool((outside == fill).all()), (
                    f"a write outside an output of shape {tuple(view.shape)}"
                )
                assert not bool((written == fill).any()), (
                    f"an output element of {tuple(view.shape)} not written"
                )


def strided_last(x: torch.Tensor) -> torch.Tensor:
    """The same values, but a last-dim stride of 2."""
    out = torch.stack([x, x], dim=-1)[..., 0]
    assert out.shape == x.shape and (x.dim() == 0 or x.shape[-1] < 2 or out.stride(-1) == 2)
    return out
