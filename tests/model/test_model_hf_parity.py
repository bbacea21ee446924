"""hispec's model against HF transformers' DeepseekV32ForCausalLM (random tiny models, float64).

HF is patched (see ``_hf_oracle``): RMSNorm, router, indexer scores and the eager softmax compute in
max(float32, dtype) instead of float32, as hispec does, so float64 stays float64; and HF's indexer
``topk`` is replaced by a stable descending sort (ties to the lower position), hispec's top-k
contract. Contexts are longer than ``index_topk`` so the sparse selection matters.
"""

from __future__ import annotations

import pytest
import torch
from _hf_oracle import hf_float64_patches, ours_from_hf, random_hf_model, tiny_hf_config
from _model_util import new_backend, prefill_logits, run

from pipeline.model.reference import ReferenceDecoder

CONFIGS = {
    # 1 dense + 2 MoE layers, grouped routing (2 groups, keep 1)
    "dense+moe": dict(),
    # MoE everywhere, 4 groups keep 2, no prob normalisation, tied embeddings
    "all-moe": dict(first_k_dense_replace=0, n_group=4, topk_group=2, norm_topk_prob=False,
                    tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    hf_model = random_hf_model(tiny_hf_config(**CONFIGS[request.param]), seed=11)
    ours = ours_from_hf(hf_model, tmp_path_factory.mktemp(request.param))
    return hf_model, ours


def _ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_prefill_logits_match_hf(pair):
    hf_model, ours = pair
    ids = _ids(48, ours.cfg.vocab_size, 1)  # 48 > index_topk = 8
    with hf_float64_patches(), torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    got = prefill_logits(ours, ids)
    assert torch.allclose(got, expected, atol=1e-9, rtol=0), (got - expected).abs().max()


def test_indexer_topk_matches_hf(pair):
    hf_model, ours = pair
    n = 40
    ids = _ids(n, ours.cfg.vocab_size, 2)
    with hf_float64_patches(), torch.no_grad():
        hf_model(ids[None])
    backend = new_backend(ours, num_rows=n, num_requests=1, max_ctx=n)
    run(ours, backend, ids, torch.arange(n))
    k = ours.cfg.index_topk
    for layer, attn in enumerate(a.self_attn for a in hf_model.model.layers):
        theirs = attn.indexer.last_topk[0]  # [S, min(k, S)], stable order
        mine = backend.topk[layer].long()  # [S, k], -1 padded
        for t in range(n):
            visible = min(k, t + 1)
            assert torch.equal(mine[t, :visible], theirs[t, :visible]), (layer, t)
            assert (mine[t, visible:] == -1).all()
    sparse_rows = sum(1 for t in range(n) if t + 1 > k)
    assert sparse_rows > n // 2  # most queries really chose a subset


def test_greedy_generation_matches_hf_generate(pair):
    hf_model, ours = pair
    prompt = _ids(12, ours.cfg.vocab_size, 3)
    with hf_float64_patches(), torch.no_grad():
        expected = hf_model.generate(prompt[None], max_new_tokens=64, do_sample=False, use_cache=True)[0, 12:]
    got = ReferenceDecoder(ours).generate(prompt.tolist(), 64, stop_at_eos=False)
    assert len(got.token_ids) == 64
    assert list(got.token_ids) == expected.tolist()
    assert len(set(got.token_ids)) > 4  # not a degenerate constant stream
