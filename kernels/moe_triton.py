"""Triton routed experts over ``kernels.moe_static``'s expert-aligned layout (a grouped GEMM);
imported only when a Triton path is taken.

``align_by_expert`` sorts the token-slots by expert into blocks of ``block`` padded positions, one
expert per block. Two launches, each a grid over ``(max_blocks, output tiles)``: a program reads
its block's expert from ``block_expert`` and returns at once for a -1 (a block past the used ones),
so the grid's size is fixed by the shapes while the work follows the routing. The first computes
``silu(x W_gate^T) * (x W_up^T)`` for the block's rows into a ``[max_blocks * block, I]`` buffer;
the second ``act W_down^T``, rounds it to the activations' dtype, weights it in the weights' (wide)
dtype, rounds again and writes each real row to its token-slot's row of a ``[N * k, D]`` buffer
(every slot exactly once). ``moe_static.add_in_expert_order`` then adds each token's
contributions in expert order, the module path's order. Weights are read where they lie: no
gathered copies, unlike ``routed_experts_static``, whose arithmetic this is to rounding (the dots
accumulate in float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import next_power_of_2
from kernels.moe_static import TRITON_DTYPES, add_in_expert_order, align_by_expert
from kernels.triton_util import dot_dtype

DTYPES = TRITON_DTYPES
# the alignment block: tl.dot needs every tile side >= 16
BLOCK = 16


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, slots_ptr, experts_ptr, act_ptr,
    M, K, padded_len,
    x_stride, w_stride_e, w_stride_r, act_stride,
    DIM: tl.constexpr, INNER: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.load(experts_ptr + b)
    if e < 0:
        return
    r = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: rows times strides can pass 2**31
    slot = tl.load(slots_ptr + r, mask=r < padded_len, other=M)
    real = slot < M
    token = slot // K
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_in = i < INNER
    w_base = w_ptr + e * w_stride_e
    acc_gate = tl.zeros((BLOCK, BLOCK_I), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK, BLOCK_I), dtype=tl.float32)
    for d0 in range(0, DIM, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_in = d < DIM
        rows = tl.load(x_ptr + token[:, None] * x_stride + d[None, :],
                       mask=real[:, None] & d_in[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK, BD]
        w_mask = i_in[:, None] & d_in[None, :]
        w_gate = tl.load(w_base + i[:, None] * w_stride_r + d[None, :], mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (INNER + i)[:, None] * w_stride_r + d[None, :], mask=w_mask, other=0.0)
        acc_gate += tl.dot(rows, tl.trans(w_gate.to(DOT_DTYPE)), input_precision="ieee")
        acc_up += tl.dot(rows, tl.trans(w_up.to(DOT_DTYPE)), input_precision="ieee")
    # the module path rounds both projections to the activations' dtype before the SwiGLU
    gate = acc_gate.to(act_ptr.dtype.element_ty).to(tl.float32)
    up = acc_up.to(act_ptr.dtype.element_ty).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + r[:, None] * act_stride + i[None, :], act.to(act_ptr.dtype.element_ty),
             mask=i_in[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, slots_ptr, experts_ptr, weights_ptr, out_ptr,
    M, padded_len,
    act_stride, w_stride_e, w_stride_r, out_stride,
    DIM: tl.constexpr, INNER: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.load(experts_ptr + b)
    if e < 0:
        return
    r = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: rows times strides can pass 2**31
    slot = tl.load(slots_ptr + r, mask=r < padded_len, other=M)
    real = slot < M
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = n < DIM
    w_base = w_ptr + e * w_stride_e
    acc = tl.zeros((BLOCK, BLOCK_N), dtype=tl.float32)
    for i0 in range(0, INNER, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        i_in = i < INNER
        act = tl.load(act_ptr + r[:, None] * act_stride + i[None, :], mask=i_in[None, :], other=0.0)
        w = tl.load(w_base + n[:, None] * w_stride_r + i[None, :], mask=n_in[:, None] & i_in[None, :],
                    other=0.0)
        acc += tl.dot(act.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision="ieee")
    weight = tl.load(weights_ptr + slot, mask=real, other=0.0)  # [BLOCK], the wide dtype
    y = acc.to(out_ptr.dtype.element_ty).to(weight.dtype) * weight[:, None]
    tl.store(out_ptr + slot[:, None] * out_stride + n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=real[:, None] & n_in[None, :])


def _check(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
           down: torch.Tensor) -> None:
    if x.dtype not in DTYPES or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        got = f"{x.dtype}, {gate_up.dtype}, {down.dtype}"
        raise ValueError(f"x, gate_up, down must share one of {DTYPES}, got {got}")
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3 or ids.dim() != 2:
        raise ValueError("x must be [N, D], ids [N, k], gate_up [E, 2I, D], down [E, D, I]")
    num_experts, two_inner, dim = gate_up.shape
    if x.shape[1] != dim or down.shape != (num_experts, dim, two_inner // 2) or two_inner % 2:
        shapes = f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}"
        raise ValueError(f"shapes disagree: {shapes}")
    if weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        shapes = f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)}"
        raise ValueError(f"{shapes} must be [N, k], N = {x.shape[0]}")
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension")


def routed_experts_triton(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """``routed_experts_static``'s contract (``x [N, D]``, ``ids / weights [N, k]``, ``gate_up
    [E, 2I, D]``, ``down [E, D, I]`` -> ``[N, D]``) as two grouped-GEMM launches; float16, bfloat16
    or float32 activations and expert weights of that dtype."""
    _check(x, ids, weights, gate_up, down)
    num_tokens, dim = x.shape
    num_experts, two_inner, _ = gate_up.shape
    inner = two_inner // 2
    k = ids.shape[1]
    num_slots = num_tokens * k
    if num_slots == 0:
        return torch.zeros_like(x)
    align = align_by_expert(ids, num_experts, BLOCK)
    max_blocks = align.block_expert.numel()
    padded_len = align.token_slots.numel()
    act = x.new_empty(max_blocks * BLOCK, inner)
    contrib = x.new_empty(num_slots, dim)
    flat_weights = weights.reshape(-1).contiguous()
    block_i = min(64, max(16, next_power_of_2(inner)))
    block_d = min(64, max(16, next_power_of_2(dim)))
    dot = dot_dtype(x)
    _gate_up_kernel[(max_blocks, triton.cdiv(inner, block_i))](
        x, gate_up, align.token_slots, align.block_expert, act,
        num_slots, k, padded_len,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        DIM=dim, INNER=inner, BLOCK=BLOCK, BLOCK_I=block_i, BLOCK_D=block_d, DOT_DTYPE=dot,
    )
    _down_kernel[(max_blocks, triton.cdiv(dim, block_d))](
        act, down, align.token_slots, align.block_expert, flat_weights, contrib,
        num_slots, padded_len,
        act.stride(0), down.stride(0), down.stride(1), contrib.stride(0),
        DIM=dim, INNER=inner, BLOCK=BLOCK, BLOCK_N=block_d, BLOCK_I=block_i, DOT_DTYPE=dot,
    )
    return add_in_expert_order(contrib.view(num_tokens, k, dim), ids)
