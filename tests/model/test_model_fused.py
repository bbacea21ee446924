"""The fused inference path (``pipeline/model/fused.py``) against the module path it replaces.

Same weights, same backend state: every layer's fused forward gives the module path's output (float64:
to rounding; the dense-expert and grouped sums are exact), for dense and MoE layers, a GLM-style
shared indexer layer, batches that take the dense expert path and ones that take the grouped one,
and a bfloat16 model (whose router and indexer weights stay float32, so they are not fused). A parameter
replaced after fusion makes the layer fall back to the module path, never use stale weights.
"""

from __future__ import annotations

import pytest
import torch
from _model_util import new_backend, random_model, run, tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.model.fused import DENSE_EXPERT_ROWS, fuse_for_inference


def _pair(cfg, dtype=torch.float64, seed=0):
    module = random_model(cfg, seed=seed).to_dtype(dtype)
    fused = random_model(cfg, seed=seed).to_dtype(dtype)
    assert fuse_for_inference(fused) == cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    return module, fused


def _logits(model, n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    """A prefill of ``batch`` requests of ``n`` tokens, then one decode token each: both forwards'
    logits (the decode forward is the few-token one)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size - 1, (batch, n + 1), generator=gen)
    backend = new_backend(model, num_rows=batch * (n + 1), num_requests=batch, max_ctx=n + 1)
    rows = torch.arange(batch).repeat_interleave(n)
    positions = torch.arange(n).repeat(batch)
    locs = rows * (n + 1) + positions
    prefill = run(model, backend, ids[:, :n].reshape(-1), positions, rows, locs)
    rows1 = torch.arange(batch)
    decode = run(model, backend, ids[:, n], torch.full((batch,), n), rows1, rows1 * (n + 1) + n)
    return torch.cat([prefill, decode])


@settings(max_examples=16, deadline=None)
@given(
    n=st.integers(1, 40),
    batch=st.integers(1, 5),
    shared=st.booleans(),
    experts=st.sampled_from(
        [(4, 2), (8, 2), (16, 2)]
    ),  # (routed experts, per token): the last stays per-expert
    groups=st.sampled_from([(1, 1), (2, 1), (2, 2)]),  # (n_group, topk_group): (2, 1) masks a group
    seed=st.integers(0, 3),
)
def test_fused_equals_module_path(n, batch, shared, experts, groups, seed):
    e, k = experts
    over = dict(n_routed_experts=e, num_experts_per_tok=k, n_group=groups[0], topk_group=groups[1])
    if shared:  # GLM-5: the second layer reuses the first one's selection
        over.update(indexer_types=("full", "shared"))
    module, fused = _pair(tiny_config(**over), seed=seed)
    torch.testing.assert_close(
        _logits(fused, n, seed, batch), _logits(module, n, seed, batch), rtol=0, atol=1e-10
    )


def test_large_batches_take_the_grouped_expert_path(monkeypatch):
    """Beyond ``DENSE_EXPERT_ROWS`` token x expert rows the fused MoE groups the chosen rows by expert."""
    from pipeline.model.fused import _FusedMoE

    cfg = tiny_config(n_group=1, topk_group=1)
    module, fused = _pair(cfg)
    n = DENSE_EXPERT_ROWS // cfg.n_routed_experts + 1
    calls = []
    original = _FusedMoE._grouped
    monkeypatch.setattr(
        _FusedMoE, "_grouped", lambda self, x, *a: calls.append(x.shape[0]) or original(self, x, *a)
    )
    torch.testing.assert_close(_logits(fused, n), _logits(module, n), rtol=0, atol=1e-10)
    assert set(calls) == {n}  # the prefill of every MoE layer, not the one-token decode


def test_static_shapes_keep_large_batches_off_the_grouped_path(monkeypatch):
    """``RoutedExperts.static_shapes`` (a CUDA graph's capture): the fused MoE leaves the grouped
    path, whose groups follow the routing (``bincount(...).tolist()``), for the experts' fixed-shape
    one, with the same values."""
    from pipeline.model.fused import _FusedMoE
    from pipeline.model.moe import RoutedExperts

    cfg = tiny_config(n_group=1, topk_group=1)
    module, fused = _pair(cfg)
    n = DENSE_EXPERT_ROWS // cfg.n_routed_experts + 1
    calls = []
    original = _FusedMoE._grouped
    monkeypatch.setattr(
        _FusedMoE, "_grouped", lambda self, x, *a: calls.append(x.shape[0]) or original(self, x, *a)
    )
    experts = [m for m in fused.modules() if isinstance(m, RoutedExperts)]
    assert experts
    for m in experts:
        m.static_shapes = True
    torch.testing.assert_close(_logits(fused, n), _logits(module, n), rtol=0, atol=1e-10)
    assert calls == []


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(2, 300),
    experts=st.sampled_from([(4, 2), (8, 3), (16, 4), (32, 1)]),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    seed=st.integers(0, 5),
)
def test_grouped_experts_sum_what_the_module_sums(n, experts, dtype, seed):
    """The grouped path computes the module's products and adds them in its order: the same values,
    exactly, for every token count and dtype, also where some experts get no rows and others every token."""
    e, k = experts
    cfg = tiny_config(n_group=1, topk_group=1, n_routed_experts=e, num_experts_per_tok=k)
    module, fused = _pair(cfg, dtype=dtype, seed=seed)
    moe = fused.model.layers[1].fused.mlp
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cfg.hidden_size, generator=gen).to(dtype)
    ids, weights = moe._route(x)
    if seed % 2:  # every token to the same experts: the others get no rows
        ids = torch.arange(k).repeat(n, 1)
    with torch.no_grad():
        expected = module.model.layers[1].mlp.experts(x, ids, weights)
        got = moe._grouped(x, ids, weights)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_experts_of_another_kind_keep_their_own_forward():
    """Experts that are not the model's fused module (a tensor-parallel shard's) run their own
    forward where the grouped path would run, with the same values."""
    from pipeline.model.fused import _FusedMoE

    cfg = tiny_config(n_group=1, topk_group=1)
    _, fused = _pair(cfg)
    moe = fused.model.layers[1].mlp
    n = DENSE_EXPERT_ROWS // cfg.n_routed_experts + 8  # past the dense pass
    x = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        expected = fused.model.layers[1].fused.mlp(x)  # the grouped path

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):  # holds the same tensors, as a shard holds its part
            super().__init__()
            self.inner, self.calls = inner, []
            self.gate_up_proj, self.down_proj = inner.gate_up_proj, inner.down_proj

        def forward(self, x, ids, weights):
            self.calls.append(x.shape[0])
            return self.inner(x, ids, weights)

    wrapped = Wrapped(moe.experts)
    moe.experts = wrapped
    other = _FusedMoE(moe, [])
    assert not other.grouped_ok
    with torch.no_grad():
        torch.testing.assert_close(other(x), expected, rtol=0, atol=0)
    assert wrapped.calls == [n]


@pytest.mark.parametrize("experts", [(4, 2), (8, 3), (8, 4), (16, 4)])
def test_bfloat16_model_keeps_wide_weights_apart(experts):
    """bf16: the router and indexer weights stay float32 (not fused), and the dense expert path adds
    the experts' contributions one by one in bf16, as the module path's index_add does."""
    e, k = experts
    cfg = tiny_config(n_group=1, topk_group=1, n_routed_experts=e, num_experts_per_tok=k)
    module, fused = _pair(cfg, dtype=torch.bfloat16)
    layer = fused.model.layers[0].fused
    assert not layer.w_in_weights  # indexer weights_proj is float32: its own matmul
    torch.testing.assert_close(_logits(fused, 12).float(), _logits(module, 12).float(), rtol=0, atol=0)


def test_module_weights_are_views_of_the_fused_weights():
    """No second copy: loading into a module parameter in place changes what the fused path reads."""
    cfg = tiny_config(n_group=1, topk_group=1)
    module, fused = _pair(cfg)
    attn = fused.model.layers[0].self_attn
    assert attn.q_a_proj.weight.data_ptr() == fused.model.layers[0].fused.w_in.data_ptr()
    with torch.no_grad():
        for m in (module, fused):
            m.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.mul_(1.5)
    assert fused.model.layers[0].fused.current()
    torch.testing.assert_close(_logits(fused, 10), _logits(module, 10), rtol=0, atol=1e-10)


def test_replaced_parameter_falls_back_to_the_module_path():
    cfg = tiny_config(n_group=1, topk_group=1)
    module, fused = _pair(cfg)
    for m in (module, fused):
        q_b = m.model.layers[1].self_attn.q_b_proj
        q_b.weight = torch.nn.Parameter(q_b.weight.detach() * 0.5)
    assert not fused.model.layers[1].fused.current()
    torch.testing.assert_close(_logits(fused, 10), _logits(module, 10), rtol=0, atol=1e-10)
    assert fuse_for_inference(fused) == 3 and fused.model.layers[1].fused.current()  # fused again
    torch.testing.assert_close(_logits(fused, 10), _logits(module, 10), rtol=0, atol=1e-10)


@pytest.mark.parametrize("where", ["q_b_proj", "mlp", "norm"])
def test_replaced_module_falls_back_to_the_module_path(where):
    """A module swapped for a new one after fusion is never read through the fused path's copy."""
    cfg = tiny_config(n_group=1, topk_group=1)
    module, fused = _pair(cfg)
    for m in (module, fused):
        layer = m.model.layers[0]
        torch.manual_seed(3)
        if where == "q_b_proj":
            old = layer.self_attn.q_b_proj
            layer.self_attn.q_b_proj = torch.nn.Linear(old.in_features, old.out_features, bias=False).double()
        elif where == "mlp":
            layer.mlp = type(layer.mlp)(cfg.hidden_size, cfg.intermediate_size).double()
        else:
            layer.post_attention_layernorm = type(layer.post_attention_layernorm)(cfg.hidden_size).double()
            with torch.no_grad():
                layer.post_attention_layernorm.weight.mul_(0.5)
    assert not fused.model.layers[0].fused.current()
    torch.testing.assert_close(_logits(fused, 10), _logits(module, 10), rtol=0, atol=1e-10)


@pytest.mark.parametrize("grad", [True, False])
def test_training_reads_the_module_path(grad):
    """With gradients recorded the layer runs its modules (the fused path is inference only)."""
    cfg = tiny_config(n_group=1, topk_group=1)
    _, fused = _pair(cfg)
    seen = []
    layer = fused.model.layers[0]
    original = layer.fused.__call__
    layer.fused = type(
        "Spy", (), {"current": lambda self: True, "__call__": lambda self, *a: seen.append(1) or original(*a)}
    )()
    with torch.set_grad_enabled(grad):
        backend = new_backend(fused, num_rows=8, num_requests=1, max_ctx=8)
        from pipeline.model import ForwardLayout

        backend.begin(
            ForwardLayout(
                req_rows=torch.zeros(4, dtype=torch.int64),
                positions=torch.arange(4),
                write_locs=torch.arange(4),
            )
        )
        fused(torch.arange(4), torch.arange(4), backend)
    assert bool(seen) is (not grad)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 1.3])  # 1.3: a YaRN attention factor
def test_rope_tables_rotate_exactly_as_the_layers_do(dtype, scale):
    from pipeline.model.fused import _RopeTables
    from pipeline.model.layers import rope_cos_sin, rope_half_split, rope_interleaved, rope_inv_freq

    gen = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 1, 7, 300, 4095])
    cos, sin = rope_cos_sin(positions, rope_inv_freq(16, 10000.0), dtype, scale)
    x = torch.randn(5, 3, 16, generator=gen, dtype=torch.float64).to(dtype)
    x[0, 0, :4] = 0.0  # signed zeros: the sign moved between factors must not change them
    tables = _RopeTables.of(cos, sin)
    assert _RopeTables.of(cos, sin) is tables  # built once per forward
    for interleaved, rope in ((True, rope_interleaved), (False, rope_half_split)):
        got, want = tables.rotate(x, interleaved=interleaved), rope(x, cos, sin)
        assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


class _Capture:
    """A backend that keeps what it is given: the rows ``attend`` stores, and ``store_rows``'s."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.attended: tuple | None = None
        self.stored: tuple | None = None

    def attend(self, inputs):
        self.attended = (inputs.layer, inputs.kv_rows.clone(), inputs.index_k.clone())
        return inputs.q_latent.new_zeros(inputs.q_latent.shape)

    def store_rows(self, layer, kv_rows, index_k):
        self.stored = (layer, kv_rows.clone(), index_k.clone())


@pytest.mark.parametrize("path", ["fused", "module"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 5, 40])
def test_mtp_store_writes_exactly_the_rows_mtp_forward_writes(path, dtype, n):
    # the rows alone (no attention, MLP or head) are the very rows a full MTP forward stores
    cfg = tiny_config()
    model = random_model(cfg, seed=3).to_dtype(dtype)
    if path == "fused":
        fuse_for_inference(model)
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, cfg.vocab_size - 1, (n,), generator=gen)
    positions = torch.arange(7, 7 + n)
    hidden = torch.randn(n, cfg.hidden_size, generator=gen).to(dtype)
    capture = _Capture(cfg)
    with torch.inference_mode():
        model.mtp_forward(ids, positions, hidden, capture)
        model.mtp_store(ids, positions, hidden, capture)
    assert capture.attended is not None and capture.stored is not None
    assert capture.stored[0] == capture.attended[0] == cfg.num_hidden_layers
    assert torch.equal(capture.stored[1], capture.attended[1])
    assert torch.equal(capture.stored[2], capture.attended[2])


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.bfloat16, 0.0)])
def test_few_tokens_on_a_cpu_skip_the_dense_expert_path(dtype, tol, monkeypatch):
    """A decode step's few tokens do not take the dense all-expert path: in float64 the compiled
    per-token loop runs them (``kernels.moe_numba``), in bfloat16 (which it does not take) one
    token runs its chosen experts one by one and two the dense path; the module path's values
    either way. (The whole-layer loops, ``kernels.layer_numba``, are turned off here: they would
    take these tokens before the MoE is asked.)"""
    from kernels import layer_numba, moe_numba
    from pipeline.model.fused import _FusedMoE

    monkeypatch.setattr(layer_numba, "MAX_TOKENS", 0)
    cfg = tiny_config(n_group=1, topk_group=1, n_routed_experts=8, num_experts_per_tok=2)
    module, fused = _pair(cfg, dtype=dtype)
    dense_tokens, compiled_tokens = [], []
    compiled = moe_numba.moe
    for name in ("_dense", "_dense_with_shared"):  # the dense path, with or without the shared expert in it
        original = getattr(_FusedMoE, name)
        monkeypatch.setattr(
            _FusedMoE,
            name,
            lambda self, x, *a, _f=original: dense_tokens.append(x.shape[0]) or _f(self, x, *a),
        )
    monkeypatch.setattr(moe_numba, "moe", lambda x, *a: compiled_tokens.append(x.shape[0]) or compiled(x, *a))
    torch.testing.assert_close(_logits(fused, 12).double(), _logits(module, 12).double(), rtol=0, atol=tol)
    assert dense_tokens and set(dense_tokens) == {12}  # the prefill only, not the one-token decode
    assert set(compiled_tokens) == ({1} if dtype == torch.float64 else set())
    dense_tokens.clear()
    compiled_tokens.clear()
    torch.testing.assert_close(
        _logits(fused, 6, batch=2).double(), _logits(module, 6, batch=2).double(), rtol=0, atol=tol
    )
    if dtype == torch.float64:
        assert 2 in compiled_tokens and 2 not in dense_tokens
    else:
        assert 2 in dense_tokens and not compiled_tokens


def test_rms_norm_keeps_its_compiled_handle_on_the_live_weight():
    """Without a gradient an RMSNorm runs the compiled loop through a handle on its weight; the
    handle follows a weight loaded in place, a replaced or converted weight, and a copy of the module
    (whose weight is its own), and the values stay ``torch.rms_norm``'s to rounding."""
    import copy

    from pipeline.model.layers import RMSNorm

    norm = RMSNorm(8)
    x = torch.randn(3, 8)

    def check(module, inp):
        with torch.inference_mode():
            got = module(inp)
        torch.testing.assert_close(got, torch.rms_norm(inp, (8,), module.weight.detach(), module.eps))

    check(norm, x)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2, 8))  # loaded in place: the same memory, new values
    check(norm, x)
    norm.weight = torch.nn.Parameter(torch.full((8,), 3.0))  # replaced
    check(norm, x)
    twin = copy.deepcopy(norm)
    with torch.no_grad():
        twin.weight.mul_(2)
    check(twin, x)
    check(norm, x)  # the original kept its own weight
    norm.double()  # converted: another dtype, another tensor
    check(norm, x.double())
    norm.bfloat16()  # a dtype the loop does not take: the torch path, until the weight changes again
    with torch.inference_mode():
        assert norm(x.bfloat16()).dtype == torch.bfloat16 and not norm._compiled.takes(x.bfloat16())
    norm.float()
    check(norm, x)
    assert norm._compiled.takes(x)  # back in the loop's dtype: the loop again
    with torch.enable_grad():  # training: the module path, which records the gradient
        y = RMSNorm(8)(x.requires_grad_())
    assert y.requires_grad


@pytest.mark.parametrize("change", ["none", "in place", "replaced", "re-pointed"])
def test_the_shared_expert_joins_the_dense_expert_path(change, monkeypatch):
    """A float32/64 MoE whose shared expert has the routed experts' shape runs it as one more expert
    of the dense path: its weights and the routed experts' are views of two fused tensors (a write in
    place is read through them), and a routed weight replaced or re-pointed after fusion sends the
    layer's experts back to ``_dense``, which reads them live. The module path's values every way."""
    from pipeline.model.fused import _FusedMoE

    cfg = tiny_config(n_group=1, topk_group=1)
    module, fused = _pair(cfg)
    moe = fused.model.layers[1].fused.mlp
    experts = fused.model.layers[1].mlp.experts
    shared = fused.model.layers[1].mlp.shared_experts
    assert experts.gate_up_proj.data_ptr() == moe.w_all.data_ptr()  # views: no second copy
    assert shared.down_proj.weight.data_ptr() == moe.down_all[-1].data_ptr()
    with torch.no_grad():
        for m in (module, fused):
            ex = m.model.layers[1].mlp.experts
            if change == "in place":
                ex.gate_up_proj.mul_(1.5)
                m.model.layers[1].mlp.shared_experts.down_proj.weight.mul_(0.5)
            elif change == "replaced":
                ex.down_proj = torch.nn.Parameter(ex.down_proj.detach() * 1.5)
            elif change == "re-pointed":
                ex.gate_up_proj.data = ex.gate_up_proj.detach() * 1.5
    joined, dense = [], []
    for name, seen in (("_dense_with_shared", joined), ("_dense", dense)):
        original = getattr(_FusedMoE, name)
        monkeypatch.setattr(
            _FusedMoE,
            name,
            lambda self, x, *a, _f=original, _seen=seen: _seen.append(x.shape[0]) or _f(self, x, *a),
        )
    n = DENSE_EXPERT_ROWS // cfg.n_routed_experts  # the most tokens of the dense path
    torch.testing.assert_close(_logits(fused, n), _logits(module, n), rtol=0, atol=1e-10)
    if change in ("none", "in place"):
        assert n in joined and not dense
    else:
        assert n in dense and not joined
