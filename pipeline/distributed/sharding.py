"""Megatron-style tensor-parallel sharding of the model: which rank holds which slice of each weight.

``shard_model(model, group)`` replaces, in place, the modules of a ``DeepseekV32`` (real or on the
``meta`` device) by their shard on ``group.rank`` and returns the :class:`ShardSpec` of every sliced
tensor (the rest are replicated). Per layer, with ``N`` ranks::

    embed_tokens     vocabulary rows split      lookup of the local ids, then one all-reduce (sum)
    MLA q_b_proj     heads split (output rows)  q_a_proj, kv_a_proj_with_mqa and the norms replicated:
    MLA kv_b_proj    heads split (output rows)  every rank computes the same latent KV row and keeps
    MLA o_proj       heads split (input cols)   the whole KV cache (as SGLang does for MLA), then one
                                                all-reduce (sum) of the partial outputs
    indexer          replicated                 every rank computes the same top-k, so every rank's
                                                HiSparse buffers hold the same rows
    dense MLP        gate/up column split, down row split, one all-reduce
    MoE              router replicated; routed experts split (rank r holds a contiguous range of
                     experts); the shared experts column/row split; one all-reduce of the sum
    lm_head          vocabulary rows split      local logits, then one all-gather

So a decoder layer costs two all-reduces of ``[T, D]``, and a forward one more for the embedding
and one all-gather of the logits. Splits need not be even: rank ``r`` of ``N`` holds entries
``[r * n // N, (r + 1) * n // N)`` of a dimension of size ``n`` (``shard_range``); a rank may hold no
expert at all. Why the indexer is replicated rather than split: its top-k decides which rows HiSparse
swaps in, and summing per-rank partial scores would cost an all-reduce of ``[T, positions]`` per layer
while the indexer's weights are small (one key head, a few query heads).
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline.distributed.group import TensorGroup
from pipeline.model.attention import MlaAttention
from pipeline.model.layers import DenseMLP
from pipeline.model.model import DeepseekV32
from pipeline.model.moe import MoE


def shard_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """The entries ``[start, stop)`` of a dimension of size ``n`` that ``rank`` of ``size`` holds."""
    return rank * n // size, (rank + 1) * n // size


def shard_sizes(n: int, size: int) -> list[int]:
    return [b - a for a, b in (shard_range(n, size, r) for r in range(size))]


@attrs.frozen
class ShardSpec:
    """A tensor holding entries ``[start, stop)`` of dimension ``dim`` of the full one."""

    dim: int
    start: int
    stop: int


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, stop)`` of the embedding; ids outside give zeros before the all-reduce."""

    def __init__(self, weight: Tensor, start: int, group: TensorGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.group = group

    def forward(self, ids: Tensor) -> Tensor:  # [T] -> [T, D]
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.group.all_reduce(out.masked_fill(~inside[..., None], 0))


class VocabParallelHead(nn.Module):
    """Rows ``[start, stop)`` of ``lm_head``: local logits, all-gathered to the whole vocabulary."""

    def __init__(self, weight: Tensor | nn.Parameter, sizes: list[int], group: TensorGroup) -> None:
        super().__init__()
        if not isinstance(weight, nn.Parameter):
            weight = nn.Parameter(weight, requires_grad=False)
        self.weight = weight
        self.sizes = sizes
        self.group = group

    def forward(self, hidden: Tensor) -> Tensor:  # [T, D] -> [T, V]
        return self.group.all_gather(F.linear(hidden, self.weight), self.sizes)


class RowParallelLinear(nn.Module):
    """Input columns ``[start, stop)`` of a linear layer: partial products, summed by one all-reduce."""

    def __init__(self, weight: Tensor, group: TensorGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group  # None: the caller reduces (the shared experts of a MoE layer)

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight)
        return out if self.group is None else self.group.all_reduce(out)


class LocalExperts(nn.Module):
    """Routed experts ``[first, first + n)``, fused as ``RoutedExperts`` stores them; the tokens routed
    to other experts get nothing here (their rank adds it)."""

    def __init__(self, gate_up_proj: Tensor, down_proj: Tensor, first: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj, requires_grad=False)  # [n, 2I, D]
        self.down_proj = nn.Parameter(down_proj, requires_grad=False)  # [n, D, I]
        self.first = first

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """``x [N, D]``, ``ids/weights [N, k]`` (global expert ids) -> ``[N, D]``, this rank's part."""
        out = torch.zeros_like(x)
        stop = self.first + self.gate_up_proj.shape[0]
        for expert in torch.unique(ids.reshape(-1)).tolist():
            if not self.first <= expert < stop:
                continue
            token, slot = torch.nonzero(ids == expert, as_tuple=True)
            gate, up = F.linear(x[token], self.gate_up_proj[expert - self.first]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert - self.first])
            out = out.index_add(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out


class ShardedMoE(nn.Module):
    """``MoE`` over a range of experts and a slice of the shared experts: one all-reduce per layer."""

    def __init__(self, moe: MoE, group: TensorGroup, specs: dict[str, ShardSpec], prefix: str) -> None:
        super().__init__()
        self.group = group
        self.gate = moe.gate  # replicated: every rank routes every token the same way
        first, stop = shard_range(moe.experts.gate_up_proj.shape[0], group.size, group.rank)
        gate_up = _narrow(moe.experts.gate_up_proj, 0, first, stop)
        self.experts = LocalExperts(gate_up, _narrow(moe.experts.down_proj, 0, first, stop), first)
        for part in ("gate_up_proj", "down_proj"):
            specs[f"{prefix}experts.{part}"] = ShardSpec(0, first, stop)
        self.shared_experts = (
            None
            if moe.shared_experts is None
            else _shard_mlp(moe.shared_experts, group, specs, f"{prefix}shared_experts.", reduce=False)
        )

    def forward(self, x: Tensor) -> Tensor:  # [..., D] -> [..., D]
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids, weights = self.gate(flat)
        out = self.experts(flat, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return self.group.all_reduce(out).view(shape)


def shard_model(model: DeepseekV32, group: TensorGroup) -> dict[str, ShardSpec]:
    """Replace ``model``'s modules by ``group.rank``'s shard, in place; returns the spec of every
    sliced tensor by its state-dict name (every other tensor is the whole, replicated)."""
    cfg = model.cfg
    if cfg.num_attention_heads < group.size:
        raise ValueError(
            f"tensor_parallel_size {group.size} exceeds the model's {cfg.num_attention_heads} attention heads"
        )
    specs: dict[str, ShardSpec] = {}
    start, stop = shard_range(cfg.vocab_size, group.size, group.rank)
    embed = VocabParallelEmbedding(_narrow(model.model.embed_tokens.weight, 0, start, stop), start, group)
    _swap(model.model, "embed_tokens", embed)
    specs["model.embed_tokens.weight"] = ShardSpec(0, start, stop)
    sizes = shard_sizes(cfg.vocab_size, group.size)
    if cfg.tie_word_embeddings:
        _swap(model, "lm_head", VocabParallelHead(embed.weight, sizes, group))
    else:
        head = _narrow(model.lm_head.weight, 0, start, stop)
        _swap(model, "lm_head", VocabParallelHead(head, sizes, group))
        specs["lm_head.weight"] = ShardSpec(0, start, stop)
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        if isinstance(module, MlaAttention):
            _shard_attention(module, group, specs, prefix)
        elif name.endswith(".mlp") and isinstance(module, DenseMLP):
            parent, attr = name.rsplit(".", 1)
            _swap(model.get_submodule(parent), attr, _shard_mlp(module, group, specs, prefix, reduce=True))
        elif name.endswith(".mlp") and isinstance(module, MoE):
            parent, attr = name.rsplit(".", 1)
            _swap(model.get_submodule(parent), attr, ShardedMoE(module, group, specs, prefix))
    return specs


def _swap(parent: nn.Module, name: str, shard: nn.Module) -> None:
    """Put ``shard`` in the place of ``parent``'s child module ``name``: often a class other than the
    one the model's code names (a ``VocabParallelHead`` where it names an ``nn.Linear``), which
    stands in for it and is called the same way."""
    setattr(parent, name, shard)


def _shard_attention(
    attn: MlaAttention, group: TensorGroup, specs: dict[str, ShardSpec], prefix: str
) -> None:
    cfg = attn.cfg
    h0, h1 = shard_range(cfg.num_attention_heads, group.size, group.rank)
    attn.num_heads = h1 - h0
    qk, kv, v = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.v_head_dim
    attn.q_b_proj = _linear(_narrow(attn.q_b_proj.weight, 0, h0 * qk, h1 * qk))
    attn.kv_b_proj = _linear(_narrow(attn.kv_b_proj.weight, 0, h0 * kv, h1 * kv))
    _swap(attn, "o_proj", RowParallelLinear(_narrow(attn.o_proj.weight, 1, h0 * v, h1 * v), group))
    specs[f"{prefix}q_b_proj.weight"] = ShardSpec(0, h0 * qk, h1 * qk)
    specs[f"{prefix}kv_b_proj.weight"] = ShardSpec(0, h0 * kv, h1 * kv)
    specs[f"{prefix}o_proj.weight"] = ShardSpec(1, h0 * v, h1 * v)


def _shard_mlp(
    mlp: DenseMLP, group: TensorGroup, specs: dict[str, ShardSpec], prefix: str, *, reduce: bool
) -> DenseMLP:
    inner = mlp.gate_proj.weight.shape[0]
    start, stop = shard_range(inner, group.size, group.rank)
    with torch.device("meta"):  # the shapes only: every weight is replaced by its slice below
        out = DenseMLP(mlp.gate_proj.weight.shape[1], stop - start)
    out.gate_proj = _linear(_narrow(mlp.gate_proj.weight, 0, start, stop))
    out.up_proj = _linear(_narrow(mlp.up_proj.weight, 0, start, stop))
    down = RowParallelLinear(_narrow(mlp.down_proj.weight, 1, start, stop), group if reduce else None)
    _swap(out, "down_proj", down)
    for part, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
        specs[f"{prefix}{part}.weight"] = ShardSpec(dim, start, stop)
    return out


def _narrow(weight: Tensor, dim: int, start: int, stop: int) -> Tensor:
    """A copy of the slice (works on ``meta`` tensors too, which have no data to copy)."""
    return weight.detach().narrow(dim, start, stop - start).clone()


def _linear(weight: Tensor) -> nn.Linear:
    """An ``nn.Linear`` (no bias) over ``weight [out, in]`` itself."""
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear
