"""Reference decoders: plain greedy / sampling, and chain speculation with the MTP layer.

Speculative greedy decoding must reproduce plain greedy decoding token for token (float64).
"""

from __future__ import annotations

import pytest
import torch
from _model_util import random_model, tiny_config

from pipeline.model.reference import Generation, ReferenceDecoder, ReferenceSpecDecoder, Sampling


@pytest.fixture(scope="module")
def model():
    return random_model(seed=5)


@pytest.mark.parametrize("num_steps", [1, 2, 3, 5])
def test_spec_greedy_equals_plain_greedy(model, num_steps):
    prompt = list(b"def spam(eggs):\n    return eggs + 1\n")  # 37 tokens > index_topk
    plain = ReferenceDecoder(model).generate(prompt, 60, stop_at_eos=False)
    spec = ReferenceSpecDecoder(model, num_steps).generate(prompt, 60, stop_at_eos=False)
    assert spec.token_ids == plain.token_ids
    assert spec.finish_reason == "length"
    assert all(1 <= a <= num_steps + 1 for a in spec.accept_lengths)
    assert sum(spec.accept_lengths) + 1 >= 60  # the prefill's bonus token plus every verify's tokens
    assert spec.num_target_forwards == len(spec.accept_lengths) + 1


def _copying_mtp(model):
    """Make the MTP layer echo the target: ``eh_proj`` passes only the hidden state, the block adds nothing.

    The MTP output is then ``shared_head.norm(hnorm(h))`` = ``h`` (unit norms, ``h`` already normed), so it
    proposes the target's own choice at the *current* position: right exactly when the target repeats.
    """
    d = model.cfg.hidden_size
    with torch.no_grad():
        mtp = model.mtp[0]
        mtp.eh_proj.weight.zero_()
        mtp.eh_proj.weight[:, d:] = torch.eye(d, dtype=model.dtype)
        mtp.block.self_attn.o_proj.weight.zero_()
        for p in mtp.block.mlp.parameters():
            p.zero_()
        for norm in (mtp.hnorm, mtp.shared_head.norm):
            norm.weight.fill_(1.0)
    return model


def test_spec_accepts_every_draft_when_they_all_match():
    """Zero final norm: the target always says token 0, and so does the echoing MTP layer."""
    m = _copying_mtp(random_model(tiny_config(), seed=3))
    with torch.no_grad():
        m.model.norm.weight.zero_()
    spec = ReferenceSpecDecoder(m, 3).generate([7] * 12, 41, stop_at_eos=False)
    assert spec.token_ids == (0,) * 41
    assert spec.accept_lengths == (4,) * 10  # 1 bonus from the prefill + 10 rounds of 4
    assert spec.num_target_forwards == 11


def test_spec_partial_acceptance_still_equals_greedy():
    cfg = tiny_config(num_hidden_layers=1, mlp_layer_types=("dense",))
    m = _copying_mtp(random_model(cfg, seed=5, std=0.02))
    plain = ReferenceDecoder(m).generate([7] * 12, 40, stop_at_eos=False)
    spec = ReferenceSpecDecoder(m, 3).generate([7] * 12, 40, stop_at_eos=False)
    assert spec.token_ids == plain.token_ids
    assert {1, 4} <= set(spec.accept_lengths)  # rounds with none and with all drafts accepted


def test_eos_stops_both_decoders(model):
    prompt = list(b"import os\n")
    plain = ReferenceDecoder(model).generate(prompt, 30, stop_at_eos=False)
    eos = plain.token_ids[5]  # pretend this token is <eos>
    cfg_model = random_model(tiny_config(eos_token_id=eos), seed=5)
    plain_eos = ReferenceDecoder(cfg_model).generate(prompt, 30)
    spec_eos = ReferenceSpecDecoder(cfg_model, 3).generate(prompt, 30)
    first = plain.token_ids.index(eos)
    assert plain_eos == Generation(plain.token_ids[: first + 1], "eos", first + 1)
    assert spec_eos.token_ids == plain_eos.token_ids and spec_eos.finish_reason == "eos"


def test_sampling_is_seeded_and_filters(model):
    prompt = list(b"class Foo:\n")
    dec = ReferenceDecoder(model)
    a = dec.generate(prompt, 20, Sampling(temperature=1.0, top_p=0.9, seed=3), stop_at_eos=False)
    b = dec.generate(prompt, 20, Sampling(temperature=1.0, top_p=0.9, seed=3), stop_at_eos=False)
    c = dec.generate(prompt, 20, Sampling(temperature=1.0, top_p=0.9, seed=4), stop_at_eos=False)
    assert a.token_ids == b.token_ids != c.token_ids
    greedy = dec.generate(prompt, 20, stop_at_eos=False)
    for filt in (Sampling(temperature=0.7, top_k=1, seed=1), Sampling(temperature=2.0, top_p=1e-9, seed=1)):
        assert dec.generate(prompt, 20, filt, stop_at_eos=False).token_ids == greedy.token_ids


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_sampling_values_raise(bad):
    with pytest.raises(ValueError):
        Sampling(**bad)


def test_bad_requests_raise(model):
    with pytest.raises(ValueError, match="empty"):
        ReferenceDecoder(model).generate([], 4)
    with pytest.raises(ValueError, match="positive"):
        ReferenceDecoder(model).generate([1], 0)
    with pytest.raises(ValueError, match="context"):
        ReferenceDecoder(model, max_ctx=8).generate([1] * 8, 4)
    with pytest.raises(ValueError, match="MTP"):
        ReferenceSpecDecoder(random_model(tiny_config(num_nextn_predict_layers=0)), 2)
