"""The batched training forward reuses the inference model's modules and matches its numerics."""

from __future__ import annotations

import torch
from _model_util import new_backend, prefill_logits, random_model

from pipeline.model import ForwardLayout
from pipeline.model.reference import DecodeSession
from pipeline.model.training import (
    DENSE,
    SPARSE,
    SPARSE_STABLE,
    mtp_chain,
    mtp_hidden,
    target_hidden,
    train_forward,
)


def _batch(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def test_sparse_training_forward_equals_inference():
    model = random_model(seed=1)
    ids = _batch(2, 40, 1)  # 40 > index_topk: really sparse
    with torch.no_grad():
        hidden = target_hidden(model, ids, SPARSE_STABLE)
    for b in range(2):
        assert torch.allclose(model.logits(hidden[b]), prefill_logits(model, ids[b]), atol=1e-10, rtol=0)


def test_training_mtp_equals_inference_mtp():
    model = random_model(seed=2)
    ids = _batch(1, 30, 2)
    with torch.no_grad():
        hidden = target_hidden(model, ids, SPARSE_STABLE)
        h_train = mtp_hidden(model, ids, hidden, SPARSE_STABLE)[0]  # [29, D]
        backend = new_backend(model, num_rows=32, num_requests=1, max_ctx=32)
        positions = torch.arange(29)
        backend.begin(ForwardLayout(torch.zeros(29, dtype=torch.int64), positions, positions))
        h_inf = model.mtp_forward(ids[0, 1:], positions, hidden[0, :29], backend).hidden
    assert torch.allclose(h_train, h_inf, atol=1e-10, rtol=0)


def test_dense_and_sparse_agree_within_top_k_and_differ_beyond():
    model = random_model(seed=3)
    ids = _batch(1, 24, 3)
    with torch.no_grad():
        dense = target_hidden(model, ids, DENSE)[0]
        sparse = target_hidden(model, ids, SPARSE)[0]
    k = model.cfg.index_topk
    assert torch.allclose(dense[:k], sparse[:k], atol=1e-12, rtol=0)
    assert not torch.allclose(dense[k:], sparse[k:], atol=1e-6, rtol=0)


def _grads(model, ids, **weights):
    model.zero_grad()
    out = train_forward(model, ids, mode=SPARSE, **weights)
    out.loss.backward()
    return out, {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def test_indexer_learns_only_from_its_kl_loss():
    model = random_model(seed=4).to(torch.float32).train()
    ids = _batch(2, 24, 4)
    _, without_kl = _grads(model, ids, kl_weight=0.0)
    out, with_kl = _grads(model, ids, kl_weight=1.0)
    for name in with_kl:
        if ".indexer." in name:  # detached inputs: the indexer's only gradient is the KL's
            assert not without_kl[name].any(), name
        else:  # and the KL changes no other gradient
            assert torch.equal(with_kl[name], without_kl[name]), name
    assert any(with_kl[n].any() for n in with_kl if ".indexer." in n)
    assert out.kl_loss > 0
    counts = list(out.expert_counts.values())
    assert len(counts) == 2  # the target's MoE layer and the MTP layer's
    assert int(counts[0].sum()) == ids.numel() * model.cfg.num_experts_per_tok


def test_chain_training_passes_equal_serving_chain_steps():
    """Pass j at slot t sees what chain step j sees when drafting from a context of t-j+2 tokens."""
    model = random_model(seed=6)
    ids = _batch(1, 36, 6)
    with torch.no_grad():
        hidden = target_hidden(model, ids, SPARSE_STABLE)
        passes = mtp_chain(model, ids, hidden, SPARSE_STABLE, steps=3)  # 3 x [1, 35, D]
        seq = ids[0].tolist()
        for n in (5, 20, 30):  # n committed tokens; slots up to n + 1 > index_topk
            s = DecodeSession(model, 64)
            h_target = s.target(seq[:n], 0)
            h, _ = s.mtp(seq[1 : n + 1], h_target, 0)  # draft extend: slots 0..n-1
            assert torch.allclose(h[-1], passes[0][0, n - 1], atol=1e-10, rtol=0)
            h2, _ = s.mtp([seq[n + 1]], h[-1:], n)  # chain step 2 at slot n
            assert torch.allclose(h2[0], passes[1][0, n], atol=1e-10, rtol=0)
            h3, _ = s.mtp([seq[n + 2]], h2, n + 1)  # chain step 3 at slot n + 1
            assert torch.allclose(h3[0], passes[2][0, n + 1], atol=1e-10, rtol=0)
