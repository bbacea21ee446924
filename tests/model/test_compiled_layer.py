"""A decoder layer's compiled few-token path (``kernels.layer_numba``, taken by ``FusedLayer``)
against the fused torch path it replaces.

Same weights, same backend state: float64 logits agree to rounding over dense and MoE layers, both
indexer ropes, GLM-style shared indexer layers, routing with and without normalisation and scaling,
with and without a shared expert; each token of a call gets the bits it gets alone; the path is
taken only where it applies (few CPU tokens of a float32/64 model, ungrouped routing) and a replaced
or re-pointed weight is never read stale.
"""

from __future__ import annotations

import pytest
import torch
from _model_util import new_backend, random_model, run, tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import layer_numba
from pipeline.model import AttentionInputs, ForwardLayout, ResidentBackend, fused
from pipeline.model.fused import MAX_HYBRID_TOKENS, fuse_for_inference


def _fused(cfg, dtype=torch.float64, seed=0):
    model = random_model(cfg, seed=seed).to_dtype(dtype)
    assert fuse_for_inference(model) == cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    return model


def _decode_logits(model, n: int, batch: int, seed: int = 0) -> torch.Tensor:
    """A prefill of ``batch`` requests of ``n`` tokens, then one decode token each; the decode
    forward's logits ``[batch, V]``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size - 1, (batch, n + 1), generator=gen)
    backend = new_backend(model, num_rows=batch * (n + 1), num_requests=batch, max_ctx=n + 1)
    rows = torch.arange(batch).repeat_interleave(n)
    positions = torch.arange(n).repeat(batch)
    run(model, backend, ids[:, :n].reshape(-1), positions, rows, rows * (n + 1) + positions)
    rows1 = torch.arange(batch)
    return run(model, backend, ids[:, n], torch.full((batch,), n), rows1, rows1 * (n + 1) + n)


def _count_calls(monkeypatch) -> list[tuple[str, int]]:
    """Each layer forward the loops take: ("whole", tokens) or ("hybrid", tokens), and ("route",
    tokens) after a hybrid one whose router the loops ran."""
    calls: list[tuple[str, int]] = []
    project, assemble, route = layer_numba.project, layer_numba.assemble, layer_numba.route
    monkeypatch.setattr(
        layer_numba, "route", lambda h, *a: calls.append(("route", h.shape[0])) or route(h, *a)
    )
    monkeypatch.setattr(
        layer_numba, "project", lambda x, *a: calls.append(("whole", x.shape[0])) or project(x, *a)
    )
    monkeypatch.setattr(
        layer_numba, "assemble", lambda p, *a: calls.append(("hybrid", p.shape[0])) or assemble(p, *a)
    )
    return calls


_INPUTS = ("q_latent", "q_rope", "kv_rows", "index_q", "index_w", "index_k")


def _both_ways(
    model, monkeypatch, n: int, batch: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, list]:
    """The decode logits with the compiled layer and without it, and the token counts it took;
    what each layer of the decode forward handed its backend is the same both ways, to rounding."""
    calls = _count_calls(monkeypatch)
    seen: list[AttentionInputs] = []
    attend = ResidentBackend.attend
    monkeypatch.setattr(
        ResidentBackend, "attend", lambda self, inputs: seen.append(inputs) or attend(self, inputs)
    )
    compiled = _decode_logits(model, n, batch, seed)
    compiled_inputs = seen[-model.cfg.num_hidden_layers :]
    with monkeypatch.context() as off:
        off.setattr(fused, "MAX_HYBRID_TOKENS", 0)
        torch_path = _decode_logits(model, n, batch, seed)
    for mine, theirs in zip(compiled_inputs, seen[-model.cfg.num_hidden_layers :], strict=True):
        assert (mine.layer, mine.top_k, mine.reuse_topk) == (theirs.layer, theirs.top_k, theirs.reuse_topk)
        for name in _INPUTS:
            a, b = getattr(mine, name), getattr(theirs, name)
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=name)
    return compiled, torch_path, calls


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(9, 30),
    batch=st.integers(1, layer_numba.MAX_TOKENS + 4),  # beyond MAX_TOKENS: BLAS's matmuls, the loops between
    shared_indexer=st.booleans(),
    glm=st.booleans(),
    experts=st.sampled_from([(4, 1), (4, 2), (8, 3)]),
    shared_experts=st.sampled_from([0, 1]),
    normalise=st.booleans(),
    scaling=st.sampled_from([1.0, 2.5]),
    seed=st.integers(0, 3),
)
def test_compiled_layer_equals_the_torch_path(
    n, batch, shared_indexer, glm, experts, shared_experts, normalise, scaling, seed
):
    """float64, every layer kind the loops take, a few tokens (the loops do everything) and more
    (BLAS does the matmuls and the MLP): the decode forward's logits and what each layer handed its
    backend to rounding, and every layer of it ran through the loops."""
    e, k = experts
    over = dict(
        n_routed_experts=e,
        num_experts_per_tok=k,
        n_group=1,
        topk_group=1,
        n_shared_experts=shared_experts,
        norm_topk_prob=normalise,
        routed_scaling_factor=scaling,
    )
    if glm:  # the indexer rotates interleaved pairs
        over["model_type"] = "glm_moe_dsa"
    if shared_indexer:  # the second layer reuses the first one's selection
        over["indexer_types"] = ("full", "shared")
    model = _fused(tiny_config(**over), seed=seed)
    with pytest.MonkeyPatch.context() as mp:
        compiled, torch_path, calls = _both_ways(model, mp, n, batch, seed)
    how = "whole" if batch <= layer_numba.MAX_TOKENS else "hybrid"
    layers = model.cfg.num_hidden_layers
    # the decode forward's (the target's layers: dense, then MoE, whose router a hybrid layer runs compiled)
    decode = [(how, batch)] * layers + ([("route", batch)] if how == "hybrid" else [])
    assert calls[-len(decode) :] == decode
    torch.testing.assert_close(compiled, torch_path, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_token_gets_the_bits_it_gets_alone(dtype):
    """One decode forward over four requests' tokens gives each request the hidden state of a
    decode forward of its token alone, bit for bit (the loops run each token by itself; the head's
    matmul after them is BLAS's, whose rounding may depend on the batch)."""
    model = _fused(tiny_config(n_group=1, topk_group=1), dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, 13), generator=gen)
    backend = new_backend(model, num_rows=4 * 13, num_requests=4, max_ctx=13)
    for b in range(4):  # each prompt prefilled by itself: the same rows whatever the batch
        run(model, backend, ids[b, :12], torch.arange(12), [b] * 12, b * 13 + torch.arange(12))

    def hidden(rows: list[int]) -> torch.Tensor:
        rows_t = torch.tensor(rows)
        positions = torch.full((len(rows),), 12)
        backend.begin(ForwardLayout(req_rows=rows_t, positions=positions, write_locs=rows_t * 13 + 12))
        with torch.no_grad():
            return model(ids[rows_t, 12], positions, backend)

    together = hidden([0, 1, 2, 3])
    for b in range(4):
        assert torch.equal(hidden([b])[0], together[b])


def test_where_the_loops_do_not_apply_the_torch_path_runs(monkeypatch):
    """Grouped routing (a group mask) keeps the torch MLP (the loops do the attention side between
    BLAS's matmuls); a bfloat16 model and more than ``MAX_HYBRID_TOKENS`` tokens keep the torch path
    altogether. The values are the module path's there too (the other tests of the fused path)."""
    calls = _count_calls(monkeypatch)
    grouped = _fused(tiny_config(n_group=2, topk_group=1))  # the MoE layer masks a group
    _decode_logits(grouped, 10, 2)
    assert calls[-2:] == [("whole", 2), ("hybrid", 2)]  # the decode's dense layer, grouped MoE layer
    calls.clear()
    _decode_logits(_fused(tiny_config(n_group=1, topk_group=1), dtype=torch.bfloat16), 10, 2)
    assert calls == []
    _decode_logits(_fused(tiny_config(n_group=1, topk_group=1)), 1, MAX_HYBRID_TOKENS + 1)
    assert calls == []  # the prefill (a token per request) and the decode: more than the bound


@pytest.mark.parametrize("how", ["replaced", "re-pointed", "in place"])
def test_a_changed_weight_is_never_read_stale(how, monkeypatch):
    """A norm weight, the value up-projection and an expert's weights changed after the first
    compiled forward: a new Parameter or ``.data`` re-pointed makes the layer take its weights again,
    a write in place is read through the views; the compiled logits follow the torch path's."""
    model = _fused(tiny_config(n_group=1, topk_group=1))
    _decode_logits(model, 10, 2)
    layer = model.model.layers[1]
    targets = [
        (layer.post_attention_layernorm, "weight"),
        (layer.self_attn.kv_b_proj, "weight"),
        (layer.mlp.experts, "down_proj"),
    ]
    with torch.no_grad():
        for module, name in targets:
            old = getattr(module, name)
            if how == "replaced":
                setattr(module, name, torch.nn.Parameter(old.detach() * 1.7))
            elif how == "re-pointed":
                old.data = old.detach() * 1.7
            else:
                old.mul_(1.7)
    compiled, torch_path, calls = _both_ways(model, monkeypatch, 10, 2)
    assert calls[-2:] == [("whole", 2), ("whole", 2)]
    torch.testing.assert_close(compiled, torch_path, rtol=0, atol=1e-10)
    fresh = _fused(tiny_config(n_group=1, topk_group=1))
    assert not torch.allclose(compiled, _decode_logits(fresh, 10, 2))  # the change is seen


def test_a_weight_the_loops_cannot_view_keeps_the_torch_path(monkeypatch):
    """A parameter that is not contiguous (here the value up-projection, re-pointed at a transposed
    copy's transpose) is not viewed by the loops: that layer runs the torch path, with its values."""
    model = _fused(tiny_config(n_group=1, topk_group=1))
    kv_b = model.model.layers[1].self_attn.kv_b_proj
    with torch.no_grad():
        kv_b.weight.data = kv_b.weight.detach().t().contiguous().t()
    assert not kv_b.weight.is_contiguous()
    compiled, torch_path, calls = _both_ways(model, monkeypatch, 10, 2)
    assert calls[-1:] == [("whole", 2)]  # the decode's first layer only
    torch.testing.assert_close(compiled, torch_path, rtol=0, atol=1e-10)


def test_how_many_tokens_the_loops_take_follows_the_layers_bytes(monkeypatch):
    """``tokens_for``: ``LOOP_BYTES`` over a layer's bytes (the arrays its loops read), between 8 and
    32 tokens; each layer of a forward decides by its own bytes."""
    assert layer_numba.tokens_for(1) == layer_numba.MAX_TOKENS == 32
    assert layer_numba.tokens_for(layer_numba.LOOP_BYTES // 14) == 14
    assert layer_numba.tokens_for(layer_numba.LOOP_BYTES) == layer_numba.MIN_TOKENS == 8
    model = _fused(tiny_config(n_group=1, topk_group=1))
    dense, moe = (fused._CompiledWeights(layer.fused) for layer in model.model.layers)
    assert 0 < dense.nbytes < moe.nbytes < 1 << 20  # (a tiny model's: each takes 32 tokens)
    # a budget of 9 of the dense layer's sizes: it takes 9 tokens, the larger MoE layer 8
    monkeypatch.setattr(layer_numba, "LOOP_BYTES", 9 * dense.nbytes)
    monkeypatch.setattr(layer_numba, "MIN_TOKENS", 1)
    calls = _count_calls(monkeypatch)
    _decode_logits(model, 12, 9)
    assert calls[-3:] == [("whole", 9), ("hybrid", 9), ("route", 9)]
    _decode_logits(model, 12, 10)
    assert calls[-3:] == [("hybrid", 10), ("hybrid", 10), ("route", 10)]
