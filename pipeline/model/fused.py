"""The inference fast path of a decoder layer: the same arithmetic in far fewer torch calls.

On a small model, or a small batch, a forward costs what its torch calls cost to dispatch, not what
they compute. The module path (``DecoderLayer.forward``) stays the definition (training and the
tests read it); ``fuse_for_inference`` gives each plain layer a ``FusedLayer`` that the layer runs
instead whenever no gradient is recorded. What it changes:

* **Projections that read the same input are one matmul.** ``q_a_proj``, ``kv_a_proj_with_mqa`` and
  the indexer's ``wk`` (and ``weights_proj`` when it is in the model dtype) read the normed hidden
  state; ``q_b_proj`` and the indexer's ``wq_b`` read the query latent; an MLP's ``gate_proj`` and
  ``up_proj`` read the same input. Their weights are concatenated into one tensor and the modules'
  parameters become row slices of it (views: no second copy; loading into a parameter in place
  writes the fused tensor). Each output element is the same dot product as before.
* **Few-token MoE computes every expert densely** when the experts are few (``E <= 4 k``) and the
  tokens few (``T * E <= DENSE_EXPERT_ROWS``): one matmul over all experts' ``gate_up``, one batched
  matmul over their ``down``, the routing weights as a dense ``[T, E]`` matrix with zeros for the
  experts a token skips. A skipped expert adds an exact zero, so each token's sum is the sum of its
  chosen experts' contributions in expert order, as the module path's ``index_add`` accumulates.
  A float32/64 model whose shared expert has the routed experts' shape computes it there as one
  more expert of weight 1 (its weights and the routed experts' are views of two fused tensors), and
  each token's weighted sum is one matmul: equal to the module path to rounding, in five fewer calls.
* **Beyond that the routed experts are grouped by one sort.** The module path finds each
  expert's tokens with a ``unique``, a ``nonzero`` per expert and an ``index_add`` per expert. Here
  the (token, slot) pairs are sorted by expert once, each expert's rows are one segment of one
  gathered copy of the input, and each token's contributions are added to zeros in expert order:
  the module path's products, summed in its order, for any number of tokens and experts. A single
  token on a CPU (a decode step of one request) reads only its chosen experts, one by one.
  On a CPU with numba, up to ``kernels.moe_numba.MAX_TOKENS`` tokens of a float32/64 model (decode,
  verify and draft steps) run routed and shared experts as one compiled per-token loop instead:
  the same arithmetic in expert order, to rounding, and each token's result independent of the
  others in the call.
* **Routing** skips the router's group mask when it keeps every group; a forward's rope tables are
  built once, and a layer rotates its query heads' and new key's rope channels in one go.
* **A few tokens on a CPU run as compiled loops around the attention** (``kernels.layer_numba``):
  up to ``layer_numba.tokens_for`` its bytes (8 to 32) tokens of a float32/64 model with an MLP the
  loops know, the work
  before ``backend.attend`` is one call and the work after it another, each token computed alone;
  up to ``MAX_HYBRID_TOKENS`` BLAS does the matmuls and the MLP and the loops the pieces between
  them. ``_CompiledWeights`` holds the weights' numpy views and checks at every call that what they
  view is still in place.

A module replaced after fusion, or a fused module's parameter replaced (a new ``Parameter``, or ``.data``
re-pointed), no longer feeds the fused path; every call checks that each module it holds is still in place and
that the fused weights' data pointers did not move, and falls back to the module path otherwise, so stale
weights are never used (``fuse_for_inference`` again re-fuses). Layers whose modules are not plain
``nn.Linear`` (tensor-parallel shards) are left unfused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import layer_numba, moe_numba, small_ops_numba
from pipeline.model.attention_api import AttentionBackend, AttentionInputs
from pipeline.model.decoder import DecoderLayer
from pipeline.model.layers import DenseMLP, wide_dtype
from pipeline.model.moe import MoE, RoutedExperts, TopkRouter

# the most token x expert rows the dense expert path computes (beyond it, only the chosen rows, grouped
# by expert): with few experts a matmul over all of them costs less than one per expert for a few
# dozen tokens of the bundled model's 4 (the crossover measured: docs/performance-notes.md)
DENSE_EXPERT_ROWS = 160
# the most tokens whose layer runs ``kernels.layer_numba``'s loops between BLAS's matmuls (beyond
# it, a prefill chunk's, the torch ops' vectorised passes over many rows cost less than the loops)
MAX_HYBRID_TOKENS = 64


def _fuse(linears: list[nn.Linear], views: list[tuple[nn.Module, str, int]]) -> Tensor:
    """Concatenate the weights of ``linears`` (same input width, dtype, device) and make each
    module's weight a row slice of the result. Returns the fused ``[sum(out), in]`` weight; appends
    (each module, ``"weight"``, its slice's data pointer) to ``views`` (``FusedLayer.current`` checks
    them)."""
    fused = torch.cat([m.weight.detach() for m in linears], dim=0)
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = fused[start : start + rows]
        views.append((m, "weight", m.weight.data_ptr()))
        start += rows
    return fused


def _plain(*modules: nn.Module | None) -> bool:
    return all(type(m) is nn.Linear and m.bias is None for m in modules if m is not None)


class FusedLayer:
    """A ``DecoderLayer``'s inference forward (see the module docstring)."""

    def __init__(self, layer: DecoderLayer) -> None:
        attn = layer.self_attn
        cfg = attn.cfg
        self.cfg = cfg
        self.attn = attn
        self.heads = attn.num_heads
        idx = attn.indexer
        self.indexer = idx
        self.has_indexer = idx is not None
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.q_norm = attn.q_a_layernorm
        self.kv_norm = attn.kv_a_layernorm
        dtype = attn.q_a_proj.weight.dtype
        # the indexer's per-head weights join the first matmul when they share the model's dtype
        self.w_in_weights = idx is not None and idx.weights_proj.weight.dtype == dtype
        first: list[nn.Linear] = [attn.q_a_proj, attn.kv_a_proj_with_mqa]
        if idx is not None:
            first.append(idx.wk)
            if self.w_in_weights:
                first.append(idx.weights_proj)
        self._views: list[tuple[nn.Module, str, int]] = []  # (module, parameter, where its data must lie)
        self.splits_in = [m.weight.shape[0] for m in first]
        self.w_in = _fuse(first, self._views)
        second = [attn.q_b_proj] + ([idx.wq_b] if idx is not None else [])
        self.splits_q = [m.weight.shape[0] for m in second]
        self.w_q = _fuse(second, self._views)
        self.mlp: _FusedDense | _FusedMoE = _fused_mlp(layer.mlp, self._views)
        self.attn_scale, self.index_scale = cfg.attn_scale, cfg.index_scale
        # every module this object holds, by where it sits: a replaced one means stale weights
        names: dict[nn.Module, list[str]] = {
            layer: ["self_attn", "input_layernorm", "post_attention_layernorm", "mlp"],
            attn: [
                "q_a_layernorm",
                "kv_a_layernorm",
                "indexer",
                "q_a_proj",
                "kv_a_proj_with_mqa",
                "q_b_proj",
            ],
        }
        if idx is not None:
            names[idx] = ["wk", "wq_b", "weights_proj"]
        mlp = layer.mlp
        dense = mlp if isinstance(mlp, DenseMLP) else getattr(mlp, "shared_experts", None)
        if not isinstance(mlp, DenseMLP):
            names[mlp] = ["shared_experts"]
        if dense is not None:
            names[dense] = ["gate_proj", "up_proj", "down_proj"]
        self._links = [
            (parent, name, getattr(parent, name)) for parent, attrs_ in names.items() for name in attrs_
        ]
        self._numba: _CompiledWeights | None = None  # ``kernels.layer_numba``'s weights, made at first use

    @staticmethod
    def fits(layer: DecoderLayer) -> bool:
        attn = layer.self_attn
        idx = attn.indexer
        mods = [attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.kv_b_proj, attn.o_proj]
        if idx is not None:
            mods += [idx.wq_b, idx.wk, idx.weights_proj]
        mlp = layer.mlp
        mlp_fits = isinstance(mlp, MoE) or (isinstance(mlp, DenseMLP) and _plain(mlp.gate_proj, mlp.up_proj))
        return _plain(*mods) and attn.num_heads == attn.cfg.num_attention_heads and mlp_fits

    def current(self) -> bool:
        """Every module this object holds is still where it was, and the fused modules' weights are
        still slices of the fused tensors (what it reads through those modules is read live)."""
        # read the registries directly: ``getattr`` on a module takes the slow ``__getattr__`` path,
        # and this runs for every layer of every forward (an attribute set to None outside the
        # registry, as a missing indexer is, reads as None here too)
        for parent, name, module in self._links:
            if parent._modules.get(name) is not module:
                return False
        return all(
            (p := m._parameters[name]) is not None and p.data_ptr() == ptr for m, name, ptr in self._views
        )

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend, layer: int) -> Tensor:
        out = self._compiled(x, cos, sin, backend, layer)
        if out is not None:
            return out
        x = x + self._attention(self.input_norm(x), cos, sin, backend, layer)
        return x + self.mlp(self.post_norm(x))

    def _compiled(
        self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend, layer: int
    ) -> Tensor | None:
        """A few tokens on a CPU (decode, verify, draft steps, a small batch's): the work around
        ``backend.attend`` by ``kernels.layer_numba``, or None where its loops do not take the layer
        (weights of other dtypes, an indexer whose head weights are apart, no numba). Up to
        ``layer_numba.tokens_for(weights.nbytes)`` tokens (and an MLP the loops know: a dense one,
        ungrouped routed experts) the loops do everything, in two calls; up to ``MAX_HYBRID_TOKENS``
        BLAS does the four matmuls and the MLP, the loops the rest between them."""
        projected = self._compiled_inputs(x, cos, sin)
        if projected is None:
            return None
        parts, xs, weights, whole = projected
        q_latent, q_rope, kv_rows, index_q, index_w, index_k = (torch.from_numpy(part) for part in parts)
        indexed = self.has_indexer
        inputs = AttentionInputs(
            layer=layer,
            q_latent=q_latent,
            q_rope=q_rope,
            kv_rows=kv_rows,
            index_q=index_q if indexed else None,
            index_w=index_w if indexed else None,
            index_k=index_k if indexed else None,
            attn_scale=self.attn_scale,
            index_scale=self.index_scale,
            top_k=self.cfg.index_topk,
            reuse_topk=not indexed,
        )
        out = backend.attend(inputs).to(x.dtype).detach().contiguous().numpy()
        loops = weights.loops
        if whole:
            return torch.from_numpy(layer_numba.finish(xs, out, loops))
        attended = F.linear(torch.from_numpy(layer_numba.up_values(out, loops)), weights.w_o).numpy()
        resid, normed = layer_numba.add_norm(xs, attended, loops)
        mlp = self.mlp
        # the router as one compiled call, the experts BLAS's
        if weights.routes and isinstance(mlp, _FusedMoE):
            ids, routed = layer_numba.route(normed, loops)
            routing = (torch.from_numpy(ids), torch.from_numpy(routed))
            return torch.from_numpy(resid) + mlp(torch.from_numpy(normed), routing)
        return torch.from_numpy(resid) + mlp(torch.from_numpy(normed))

    def _compiled_inputs(self, x: Tensor, cos: Tensor, sin: Tensor):
        """``_compiled``'s projection: (the attention inputs' arrays, ``x``'s, the weights, whether
        the loops do the whole layer), or None where they do not take it."""
        if not (
            x.shape[0] <= MAX_HYBRID_TOKENS and x.is_cpu and x.dtype in _COMPILED_DTYPES and x.dim() == 2
        ):
            return None
        weights = self._numba
        if weights is None or not weights.current():
            weights = self._numba = _CompiledWeights(self)
        if not weights.usable or x.dtype != weights.dtype:
            return None
        rope = _RopeTables.of(cos, sin)
        if (
            rope.compiled is None
            or rope.dtype != x.dtype
            or rope.shape != (x.shape[0], self.cfg.qk_rope_head_dim)
        ):
            return None
        a, loops = weights.arrays, weights.loops
        xs = x.detach().contiguous().numpy()
        whole = weights.whole and x.shape[0] <= layer_numba.tokens_for(weights.nbytes)
        if whole:
            return layer_numba.project(xs, loops, *rope.compiled), xs, weights, True
        p = F.linear(
            torch.from_numpy(layer_numba.rms_rows(xs, a["norm_w"], a["norm_eps"])), self.w_in
        ).numpy()
        q_resid = layer_numba.rms_rows(p[:, : a["q_lora"]], a["q_norm_w"], a["q_eps"])
        q = F.linear(torch.from_numpy(q_resid), self.w_q).numpy()
        return layer_numba.assemble(p, q, loops, *rope.compiled), xs, weights, False

    def cache_rows(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor | None]:
        """The cache rows and indexer keys ``__call__`` writes for ``x`` (the layer's input), and
        nothing else: the same matmul and element-wise ops (rotating a key alone or with the query
        heads is the same product per element), without the queries, the attention or the MLP."""
        projected = self._compiled_inputs(x, cos, sin)
        if projected is not None:  # the rows the layer's forward over the same tokens writes
            parts = projected[0]
            return torch.from_numpy(parts[2]), torch.from_numpy(parts[5]) if self.has_indexer else None
        cfg = self.cfg
        r, c = cfg.qk_rope_head_dim, cfg.kv_lora_rank
        rope = _RopeTables.of(cos, sin)
        parts = F.linear(self.input_norm(x), self.w_in).split(self.splits_in, dim=-1)
        latent, k_rope = parts[1].split([c, r], dim=-1)
        k_rope = rope.rotate(k_rope[:, None, :], interleaved=True)[:, 0]
        kv_rows = torch.cat([self.kv_norm(latent), k_rope], dim=-1)
        idx = self.indexer
        if idx is None:
            return kv_rows, None
        ik = idx.k_norm(parts[2])
        ik_rope = rope.rotate(ik[:, None, :r], interleaved=cfg.indexer_rope == "interleaved")[:, 0]
        return kv_rows, torch.cat([ik_rope, ik[:, r:]], dim=-1)

    def _attention(
        self, h: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend, layer: int
    ) -> Tensor:
        cfg, attn, heads = self.cfg, self.attn, self.heads
        r, nope, c = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        rope = _RopeTables.of(cos, sin)
        parts = F.linear(h, self.w_in).split(self.splits_in, dim=-1)
        q_resid = self.q_norm(parts[0])
        latent, k_rope = parts[1].split([c, r], dim=-1)
        qs = F.linear(q_resid, self.w_q).split(self.splits_q, dim=-1)
        q = qs[0].unflatten(-1, (heads, cfg.qk_head_dim))
        q_nope, q_rope = q.split([nope, r], dim=-1)
        # the query heads' and the new key's rope channels, rotated together: [T, H + 1, R]
        rotated = rope.rotate(torch.cat([q_rope, k_rope[:, None, :]], dim=1), interleaved=True)
        w_uk, w_uv = attn.up_weights()
        index_q = index_w = index_k = None
        idx = self.indexer
        if idx is not None:
            hi = cfg.index_n_heads
            iq = qs[1].unflatten(-1, (hi, cfg.index_head_dim))
            ik = idx.k_norm(parts[2])
            both = torch.cat([iq[..., :r], ik[:, None, :r]], dim=1)  # [T, Hi + 1, R]
            both = rope.rotate(both, interleaved=cfg.indexer_rope == "interleaved")
            index_q = torch.cat([both[:, :hi], iq[..., r:]], dim=-1)
            index_k = torch.cat([both[:, hi], ik[:, r:]], dim=-1)
            if self.w_in_weights:
                index_w = parts[3] * hi**-0.5
            else:
                wide = wide_dtype(h.dtype)
                index_w = F.linear(h.to(wide), idx.weights_proj.weight.to(wide)) * hi**-0.5
        inputs = AttentionInputs(
            layer=layer,
            q_latent=torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1).contiguous(),  # [T, H, C]
            q_rope=rotated[:, :heads],
            kv_rows=torch.cat([self.kv_norm(latent), rotated[:, heads]], dim=-1),
            index_q=index_q,
            index_w=index_w,
            index_k=index_k,
            attn_scale=self.attn_scale,
            index_scale=self.index_scale,
            top_k=cfg.index_topk,
            reuse_topk=not self.has_indexer,
        )
        out = backend.attend(inputs).to(h.dtype)  # [T, H, C]
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return attn.o_proj(out.reshape(out.shape[0], -1))


_COMPILED_DTYPES = (torch.float32, torch.float64)


class _CompiledWeights:
    """A fused layer's weights as the numpy views and constants ``kernels.layer_numba`` reads, and
    what they were taken from. ``current`` checks (besides ``FusedLayer.current``, which the caller
    has checked) that every module and tensor behind a view is still in place at the same memory,
    so a replaced or moved weight is never read stale.

    ``usable``: the loops take the layer's attention side (numba installed; every weight it reads a
    contiguous CPU tensor of one float32/64 dtype; the indexer's head weights inside the first matmul).
    ``whole``: they take its MLP too (a dense MLP, or routed experts without group masking whose
    sizes ``kernels.moe_numba`` takes, with a plain shared expert or none)."""

    def __init__(self, fused: FusedLayer) -> None:
        self._held: list[tuple[Mapping[str, object], str, object]] = []  # (registry, name, what it held)
        self._held_at: list[tuple[Tensor, int]] = []  # the held tensors and where their data lay
        self._tensors: list[Tensor] = [fused.w_in, fused.w_q]
        self.dtype = fused.w_in.dtype
        # the loops' inputs by name: arrays, numpy scalars, ints and flags (numba's dispatch types them)
        self.arrays: dict[str, Any] = {}
        self.usable = self.whole = self.routes = False
        self.nbytes = 0
        if self.dtype not in _COMPILED_DTYPES:
            return
        self._wide = np.float64 if self.dtype == torch.float64 else np.float32
        if not self._take_attention(fused):
            return
        self.w_o = fused.attn.o_proj.weight  # the hybrid path's output projection (BLAS)
        whole = self._take_mlp(fused)
        if not all(
            t.dtype == self.dtype and t.device.type == "cpu" and t.is_contiguous() for t in self._tensors
        ):
            return
        # the tensors as numpy views (no copies: the weights' own memory)
        for name, value in self.arrays.items():
            if isinstance(value, Tensor):
                self.arrays[name] = value.detach().numpy()
        # what the loops read per token, each memory once (views of one fused weight share it)
        views = [a for a in self.arrays.values() if isinstance(a, np.ndarray)]
        held = {a.__array_interface__["data"][0]: a.nbytes for a in views}
        self.nbytes = sum(held.values())
        self.loops = layer_numba.LayerWeights(self.arrays)
        self.usable, self.whole = True, whole
        # the hybrid path routes by the loops too: ungrouped routed experts whose weights they hold
        self.routes = whole and bool(self.arrays["routed"])

    def _hold(self, table: Mapping[str, object], name: str) -> object:
        """``table[name]`` (a module's parameter, buffer or submodule), remembered for ``current``."""
        value = table[name]
        self._held.append((table, name, value))
        if isinstance(value, Tensor):
            self._held_at.append((value, value.data_ptr()))
        return value

    def _module(self, owner: nn.Module, name: str) -> nn.Module | None:
        """``owner``'s submodule ``name``, remembered; None when it is not a module."""
        value = self._hold(owner._modules, name)
        return value if isinstance(value, nn.Module) else None

    def _tensor(
        self, module: nn.Module | None, name: str = "weight", kind: str = "_parameters"
    ) -> Tensor | None:
        """``module``'s parameter (or buffer) ``name``, remembered and checked with the others for
        place and dtype; None when there is none."""
        value = None if module is None else self._hold(getattr(module, kind), name)
        if not isinstance(value, Tensor):
            return None
        self._tensors.append(value)
        return value

    def current(self) -> bool:
        return all(table.get(name) is value for table, name, value in self._held) and all(
            t.data_ptr() == ptr for t, ptr in self._held_at
        )

    def _take_attention(self, fused: FusedLayer) -> bool:
        cfg, attn, a, wide, param = fused.cfg, fused.attn, self.arrays, self._wide, self._tensor
        a["norm_w"], a["norm_eps"] = param(fused.input_norm), wide(fused.input_norm.eps)
        a["q_norm_w"], a["q_eps"] = param(fused.q_norm), wide(fused.q_norm.eps)
        a["kv_norm_w"], a["kv_eps"] = param(fused.kv_norm), wide(fused.kv_norm.eps)
        a["post_w"], a["post_eps"] = param(fused.post_norm), wide(fused.post_norm.eps)
        heads, nope = fused.heads, cfg.qk_nope_head_dim
        kv_b = param(self._module(attn, "kv_b_proj"))
        a["w_o"] = param(self._module(attn, "o_proj"))
        weights = ("norm_w", "q_norm_w", "kv_norm_w", "post_w", "w_o")
        if kv_b is None or not kv_b.is_contiguous() or any(a[key] is None for key in weights):
            return False
        a["kv_b"], a["nope"] = kv_b.view(heads, nope + cfg.v_head_dim, -1), nope
        a["w_in"], a["w_q"], a["q_lora"], a["rope"] = (
            fused.w_in,
            fused.w_q,
            cfg.q_lora_rank,
            cfg.qk_rope_head_dim,
        )
        a["has_index"] = fused.has_indexer
        if attn.indexer is None:
            empty = torch.empty(0, dtype=self.dtype)
            a["k_norm_w"] = a["k_norm_b"] = empty
            a["k_norm_eps"], a["index_w_scale"], a["index_interleaved"] = wide(1.0), wide(1.0), False
            return True
        if not fused.w_in_weights:
            return False
        k_norm = self._module(attn.indexer, "k_norm")
        if not isinstance(k_norm, nn.LayerNorm) or k_norm.weight is None or k_norm.bias is None:
            return False
        a["k_norm_w"], a["k_norm_b"], a["k_norm_eps"] = param(k_norm), param(k_norm, "bias"), wide(k_norm.eps)
        a["index_heads"], a["index_dim"] = cfg.index_n_heads, cfg.index_head_dim
        a["index_w_scale"] = wide(cfg.index_n_heads**-0.5)
        a["index_interleaved"] = cfg.indexer_rope == "interleaved"
        return True

    def _take_mlp(self, fused: FusedLayer) -> bool:
        cfg, mlp, a, wide, param, dtype = (
            fused.cfg,
            fused.mlp,
            self.arrays,
            self._wide,
            self._tensor,
            self.dtype,
        )
        a["routed"], a["top_k"], a["normalise"], a["scaling"] = False, 0, False, wide(1.0)
        a["tiny"] = wide(1e-20)
        a["gate_w"], a["bias"] = torch.zeros(1, cfg.hidden_size, dtype=dtype), torch.zeros(1, dtype=dtype)
        # a dense MLP runs as the loop's "shared expert" with no routed ones (placeholders of the types)
        a["gate_up"] = torch.zeros(1, 2, cfg.hidden_size, dtype=dtype)
        a["down"] = torch.zeros(1, cfg.hidden_size, 1, dtype=dtype)
        a["shared_gate_up"] = torch.zeros(2, cfg.hidden_size, dtype=dtype)
        a["shared_down"] = torch.zeros(cfg.hidden_size, 1, dtype=dtype)
        a["has_shared"] = False
        shared: _FusedDense | DenseMLP | None
        if isinstance(mlp, _FusedDense):
            shared = mlp
        elif isinstance(mlp, _FusedMoE) and mlp.ungrouped:
            moe = mlp.moe
            experts, gate = self._module(moe, "experts"), self._module(moe, "gate")
            gate_up, down = param(experts, "gate_up_proj"), param(experts, "down_proj")
            bias = param(gate, "e_score_correction_bias", "_buffers")
            gate_w = param(gate)
            shared = mlp.shared
            if (
                gate_up is None
                or down is None
                or bias is None
                or gate_w is None
                or not isinstance(gate, TopkRouter)
                or gate_up[0].numel() > moe_numba.MAX_EXPERT_ELEMENTS
                or not isinstance(shared, _FusedDense | None)
            ):
                return False
            route = gate.cfg
            a.update(
                gate_up=gate_up,
                down=down,
                gate_w=gate_w,
                bias=bias,
                routed=True,
                top_k=route.num_experts_per_tok,
                normalise=bool(route.norm_topk_prob),
                scaling=wide(route.routed_scaling_factor),
            )
        else:
            return False
        if shared is not None:
            shared_down = param(shared.down)
            if shared_down is None:
                return False
            a["shared_gate_up"], a["shared_down"], a["has_shared"] = shared.w_gate_up, shared_down, True
            self._tensors.append(shared.w_gate_up)
        return True


class _RopeTables:
    """A forward's cos/sin in the form ``rotate`` needs, built once for all its layers.

    ``rope_cos_sin`` repeats the R/2 angles (``cos = [c | c]``), so both of the model's rotations
    are ``x' * cos + roll(x', R/2) * [-s | s]`` over ``x'``: the channels themselves for half-split
    pairs, the channels de-interleaved (``[even | odd]``) for interleaved ones, which is also the
    layout the interleaved rotation writes. Each element is the product and sum the layers'
    ``rope_half_split`` / ``rope_interleaved`` compute (a sign moved from a factor to the other)."""

    _last: _RopeTables | None = None  # the latest forward's (holding its cos, so ids cannot recur)

    def __init__(self, cos: Tensor, sin: Tensor) -> None:
        self.cos, self.sin_in = cos, sin
        half = cos.shape[-1] // 2
        self.half = half
        signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        self.c = cos[:, None, :]
        self.s = signed[:, None, :]
        # a CPU's compiled loop (the same products and sums, so the same bits) reads the [T, R] tables,
        # as numpy arrays taken once for every layer of the forward
        self.compiled = None
        if small_ops_numba.fits(cos, sin) and cos.dim() == 2:
            self.compiled = (cos.contiguous().numpy(), signed.numpy())
            self.shape, self.dtype = tuple(cos.shape), cos.dtype

    @classmethod
    def of(cls, cos: Tensor, sin: Tensor) -> _RopeTables:
        last = cls._last
        if last is None or last.cos is not cos or last.sin_in is not sin:
            last = cls._last = cls(cos, sin)
        return last

    def rotate(self, x: Tensor, *, interleaved: bool) -> Tensor:
        """``x [T, heads, R]`` rotated (de-interleaved first when ``interleaved``)."""
        if (
            self.compiled is not None
            and x.dtype == self.dtype
            and x.is_cpu
            and x.dim() == 3
            and (x.shape[0], x.shape[2]) == self.shape
        ):
            return small_ops_numba.rotate_with_tables(x, *self.compiled, interleaved)
        if interleaved:
            x = x.unflatten(-1, (self.half, 2)).transpose(-1, -2).reshape(x.shape)
        return x * self.c + x.roll(self.half, dims=-1) * self.s


def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up``, the product written into the ``silu`` result: the same values, one
    temporary fewer. A prefill's temporaries are megabytes, and each fresh one is new pages from the
    system (a page fault per 4 KiB), which the dense MLP of a long prefill feels
    (docs/performance-notes.md)."""
    return F.silu(gate).mul_(up)


class _FusedDense:
    """A SwiGLU MLP over one fused ``[gate; up]`` weight (``w_gate_up``: one made already, whose row
    slices the two modules' weights are)."""

    def __init__(
        self, mlp: DenseMLP, views: list[tuple[nn.Module, str, int]], w_gate_up: Tensor | None = None
    ) -> None:
        self.inner = mlp.gate_proj.weight.shape[0]
        self.w_gate_up = _fuse([mlp.gate_proj, mlp.up_proj], views) if w_gate_up is None else w_gate_up
        self.down = mlp.down_proj

    def __call__(self, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.w_gate_up).split(self.inner, dim=-1)
        return self.down(_swiglu(gate, up))


class _FusedMoE:
    """Routed experts, dense over every expert for few tokens and grouped by expert beyond (module
    docstring), plus shared experts."""

    def __init__(self, moe: MoE, views: list[tuple[nn.Module, str, int]]) -> None:
        self.moe = moe
        cfg = moe.gate.cfg
        self.experts = cfg.n_routed_experts
        self.dense_ok = cfg.n_routed_experts <= 4 * cfg.num_experts_per_tok
        # the fused experts tensors of the model's own module (a tensor-parallel shard of them keeps
        # its own forward)
        self.grouped_ok = type(moe.experts) is RoutedExperts
        # every group kept (one group, or topk_group of all): the router's group mask changes nothing
        self.ungrouped = cfg.topk_group >= cfg.n_group
        self.cfg = cfg
        shared = moe.shared_experts
        plain = shared if shared is not None and _plain(shared.gate_proj, shared.up_proj) else None
        # the dense path's weights with the shared expert as one more expert (None where it is not)
        self.w_all: Tensor | None = None
        self.down_all: Tensor | None = None
        # what must still view them: (the module's path under the MoE, its parameter, where its data lies)
        self._joined: list[tuple[tuple[str, ...], str, int]] = []
        self.shared: _FusedDense | DenseMLP | None
        if plain is not None and self.dense_ok and self.grouped_ok and _joins_experts(moe.experts, plain):
            self.w_all, self.down_all = _fuse_with_experts(moe.experts, plain, views)
            self._joined = [
                (("experts",), "gate_up_proj", moe.experts.gate_up_proj.data_ptr()),
                (("experts",), "down_proj", moe.experts.down_proj.data_ptr()),
                (("shared_experts", "down_proj"), "weight", plain.down_proj.weight.data_ptr()),
            ]
            routed_rows = moe.experts.gate_up_proj.shape[0] * moe.experts.gate_up_proj.shape[1]
            self.shared = _FusedDense(plain, views, w_gate_up=self.w_all[routed_rows:])
        else:
            self.shared = _FusedDense(plain, views) if plain is not None else shared

    def __call__(self, x: Tensor, routing: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``routing``: the tokens' expert ids and weights, when the caller has them already (the
        compiled layer's ``route``, the router's arithmetic to rounding)."""
        moe = self.moe
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if routing is not None:
            ids, weights = routing
        else:
            ids, weights = self._route(flat) if self.ungrouped else moe.gate(flat)
        compiled = self._compiled(flat, ids, weights)
        if compiled is not None:  # routed and shared experts, one compiled call
            return compiled.view(shape)
        if flat.shape[0] == 1 and flat.device.type == "cpu":
            out = self._single(flat, ids, weights)
        elif self.dense_ok and flat.shape[0] * self.experts <= DENSE_EXPERT_ROWS:
            if self.w_all is not None and weights.dtype == flat.dtype and self._joined_current():
                return self._dense_with_shared(flat, ids, weights).view(shape)
            out = self._dense(flat, ids, weights)
        elif self.grouped_ok and not getattr(moe.experts, "static_shapes", False):
            out = self._grouped(flat, ids, weights)
        else:  # (with ``static_shapes``: shapes that never follow the routing, for a CUDA graph)
            out = moe.experts(flat, ids, weights)
        out = out.view(shape)
        if self.shared is not None:
            out = out + self.shared(x)
        return out

    def _compiled(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor | None:
        """A few tokens on a CPU (decode, verify, a draft step): the routed experts and the shared
        one by ``kernels.moe_numba``'s per-token loop, or None where it does not take them (more
        than ``MAX_TOKENS`` tokens, other dtypes or devices, larger experts, a shared expert that is
        not a plain fused MLP)."""
        experts = self.moe.experts
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if not moe_numba.fits(x, gate_up, down, weights):
            return None
        shared = self.shared
        if shared is None:
            return moe_numba.moe(x, ids, weights, gate_up, down)
        if not isinstance(shared, _FusedDense) or not moe_numba.fits(
            x, shared.w_gate_up[None], shared.down.weight, weights
        ):
            return None
        return moe_numba.moe(x, ids, weights, gate_up, down, shared.w_gate_up, shared.down.weight)

    def _route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``TopkRouter.forward`` without its group mask (which keeps every expert here)."""
        cfg, gate = self.cfg, self.moe.gate
        scores = gate.scores(x)
        choice = scores + gate.e_score_correction_bias.to(scores.dtype)
        ids = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if cfg.routed_scaling_factor != 1.0:
            weights = weights * cfg.routed_scaling_factor
        return ids, weights

    def _single(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """One token on a CPU: its chosen experts only, in expert order, as the module path computes
        them (reading the ids costs nothing there, and the skipped experts' weights stay unread)."""
        experts = self.moe.experts
        out = torch.zeros_like(x)
        for slot, expert in sorted(enumerate(ids[0].tolist()), key=lambda chosen: chosen[1]):
            gate, up = F.linear(x, experts.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(_swiglu(gate, up), experts.down_proj[expert])
            # a [1, 1] weight: wide, as the module's
            out = out + (y * weights[:, slot : slot + 1]).to(x.dtype)
        return out

    def _dense(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        experts = self.moe.experts
        e, two_i, d = experts.gate_up_proj.shape
        n = x.shape[0]
        gate, up = F.linear(x, experts.gate_up_proj.view(e * two_i, d)).view(n, e, two_i).chunk(2, dim=-1)
        act = _swiglu(gate, up).transpose(0, 1)  # [E, N, I]
        y = torch.bmm(act, experts.down_proj.transpose(1, 2))  # [E, N, D]
        dense = torch.zeros(n, e, dtype=weights.dtype, device=x.device).scatter_(1, ids, weights)  # [N, E]
        # as the module path: each expert's output times its wide-dtype weight, cast back, added in
        # expert order in the activations' dtype (a skipped expert adds an exact zero)
        parts = (y * dense.t()[:, :, None]).to(x.dtype)
        out = torch.zeros_like(x)
        for part in parts:
            out = out + part
        return out

    def _joined_current(self) -> bool:
        """The routed experts' weights and the shared expert's ``down`` are still the views of
        ``w_all`` and ``down_all`` (a replaced or re-pointed one is read by ``_dense``, live). The
        shared expert's ``gate``/``up`` are checked with the layer's other fused weights."""
        for path, name, ptr in self._joined:
            module: nn.Module | None = self.moe
            for step in path:  # read live: a replaced module is seen
                module = None if module is None else module._modules.get(step)
            param = None if module is None else module._parameters.get(name)
            if param is None or param.data_ptr() != ptr:
                return False
        return True

    def _dense_with_shared(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """``_dense`` plus the shared expert, as one more expert of weight 1 (``_fuse_with_experts``):
        one matmul over every expert's ``gate_up``, one batched matmul over their ``down``, and each
        token's output as one product of its ``[E + 1]`` weights with its ``[E + 1, D]`` expert
        outputs. The same products as the module path, summed by the matmul instead of one by one in
        expert order (so equal to rounding); float32/64 models only (a narrower one's router weights
        are wider than its activations, and the module path rounds each product to the narrow type)."""
        n, e = x.shape[0], self.experts
        w_all, down_all = self.w_all, self.down_all
        assert w_all is not None and down_all is not None  # the caller checked (they are made together)
        gate, up = F.linear(x, w_all).view(n, e + 1, -1).chunk(2, dim=-1)
        act = _swiglu(gate, up).transpose(0, 1)  # [E + 1, N, I]
        y = torch.bmm(act, down_all.transpose(1, 2))  # [E + 1, N, D]
        dense = torch.zeros(n, e + 1, dtype=x.dtype, device=x.device)
        dense[:, e] = 1  # the shared expert
        dense[:, :e].scatter_(1, ids, weights)
        return torch.bmm(dense[:, None, :], y.transpose(0, 1))[:, 0]

    def _grouped(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """The module path's arithmetic (``RoutedExperts.forward``) with its bookkeeping in a few
        calls: the (token, slot) pairs sorted by expert once (stably, so each expert's tokens stay in
        token order), each expert's rows one contiguous segment of one gathered copy of ``x``, and
        each token's contributions added to zeros in expert order, as the module's per-expert
        ``index_add`` calls add them (in the activations' dtype, one rounding per addition)."""
        experts = self.moe.experts
        n, k = ids.shape
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token = order // k
        rows = x.index_select(0, token)  # [N * k, D], expert by expert
        out_rows = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(torch.bincount(flat_ids, minlength=self.experts).tolist()):
            if count == 0:
                continue
            seg = slice(start, start + count)
            gate, up = F.linear(rows[seg], experts.gate_up_proj[expert]).chunk(2, dim=-1)
            out_rows[seg] = F.linear(_swiglu(gate, up), experts.down_proj[expert])
            start += count
        # HF multiplies by the wide-dtype weight, then casts back before accumulating
        contrib = (out_rows * weights.reshape(-1).index_select(0, order)[:, None]).to(x.dtype)
        if x.dtype in (torch.float32, torch.float64) and x.device.type == "cpu":
            # one ``index_add_`` adds them in ``order``'s order, one rounding each: the module's sums
            return torch.zeros_like(x).index_add_(0, token, contrib)
        # a narrower dtype's ``index_add_`` on a CPU sums one call's duplicates wide and rounds once,
        # and on CUDA adds them in no fixed order: each token's contributions are added one by one
        # instead, from where they lie, in expert order
        where = torch.empty_like(order).scatter_(0, order, torch.arange(n * k, device=x.device)).view(n, k)
        where = where.gather(1, torch.argsort(ids, dim=1, stable=True))
        out = torch.zeros_like(x)
        for slot in range(k):
            out = out + contrib.index_select(0, where[:, slot])
        return out


def _joins_experts(experts: RoutedExperts, shared: DenseMLP) -> bool:
    """The shared expert has the routed experts' shape (``n_shared_experts`` of 1), with plain
    weights of their float32/64 dtype on their device: it can be one more expert."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    _, two_i, d = gate_up.shape
    weights = (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    return (
        _plain(shared.down_proj)
        and gate_up.dtype in _COMPILED_DTYPES
        and all(w.dtype == gate_up.dtype and w.device == gate_up.device for w in (down, *weights))
        and tuple(shared.gate_proj.weight.shape) == tuple(shared.up_proj.weight.shape) == (two_i // 2, d)
        and tuple(shared.down_proj.weight.shape) == (d, two_i // 2) == tuple(down.shape[1:])
    )


def _fuse_with_experts(
    experts: RoutedExperts, shared: DenseMLP, views: list[tuple[nn.Module, str, int]]
) -> tuple[Tensor, Tensor]:
    """The routed experts' and the shared expert's weights as two tensors, the shared one last:
    ``[gate_up of every expert; shared gate; shared up]`` ``[(E + 1) 2I, D]`` and ``[down of every
    expert; shared down]`` ``[E + 1, D, I]``. As ``_fuse`` does, every module's parameter becomes a
    view of them (no second copy); the shared expert's ``gate`` and ``up`` are recorded in ``views``
    (``_FusedDense`` reads them as a slice of the first), the rest ``_FusedMoE`` checks itself."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    e, two_i, d = gate_up.shape
    inner = two_i // 2
    w_all = torch.cat(
        [
            gate_up.detach().reshape(e * two_i, d),
            shared.gate_proj.weight.detach(),
            shared.up_proj.weight.detach(),
        ]
    )
    down_all = torch.cat([down.detach(), shared.down_proj.weight.detach()[None]])
    experts.gate_up_proj.data = w_all[: e * two_i].view(e, two_i, d)
    experts.down_proj.data = down_all[:e]
    shared.gate_proj.weight.data = w_all[e * two_i : e * two_i + inner]
    shared.up_proj.weight.data = w_all[e * two_i + inner :]
    shared.down_proj.weight.data = down_all[e]
    views += [(m, "weight", m.weight.data_ptr()) for m in (shared.gate_proj, shared.up_proj)]
    return w_all, down_all


def _fused_mlp(mlp: nn.Module, views: list[tuple[nn.Module, str, int]]) -> _FusedDense | _FusedMoE:
    if isinstance(mlp, DenseMLP):
        return _FusedDense(mlp, views)
    if isinstance(mlp, MoE):
        return _FusedMoE(mlp, views)
    raise TypeError(f"no fused path for a {type(mlp).__name__} (FusedLayer.fits refuses it)")


def fuse_for_inference(model: nn.Module) -> int:
    """Give every plain decoder layer of ``model`` (target and MTP) its fused inference path.
    Idempotent; returns the number of layers fused (0 for a model of another shape)."""
    backbone = getattr(model, "model", None)
    if not isinstance(model, nn.Module) or backbone is None or not hasattr(backbone, "layers"):
        return 0
    layers = list(backbone.layers) + [m.block for m in getattr(model, "mtp", ())]
    count = 0
    for layer in layers:
        fused = getattr(layer, "fused", None)
        if fused is not None and fused.current():
            count += 1
            continue
        if FusedLayer.fits(layer):
            layer.fused = FusedLayer(layer)
            count += 1
    return count
