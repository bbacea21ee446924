"""DeepSeek-V3 mixture of experts: sigmoid router with a bias-corrected, group-limited top-k.

Routing of one token:

    score   = sigmoid(x @ W_gate^T)                      (wide dtype)
    choice  = score + e_score_correction_bias            (the bias only steers selection)
    groups  = top ``topk_group`` of ``n_group`` groups, a group scored by the sum of its best two choices
    experts = top ``num_experts_per_tok`` choices inside the kept groups
    weight  = score[experts] (/ their sum if norm_topk_prob) * routed_scaling_factor

The output is ``sum_e weight_e * expert_e(x) + shared_experts(x)``. Expert weights are stored fused, as
HF transformers holds them in memory: ``gate_up_proj [E, 2I, D]`` (gate rows first) and
``down_proj [E, D, I]``; checkpoints use per-expert tensors (see ``checkpoint.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.moe_fixed import routed_experts_fixed
from pipeline.model.config import ModelConfig
from pipeline.model.layers import DenseMLP, wide_dtype


class TopkRouter(nn.Module):
    """Picks experts and their weights; ``weight`` and the bias stay in the wide dtype (see
    ``cast_model``)."""

    e_score_correction_bias: Tensor  # [E], a buffer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        # Not trained by gradients: the loss-free balancing rule nudges it (see the trainer).
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def scores(self, x: Tensor) -> Tensor:  # [N, D] -> [N, E] sigmoid scores, wide dtype
        wide = wide_dtype(x.dtype)
        return torch.sigmoid(F.linear(x.to(wide), self.weight.to(wide)))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x [N, D]`` -> ``(expert ids [N, k] int64, weights [N, k] wide dtype)``."""
        cfg = self.cfg
        scores = self.scores(x)  # [N, E]
        choice = scores + self.e_score_correction_bias.to(scores.dtype)
        per_group = cfg.n_routed_experts // cfg.n_group
        grouped = choice.view(-1, cfg.n_group, per_group)  # [N, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        kept = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False).indices  # [N, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        expert_mask = group_mask[:, :, None].expand(-1, -1, per_group).reshape(-1, cfg.n_routed_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False).indices  # [N, k]
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * cfg.routed_scaling_factor


class RoutedExperts(nn.Module):
    """``E`` SwiGLU experts in two fused tensors.

    ``static_shapes`` (off by default; a plain attribute, so it can be switched on a built model)
    selects ``kernels.moe_fixed.routed_experts_fixed``: the same sum with every tensor shape fixed
    by ``(N, k, E)`` and no host read of the routing, which a CUDA graph capture needs (on CUDA the
    Triton grouped GEMM, elsewhere padded matmuls over gathered weight copies: its docstring). Off,
    the forward loops over the experts the routing uses, reading them on the host."""

    def __init__(self, cfg: ModelConfig, *, static_shapes: bool = False) -> None:
        super().__init__()
        self.static_shapes = static_shapes
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """``x [N, D]``, ``ids/weights [N, k]`` -> ``[N, D]``; accumulated in the activations'
        dtype, expert by expert (in expert order, whichever path)."""
        if self.static_shapes:
            return routed_experts_fixed(x, ids, weights, self.gate_up_proj, self.down_proj)
        out = torch.zeros_like(x)
        flat_ids = ids.reshape(-1)  # [N * k]
        for expert in torch.unique(flat_ids).tolist():
            token, slot = torch.nonzero(ids == expert, as_tuple=True)  # tokens routed to this expert
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])  # [n, D]
            # HF multiplies by the wide-dtype weight, then casts back before accumulating
            y = (y * weights[token, slot, None]).to(out.dtype)
            out = out.index_add(0, token, y)
        return out


class MoE(nn.Module):
    """Routed experts plus ``n_shared_experts`` always-on experts (one MLP of width ``n * I``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = TopkRouter(cfg)
        self.experts = RoutedExperts(cfg)
        self.shared_experts: DenseMLP | None = (
            DenseMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts > 0
            else None
        )

    def forward(self, x: Tensor) -> Tensor:  # [..., D] -> [..., D]
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, weights = self.gate(flat)
        out = self.experts(flat, ids, weights).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
