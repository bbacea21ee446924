"""The routed experts with fixed shapes, by the implementation a call's tensors allow: the Triton
grouped GEMM (``kernels.moe_triton``, the weights read in place) on CUDA, the batched matmuls of
``kernels.moe_static`` elsewhere. Both keep every shape a function of the problem's size and read
nothing back to the host, so either can be recorded in a CUDA graph."""

from __future__ import annotations

from torch import Tensor

from kernels.checks import resolve_impl
from kernels.moe_static import TRITON_DTYPES, routed_experts_static


def triton_fits(x: Tensor, gate_up: Tensor, down: Tensor) -> bool:
    """Whether ``kernels.moe_triton`` takes these activations and weights (its dtypes, one dtype for
    all three, unit stride in the last dimension)."""
    same = x.dtype in TRITON_DTYPES and gate_up.dtype == x.dtype and down.dtype == x.dtype
    return same and all(t.stride(-1) == 1 for t in (x, gate_up, down))


def routed_experts_fixed(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, *, impl: str = "auto"
) -> Tensor:
    """``routed_experts_static``'s contract by the implementation ``impl`` picks (``"auto"``: the
    Triton grouped GEMM, which reads the weights in place, where every tensor is on CUDA, Triton is
    installed and ``triton_fits``; ``routed_experts_static`` otherwise). Neither reads the routing
    back to the host."""
    tensors = (x, ids, weights, gate_up, down)
    if resolve_impl(impl, tensors, triton_fits=triton_fits(x, gate_up, down)) == "triton":
        from kernels.moe_triton import routed_experts_triton  # (imports triton)

        return routed_experts_triton(x, ids, weights, gate_up, down)
    return routed_experts_static(x, ids, weights, gate_up, down)
