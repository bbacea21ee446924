"""The inference interface on flat batches (float64, all KV resident).

One forward may mix several requests of different lengths, in any token order, with locations chosen
by the caller; prefill, decode and multi-token verify all go through it. Each must give the logits of
a single full prefill of the same tokens.
"""

from __future__ import annotations

import torch
from _model_util import new_backend, prefill_logits, random_model, run

from pipeline.model import ForwardLayout

ATOL = 1e-10


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_mixed_requests_in_one_forward_equal_each_alone():
    model = random_model(seed=1)
    seqs = [_tokens(n, seed) for seed, n in enumerate((13, 30, 21))]
    alone = [prefill_logits(model, s) for s in seqs]
    # flatten, shuffle token order, scatter locations over the pool
    entries = [(r, p, tok) for r, s in enumerate(seqs) for p, tok in enumerate(s)]
    order = torch.randperm(len(entries), generator=torch.Generator().manual_seed(5)).tolist()
    entries = [entries[i] for i in order]
    locs = torch.randperm(200, generator=torch.Generator().manual_seed(6))[: len(entries)]
    rows, positions, ids = (list(col) for col in zip(*entries))
    backend = new_backend(model, num_rows=200, num_requests=3, max_ctx=64)
    logits = run(model, backend, ids, positions, rows=rows, locs=locs)
    for i, (r, p, _) in enumerate(entries):
        assert torch.allclose(logits[i], alone[r][p], atol=ATOL, rtol=0), (r, p)


def test_decode_and_verify_equal_full_prefill():
    model = random_model(seed=2)
    seq = _tokens(40, 9)
    full = prefill_logits(model, seq)
    backend = new_backend(model, num_rows=64, num_requests=1, max_ctx=64)
    got = [run(model, backend, seq[:20], range(20))]  # extend
    for p in range(20, 26):  # decode, one token at a time
        got.append(run(model, backend, seq[p : p + 1], [p]))
    got.append(run(model, backend, seq[26:30], range(26, 30)))  # verify-shaped chunk of 4
    # a rejected verify: rows written at 30..33 for other tokens, then rewritten by the real ones
    run(model, backend, [1, 2, 3, 4], range(30, 34))
    got.append(run(model, backend, seq[30:40], range(30, 40)))
    assert torch.allclose(torch.cat(got), full, atol=ATOL, rtol=0)


def test_requests_decoding_together_with_a_prefill():
    """A decode batch of two requests and a third request's prefill share one forward."""
    model = random_model(seed=3)
    a, b, c = _tokens(25, 1), _tokens(18, 2), _tokens(12, 3)
    backend = new_backend(model, num_rows=256, num_requests=3, max_ctx=64)
    base = {0: 0, 1: 64, 2: 128}  # request r's position p lives at base[r] + p
    run(model, backend, a[:24], range(24), rows=[0] * 24, locs=[base[0] + p for p in range(24)])
    run(model, backend, b[:17], range(17), rows=[1] * 17, locs=[base[1] + p for p in range(17)])
    ids = [a[24], b[17], *c]
    rows = [0, 1] + [2] * len(c)
    positions = [24, 17, *range(len(c))]
    logits = run(
        model, backend, ids, positions, rows=rows, locs=[base[r] + p for r, p in zip(rows, positions)]
    )
    assert torch.allclose(logits[0], prefill_logits(model, a)[24], atol=ATOL, rtol=0)
    assert torch.allclose(logits[1], prefill_logits(model, b)[17], atol=ATOL, rtol=0)
    assert torch.allclose(logits[2:], prefill_logits(model, c), atol=ATOL, rtol=0)


def test_mtp_forward_in_a_flat_batch_equals_each_alone():
    model = random_model(seed=4)
    seqs = [_tokens(20, 11), _tokens(15, 12)]

    def mtp_alone(seq):
        backend = new_backend(model, num_rows=32, num_requests=1, max_ctx=32)
        n = len(seq) - 1
        positions = torch.arange(n)
        backend.begin(ForwardLayout(torch.zeros(n, dtype=torch.int64), positions, positions))
        with torch.no_grad():
            hidden = model(torch.tensor(seq[:-1]), positions, backend)
            backend.begin(ForwardLayout(torch.zeros(n, dtype=torch.int64), positions, positions))
            return model.mtp_forward(torch.tensor(seq[1:]), positions, hidden, backend).logits

    alone = [mtp_alone(s) for s in seqs]
    backend = new_backend(model, num_rows=64, num_requests=2, max_ctx=32)
    rows = torch.tensor([0] * 19 + [1] * 14)
    positions = torch.cat([torch.arange(19), torch.arange(14)])
    locs = positions + 32 * rows
    with torch.no_grad():
        backend.begin(ForwardLayout(rows, positions, locs))
        hidden = model(torch.tensor(seqs[0][:-1] + seqs[1][:-1]), positions, backend)
        backend.begin(ForwardLayout(rows, positions, locs))
        out = model.mtp_forward(torch.tensor(seqs[0][1:] + seqs[1][1:]), positions, hidden, backend)
    assert torch.allclose(out.logits, torch.cat(alone), atol=ATOL, rtol=0)
