"""The one-call CPU attention (``kernels/hisparse_attend_numba.py``) against the step-by-step path.

For HiSparse layers the steps are the backend's: the rows written, ``indexer_topk``, ``swap_in``
and ``sparse_mla``, each by its compiled loop; for all-resident layers the writes, ``indexer_topk``,
``positions_to_slots`` and ``sparse_mla``. The one call must give the same bits everywhere: the
selection, the slots and counts, every mutated table and pool, and the attention output. The
swap-in states come from the swap-in tests' worlds (misses, missing host copies, duplicate and
padding steps, verify calls that stop before a step), the selections from a real indexer pass over
random keys.
"""

from __future__ import annotations

import pytest
import torch
from _swap_in_world import CANARY, build_world
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import hisparse_attend_numba as ha
from kernels.indexer_topk import indexer_topk
from kernels.sparse_mla import sparse_mla
from kernels.swap_in import swap_in
from kernels.swap_in_policy import POLICIES
from pipeline.model.resident import positions_to_slots

LAYERS, HEADS, LATENT, ROPE, INDEX_HEADS, INDEX_DIM = 2, 2, 4, 2, 2, 3
DIM = LATENT + ROPE


def _case(seed: int, *, num_reqs: int, num_steps: int, top_k: int, hot: int, extra: int, p_no_host: float):
    """A swap-in world lifted to ``LAYERS`` layers, a token table, indexer keys and the new tokens."""
    w = build_world(seed, num_reqs=num_reqs, num_steps=num_steps, top_k=top_k, hot=hot, extra=extra, dim=DIM,
                    p_no_host=p_no_host)
    g = torch.Generator().manual_seed(seed + 1)
    layer = int(torch.randint(0, LAYERS, (1,), generator=g))
    device = w.device_full[CANARY:-CANARY]
    host = w.host_full[CANARY:-CANARY]
    n_rows, max_ctx = w.req_to_host.shape
    lens = w.seq_lens.reshape(-1)
    num_tokens = lens.numel()
    logical = n_rows * max_ctx + num_tokens
    req_to_token = torch.randperm(logical, generator=g)[: n_rows * max_ctx].view(n_rows, max_ctx)
    used = torch.zeros(logical, dtype=torch.bool)
    used[req_to_token.reshape(-1)] = True
    rows = w.req_rows.repeat_interleave(num_steps)
    # each token's key at its own position's location (a padding step's at a location nobody reads)
    own = req_to_token[rows, (lens - 1).clamp(min=0)]
    write_locs = torch.where(lens > 0, own, torch.nonzero(~used)[:num_tokens, 0])
    write_slots = torch.randperm(device.shape[0], generator=g)[:num_tokens]
    return dict(
        world=w,
        layer=layer,
        kv=torch.stack([device + 100 * i for i in range(LAYERS)]),
        host=torch.stack([host - 100 * i for i in range(LAYERS)]),
        keys=torch.randn(LAYERS, logical, INDEX_DIM, generator=g),
        tokens=torch.stack([w.buffer_tokens] * LAYERS),
        lru=torch.stack([w.lru] * LAYERS),
        req_to_token=req_to_token,
        rows=rows,
        lens=lens,
        write_locs=write_locs,
        write_slots=write_slots,
        **_layer_inputs(num_tokens, g),
    )


def _layer_inputs(num_tokens: int, g: torch.Generator) -> dict:
    """A layer's new rows, indexer inputs and queries for ``num_tokens`` tokens, drawn from ``g``."""
    return dict(
        kv_rows=torch.randn(num_tokens, DIM, generator=g),
        index_k=torch.randn(num_tokens, INDEX_DIM, generator=g),
        index_q=torch.randn(num_tokens, INDEX_HEADS, INDEX_DIM, generator=g),
        index_w=torch.randn(num_tokens, INDEX_HEADS, generator=g),
        q_latent=torch.randn(num_tokens, HEADS, LATENT, generator=g),
        q_rope=torch.randn(num_tokens, HEADS, ROPE, generator=g),
    )


def _clone(case: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def _step_by_step(c: dict, top_k: int, steps: int, policy: str):
    layer, w = c["layer"], c["world"]
    kv, keys = c["kv"][layer], c["keys"][layer]
    kv[c["write_slots"]] = c["kv_rows"]
    keys[c["write_locs"]] = c["index_k"]
    top = indexer_topk(c["index_q"], c["index_w"], keys, c["req_to_token"], c["rows"], c["lens"], top_k, 0.7,
                       impl="numba")
    batch = top.shape[0] // steps
    result = swap_in(
        top.view(batch, steps, top_k),
        c["lens"].view(batch, steps),
        w.req_rows,
        c["tokens"][layer],
        w.buffer_locs,
        c["lru"][layer],
        w.req_to_host,
        c["host"][layer],
        kv,
        w.hot,
        impl="numba",
        policy=policy,
    )
    out = None
    if result.all_steps_done(steps):
        out = sparse_mla(c["q_latent"], c["q_rope"], kv, result.slots.view(-1, top_k), 0.3, impl="numba")
    return out, top, result


def _one_call(c: dict, top_k: int, steps: int, policy: str):
    w = c["world"]
    pools = ha.Pools(
        c["kv"], c["keys"], c["tokens"], w.buffer_locs, c["lru"], c["host"], c["req_to_token"], w.req_to_host
    )
    return ha.attend(
        pools,
        c["layer"],
        c["write_slots"],
        c["kv_rows"],
        c["write_locs"],
        c["index_k"],
        c["index_q"],
        c["index_w"],
        c["rows"],
        c["lens"],
        0.7,
        top_k,
        steps,
        w.hot,
        policy,
        c["q_latent"],
        c["q_rope"],
        0.3,
    )


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_reqs=st.integers(1, 3),
    num_steps=st.integers(1, 4),
    hot=st.sampled_from([4, 5, 8, 16]),
    top_k=st.integers(1, 16),
    extra=st.integers(1, 4),
    p_no_host=st.sampled_from([0.0, 0.1, 0.4]),
    policy=st.sampled_from(POLICIES),
)
def test_one_call_equals_the_steps(seed, num_reqs, num_steps, hot, top_k, extra, p_no_host, policy):
    top_k = min(top_k, hot)
    case = _case(
        seed, num_reqs=num_reqs, num_steps=num_steps, top_k=top_k, hot=hot, extra=extra, p_no_host=p_no_host
    )
    expected_case, got_case = _clone(case), _clone(case)
    out_a, top_a, res_a = _step_by_step(expected_case, top_k, num_steps, policy)
    out_b, top_b, res_b = _one_call(got_case, top_k, num_steps, policy)
    assert torch.equal(top_a, top_b)
    assert torch.equal(res_a.slots, res_b.slots)
    assert torch.equal(res_a.counts, res_b.counts)
    assert res_a.totals == res_b.totals  # hits, misses, unrecoverable, bytes copied (misses x row bytes)
    complete = res_b.all_steps_done(num_steps)
    assert complete == res_a.all_steps_done(num_steps)
    assert complete == bool((res_b.steps_done == num_steps).all())  # the flag says what the counts say
    for name in ("kv", "keys", "tokens", "lru", "host"):  # every layer: the other layer is left alone
        assert torch.equal(expected_case[name], got_case[name]), name
    if complete:
        assert torch.equal(out_a, out_b)
    else:
        assert out_b is None


def test_a_verify_that_stops_hands_back_the_resolved_steps():
    """``hot == top_k`` with long steps: the second step cannot fit beside the first's columns."""
    for seed in range(40):
        case = _case(seed, num_reqs=2, num_steps=3, top_k=4, hot=4, extra=2, p_no_host=0.0)
        if int(case["lens"].min()) <= 4:
            continue
        out, _, result = _one_call(_clone(case), 4, 3, "lru")
        if not result.all_steps_done(3):
            assert out is None and int(result.steps_done.min()) < 3
            return
    pytest.fail("no case stopped early")


def _resident_case(seed: int, *, num_tokens: int, top_k: int):
    g = torch.Generator().manual_seed(seed)
    rows_total, n_req, max_ctx = 60, 3, 16
    table = torch.randperm(rows_total, generator=g)[: n_req * max_ctx].view(n_req, max_ctx)
    table[torch.rand(n_req, max_ctx, generator=g) < 0.1] = -1  # a location not recorded
    rows = torch.randint(0, n_req, (num_tokens,), generator=g).sort().values
    lens = torch.randint(1, max_ctx + 1, (num_tokens,), generator=g)
    locs = torch.randperm(rows_total, generator=g)[:num_tokens]
    return dict(
        kv=torch.randn(LAYERS, rows_total, DIM, generator=g),
        keys=torch.randn(LAYERS, rows_total, INDEX_DIM, generator=g),
        table=table,
        rows=rows,
        lens=lens,
        locs=locs,
        layer=int(torch.randint(0, LAYERS, (1,), generator=g)),
        **_layer_inputs(num_tokens, g),
    )


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), num_tokens=st.integers(1, 8), top_k=st.integers(1, 20))
def test_resident_one_call_equals_the_steps(seed, num_tokens, top_k):
    a, b = (
        _resident_case(seed, num_tokens=num_tokens, top_k=top_k),
        _resident_case(seed, num_tokens=num_tokens, top_k=top_k),
    )
    layer = a["layer"]
    a["kv"][layer][a["locs"]] = a["kv_rows"]
    a["keys"][layer][a["locs"]] = a["index_k"]
    top = indexer_topk(
        a["index_q"],
        a["index_w"],
        a["keys"][layer],
        a["table"],
        a["rows"],
        a["lens"],
        top_k,
        0.7,
        impl="numba",
    )
    out = sparse_mla(
        a["q_latent"],
        a["q_rope"],
        a["kv"][layer],
        positions_to_slots(top, a["table"], a["rows"]),
        0.3,
        impl="numba",
    )
    got, got_top = ha.attend_resident(
        b["kv"].numpy(),
        b["keys"].numpy(),
        layer,
        b["locs"],
        b["kv_rows"],
        b["index_k"],
        b["index_q"],
        b["index_w"],
        b["table"],
        b["rows"],
        b["lens"],
        0.7,
        top_k,
        b["q_latent"],
        b["q_rope"],
        0.3,
    )
    assert torch.equal(top, got_top)
    assert torch.equal(out, got)
    assert torch.equal(a["kv"], b["kv"]) and torch.equal(a["keys"], b["keys"])


def test_fits_only_cpu_tensors_of_one_float_dtype_and_small_shapes():
    q = torch.zeros(1, 4, 64)
    kv, keys, iq = torch.zeros(1, 8, 80), torch.zeros(1, 8, 32), torch.zeros(1, 4, 32)
    assert ha.fits(q, kv, keys, iq, kv, 64)
    assert not ha.fits(q.double(), kv, keys, iq, kv, 64)  # mixed dtypes
    assert not ha.fits(q.half(), kv.half(), keys.half(), iq.half(), kv.half(), 64)  # not float32/64
    assert not ha.fits(q, kv, keys, iq, kv.double(), 64)  # the host rows in another dtype
    assert not ha.fits(q, kv, keys, torch.zeros(1, 64, 32), kv, 64)  # an indexer the matmuls serve better
    assert not ha.fits(
        torch.zeros(1, 128, 64), torch.zeros(1, 8, 1088), keys, iq, torch.zeros(1, 8, 1088), 2048
    )


def test_warm_up_compiles_both_calls():
    ha.warm_up(torch.float32)
    assert ha._attend.signatures and ha._attend_resident.signatures
