"""The batched training forward reuses the inference model's modules and matches its numerics;
``hispec train``'s defaults are the bundled model's recipe, and the corpus selections are explicit."""

from __future__ import annotations

import pytest
import torch
from _model_util import new_backend, prefill_logits, random_model

import pipeline.model.corpus as corpus
from pipeline.model import ForwardLayout
from pipeline.model.reference import DecodeSession
from pipeline.model.train import Phase, build_parser, phases
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
    return out, {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


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


# The bundled model's recipe (docs/model-card.md): steps x batch x window per phase, MTP trained for
# 3-step chains in every phase, no long windows inside the sparse phase.
BUNDLED_RECIPE = [
    Phase("dense", 400, DENSE, 12, 256, mtp_steps=3, long_every=0),
    Phase("sparse", 900, SPARSE, 3, 1024, mtp_steps=3, long_every=0),
    Phase("long", 60, SPARSE, 1, 4096, mtp_steps=3, long_every=0),
]


def _args(*argv: str):
    """``hispec train`` arguments (``--out`` is required; these tests never write)."""
    return build_parser().parse_args(["--out", "unused", *argv])


def test_train_defaults_are_the_bundled_recipe():
    args = _args()
    plan = phases(args)
    assert plan == BUNDLED_RECIPE
    assert [(p.name, p.steps, p.batch, p.seq_len, p.mtp_steps, p.long_every) for p in plan] == [
        ("dense", 400, 12, 256, 3, 0),
        ("sparse", 900, 3, 1024, 3, 0),
        ("long", 60, 1, 4096, 3, 0),
    ]
    for p in plan:  # every step of a phase takes the phase's own shape
        assert {p.shape(i, args) for i in range(p.steps)} == {(p.batch, p.seq_len)}
    assert (args.lr, args.warmup, args.mtp_weight, args.kl_weight, args.seed) == (2e-3, 100, 0.3, 1.0, 0)
    # the command the bundled model was trained with (the code of 0f138ec) means the same now
    card = ["--threads", "1", "--sparse-batch", "3", "--sparse-seq-len", "1024", "--long-steps", "60"]
    assert phases(_args(*card)) == BUNDLED_RECIPE
    assert args.corpus == corpus.DEFAULT_SELECTION == corpus.STDLIB_V2
    assert _args("--corpus", "stdlib-v1").corpus == corpus.STDLIB_V1


def test_train_recipe_options_are_opt_in():
    args = _args("--long-every", "4", "--dense-mtp-steps", "1", "--mtp-steps", "2")
    dense, sparse, long = phases(args)
    assert (dense.mtp_steps, sparse.mtp_steps, long.mtp_steps) == (1, 2, 2)
    assert sparse.long_every == 4 and dense.long_every == long.long_every == 0
    assert [sparse.shape(i, args) for i in range(8)] == ([(3, 1024)] * 3 + [(1, 4096)]) * 2
    # without --dense-mtp-steps the dense phase follows --mtp-steps
    assert phases(_args("--mtp-steps", "2"))[0].mtp_steps == 2


def _is_generated(doc: corpus.Document) -> bool:
    return doc.name == "pydoc_data/topics.py" or doc.data.startswith(b'""" Python Character Mapping Codec')


def test_corpus_selections():
    """stdlib-v1 (the bundled model's data) = the default selection + the generated files it skips."""
    v2 = {d.name: d for d in corpus.stdlib_documents()}
    v1 = {d.name: d for d in corpus.stdlib_documents(corpus.STDLIB_V1)}
    assert v2 == {d.name: d for d in corpus.stdlib_documents(corpus.STDLIB_V2)}
    assert set(v2) < set(v1)
    assert all(v1[n] == d for n, d in v2.items())
    extra = [v1[n] for n in set(v1) - set(v2)]
    assert all(_is_generated(d) for d in extra)
    assert not any(_is_generated(d) for d in v2.values())
    assert {"pydoc_data/topics.py", "encodings/cp1252.py", "encodings/cp437.py"} <= {d.name for d in extra}
    topics = {n for n in v2 if n.startswith("pydoc_data/topics/")}
    assert topics and topics == {n for n in v1 if n.startswith("pydoc_data/topics/")}
    assert list(v1) == sorted(v1) and list(v2) == sorted(v2)
    with pytest.raises(ValueError, match="stdlib-v3"):
        corpus.stdlib_documents("stdlib-v3")


def test_build_corpus_passes_the_selection(monkeypatch):
    seen = []
    docs = [corpus.Document(name=f"doc{i}.py", data=b"x = 1\n") for i in range(40)]
    monkeypatch.setattr(corpus, "stdlib_documents", lambda selection: seen.append(selection) or docs)
    built = corpus.build_corpus(selection=corpus.STDLIB_V1)
    corpus.build_corpus()
    assert seen == [corpus.STDLIB_V1, corpus.STDLIB_V2]
    assert sorted(built.train_names + built.held_out_names) == sorted(d.name for d in docs)
    assert built.train.numel() + built.held_out.numel() == 40 * 7
