"""Routed experts with tensor shapes fixed by the problem's size, never by the routing.

The module path (``pipeline.model.moe.RoutedExperts``) loops over ``unique(ids).tolist()`` and
finds each expert's tokens with ``nonzero``: the host reads the routing and every shape after it
follows the routing, so a decode step cannot be captured in a CUDA graph. Here every shape is a
function of ``(N tokens, k, E experts, D, I, block)`` only, and nothing is read back to the host.

The layout (``align_by_expert``) is the one a grouped-GEMM kernel uses. The ``M = N * k``
token-slots (slot ``t * k + j``: token ``t``'s ``j``-th choice) are sorted by expert, and each
expert's run is padded to a multiple of ``block``; padding holds the sentinel ``M``::

    token_slots  | e0 e0 e0 M | e2 e2 M M | e3 e3 e3 e3 | M M M M | M M M M |
    block_expert |     0      |     2     |      3      |   -1    |   -1    |

    length M + E * (block - 1), always: the most the padded runs can take (an expert with c slots
    takes ceil(c / block) blocks; one with none takes no block); the blocks past the used ones are
    marked -1.

``routed_experts_static`` computes every block as one batched matmul against its expert's weights
and puts each token's contributions back in expert order, so a token's sum is the module path's
sum, term for term. ``ids`` must lie in ``[0, E)`` (the router's output does): nothing checks it,
since a check is a host read. ``kernels.moe_fixed.routed_experts_fixed`` is what the model calls:
on CUDA the Triton grouped GEMM over the same layout (``kernels.moe_triton``, the weights read in
place), elsewhere ``routed_experts_static``.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

# the most expert-weight elements (gate_up and down together) one chunk of blocks gathers: bounds
# the gathered copies' memory whatever the model's size
CHUNK_ELEMENTS = 1 << 24
# the activations' and weights' dtypes ``kernels.moe_triton`` takes
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@attrs.frozen
class ExpertAlignment:
    """Token-slots grouped by expert in padded blocks (see the module docstring's picture).

    Every shape depends on ``(N, k, E, block)`` only."""

    # [M + E * (block - 1)] int64: the token-slot at each padded position; M (= N * k) for padding
    token_slots: Tensor
    # [max_blocks] int64: the expert of each block of ``block`` positions; -1 for a block past the
    # used ones (max_blocks = ceil(len(token_slots) / block))
    block_expert: Tensor
    # [M] int64: the padded position of each token-slot (the inverse of ``token_slots``)
    slot_position: Tensor
    # [] int64: how many padded positions the used blocks cover (a multiple of ``block``)
    num_padded: Tensor
    block: int


def max_padded(num_slots: int, num_experts: int, block: int) -> int:
    """The padded length for ``num_slots`` token-slots over ``num_experts`` experts: each expert's
    run rounds up by at most ``block - 1``."""
    return num_slots + num_experts * (block - 1)


def align_by_expert(ids: Tensor, num_experts: int, block: int) -> ExpertAlignment:
    """Group the token-slots of ``ids [N, k]`` (ints in ``[0, num_experts)``) by expert, each expert's
    run padded to a multiple of ``block``; stable, so an expert's slots keep token order."""
    if ids.dim() != 2:
        raise ValueError(f"ids must be [N, k], got shape {tuple(ids.shape)}")
    if block < 1 or num_experts < 1:
        raise ValueError(f"block ({block}) and num_experts ({num_experts}) must be positive")
    device = ids.device
    flat = ids.reshape(-1).long()  # [M]
    num_slots = flat.numel()
    padded_len = max_padded(num_slots, num_experts, block)
    max_blocks = -(-padded_len // block)
    # per-expert counts by scatter_add into a fixed [E] (bincount's length would follow the values)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block - 1) // block * block  # [E]
    padded_end = torch.cumsum(padded_counts, 0)  # [E]
    padded_start = padded_end - padded_counts
    start = torch.cumsum(counts, 0) - counts  # [E] first sorted index of each expert
    order = torch.argsort(flat, stable=True)  # [M] token-slots in expert order
    sorted_experts = flat.index_select(0, order)
    rank = torch.arange(num_slots, device=device) - start.index_select(0, sorted_experts)
    position = padded_start.index_select(0, sorted_experts) + rank  # [M] padded position, sorted
    token_slots = torch.full((padded_len,), num_slots, dtype=torch.int64, device=device)
    token_slots.scatter_(0, position, order)
    slot_position = torch.empty_like(position).scatter_(0, order, position)
    block_first = torch.arange(max_blocks, device=device) * block  # [max_blocks]
    expert = torch.searchsorted(padded_end, block_first, right=True)  # E past the used blocks
    block_expert = torch.where(expert < num_experts, expert, torch.full_like(expert, -1))
    return ExpertAlignment(token_slots, block_expert, slot_position, padded_end[-1], block)


def default_block(num_slots: int, num_experts: int) -> int:
    """A block of about ``M / E`` slots (a power of two): the padding then adds fewer than ``2 M``
    rows and the blocks number at most ``2 E + 1``, so neither the matmuls nor the gathered
    weights grow beyond a small multiple of the module path's (see ``routed_experts_static``)."""
    per_expert = max(1, -(-num_slots // num_experts))
    return 1 << (per_expert - 1).bit_length()


def routed_experts_static(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, block: int | None = None
) -> Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every token, SwiGLU experts
    ``gate_up [E, 2I, D]`` (gate rows first) and ``down [E, D, I]``; ``x [N, D]``, ``ids / weights
    [N, k]`` -> ``[N, D]`` in ``x``'s dtype, with fixed shapes and no host read.

    The module path's contract: each contribution is weighted in the weights' (wide) dtype, cast to
    ``x``'s dtype, and a token's contributions are added to zeros in expert order. The products are
    batched matmuls rather than one matmul per expert, so they agree with the module path to
    rounding (the tests hold float64 to 1e-12).

    Cost, with ``P = M + E (block - 1)`` padded positions in ``B = ceil(P / block)`` blocks
    (``M = N k``): the matmuls compute ``B block`` rows where the module path computes ``M``
    (padding and unused blocks included), and each block gathers a copy of its expert's weights
    (``B`` copies of ``3 I D`` elements, at most ``CHUNK_ELEMENTS`` held at once). With the default
    block (about ``M / E``) that is fewer than ``3 M + block`` rows and at most ``2 E + 1`` weight
    copies; a decode step (``M <= E``) has ``block = 1``: ``M`` rows and ``M`` copies, no padding.
    A kernel that reads the weights in place (``kernels.moe_triton``, a grouped GEMM over the same
    layout) saves the copies.
    """
    num_tokens, dim = x.shape
    num_experts, two_inner, _ = gate_up.shape
    k = ids.shape[1]
    num_slots = num_tokens * k
    if num_slots == 0:
        return torch.zeros_like(x)
    if block is None:
        block = default_block(num_slots, num_experts)
    align = align_by_expert(ids, num_experts, block)
    max_blocks = align.block_expert.numel()
    # the sentinel slot M reads token N: a zero row of x, weight 0
    x_pad = torch.cat([x, x.new_zeros(1, dim)])
    w_pad = torch.cat([weights.reshape(-1), weights.new_zeros(1)])
    # the last block may reach past the padded length: more sentinels fill it
    tail = max_blocks * block - align.token_slots.numel()
    slots = torch.cat([align.token_slots, align.token_slots.new_full((tail,), num_slots)])
    rows = x_pad.index_select(0, torch.div(slots, k, rounding_mode="floor"))
    rows = rows.view(max_blocks, block, dim)
    # an unused block computes with expert 0 on padding rows; its results are never read
    experts = align.block_expert.clamp(min=0)
    chunk = max(1, CHUNK_ELEMENTS // (3 * two_inner // 2 * dim))
    parts = []
    for first in range(0, max_blocks, chunk):  # a count fixed by the shapes
        part = experts[first : first + chunk]
        h = torch.bmm(rows[first : first + chunk], gate_up.index_select(0, part).transpose(1, 2))
        gate, up = h.chunk(2, dim=-1)  # [c, block, I] each
        parts.append(torch.bmm(F.silu(gate) * up, down.index_select(0, part).transpose(1, 2)))
    # weight in the wide dtype, then back to x's dtype, as the module path does
    y = (torch.cat(parts).view(-1, dim) * w_pad.index_select(0, slots)[:, None]).to(x.dtype)
    return add_in_expert_order(y.index_select(0, align.slot_position).view(num_tokens, k, dim), ids)


def add_in_expert_order(contrib: Tensor, ids: Tensor) -> Tensor:
    """``contrib [N, k, D]`` (token ``t``'s ``j``-th choice's weighted output) summed per token
    into zeros in the order of ``ids [N, k]``'s experts, as the module path's ``index_add`` per
    expert adds them -> ``[N, D]``."""
    num_tokens, k, dim = contrib.shape
    by_expert = torch.argsort(ids, dim=1, stable=True)  # a token's slots in expert order
    contrib = contrib.gather(1, by_expert[:, :, None].expand(-1, -1, dim))
    out = contrib.new_zeros(num_tokens, dim)
    for j in range(k):
        out = out + contrib[:, j]
    return out
