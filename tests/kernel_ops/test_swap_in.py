"""Swap-in: hand-worked examples of the contract, then oracle == torch reference == Triton on random
worlds."""

from __future__ import annotations

import pytest
import torch
from _swap_in_world import CANARY, World, assert_canaries, assert_same, build_world, worlds
from hypothesis import HealthCheck, given, settings

from kernels.swap_in import swap_in
from kernels.swap_in_oracle import swap_in_oracle

IMPLS = ["oracle", "torch", "numba", pytest.param("triton", marks=pytest.mark.interpreter)]


def run(impl: str, world: World, **kw):
    if impl == "oracle":
        return swap_in_oracle(*world.args())
    return swap_in(*world.args(), impl=impl, validate=True, **kw)


def _hand_world(tokens, locs, lru, top, lens, *, hot, host_missing=(), max_ctx=32, dim=2) -> World:
    """One request (row 0) with host slot == position, except ``host_missing``."""
    host = torch.arange(max_ctx, dtype=torch.int64)
    host[list(host_missing)] = -1
    width = len(tokens)
    return World(
        top_k_pos=torch.tensor([top], dtype=torch.int32),
        seq_lens=torch.tensor([lens], dtype=torch.int64),
        req_rows=torch.tensor([0]),
        buffer_tokens=torch.tensor([tokens], dtype=torch.int32),
        buffer_locs=torch.tensor([locs], dtype=torch.int64),
        lru=torch.tensor([lru], dtype=torch.int32),
        req_to_host=host[None],
        host_full=torch.arange((max_ctx + 2 * CANARY) * dim, dtype=torch.float32).view(-1, dim),
        device_full=torch.full((width + 2 * CANARY, dim), -1.0),
        hot=hot,
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_worked_example_long_path_protection_and_stop(impl):
    # hot columns 0..3, newest column 4 (position 20), draft column 5 (empty); slots == columns
    w = _hand_world(
        [10, 11, 12, 13, 20, -1],
        [0, 1, 2, 3, 4, 5],
        [2, 0, 3, 1],
        top=[[11, 20, 14, 11], [15, 10, 14, 21], [22, 16, 17, 10]],
        lens=[21, 22, 23],
        hot=4,
        host_missing=[15],
    )
    before = w.clone()
    res = run(impl, w)
    # step 0: 11 hit (col 1), 20 newest, 14 loaded into the LRU-most col 2; LRU [0, 3 | 2 | 1]
    # step 1: 10 hit (col 0), 14 hit (col 2), 15 unrecoverable, 21 loaded into col 3 (col 1 protected);
    #         LRU [- | 1 | 3 | 0, 2]
    # step 2: three misses, no evictable column (0 hit, 1..3 protected) -> stop before it
    assert res.slots.tolist() == [[[1, 4, 2, 1], [-1, 0, 2, 3], [-1, -1, -1, -1]]]
    assert res.steps_done.tolist() == [2]
    assert (res.hits.tolist(), res.misses.tolist(), res.unrecoverable.tolist()) == ([4], [2], [1])
    assert res.bytes_copied.tolist() == [2 * 2 * 4]
    assert w.buffer_tokens.tolist() == [[10, 11, 14, 21, 20, -1]]
    assert w.lru.tolist() == [[1, 3, 0, 2]]
    dev = w.device_full[CANARY:-CANARY]
    host = w.host_full[CANARY:-CANARY]
    assert torch.equal(dev[2], host[14]) and torch.equal(dev[3], host[21])
    untouched = [0, 1, 4, 5]
    assert torch.equal(dev[untouched], before.device_full[CANARY:-CANARY][untouched])
    assert_canaries(before, w)


@pytest.mark.parametrize("impl", IMPLS)
def test_fast_path_identity_then_draft_columns(impl):
    # column 2 has no slot (capacity), so position 2 is found in the newest column 4; 1 has neither
    w = _hand_world(
        [0, 1, 2, 3, 2, -1],
        [7, -1, -1, 9, 10, 11],
        [3, 2, 1, 0],
        top=[[2, 0, 2, 3], [1, 0, -1, 0]],
        lens=[3, 4],
        hot=4,
        max_ctx=8,
    )
    before = w.clone()
    w.device_full = torch.full((12 + 2 * CANARY, 2), -1.0)
    before.device_full = w.device_full.clone()
    res = run(impl, w)
    assert res.slots.tolist() == [[[10, 7, 10, -1], [-1, 7, -1, 7]]]
    assert (res.hits.tolist(), res.misses.tolist(), res.unrecoverable.tolist()) == ([3], [0], [1])
    assert res.steps_done.tolist() == [2]
    assert torch.equal(w.lru, before.lru) and torch.equal(w.buffer_tokens, before.buffer_tokens)
    assert torch.equal(w.device_full, before.device_full)


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_steps_change_nothing_and_count_as_done(impl):
    w = _hand_world(
        [10, 11, 12, 13, 20, -1],
        [0, 1, 2, 3, 4, 5],
        [0, 1, 2, 3],
        top=[[14, 15, 16, 17], [14, -1, -1, -1], [18, 19, 16, 17]],
        lens=[0, 21, 0],
        hot=4,
    )
    res = run(impl, w)
    assert res.slots.tolist() == [[[-1] * 4, [0, -1, -1, -1], [-1] * 4]]
    assert res.steps_done.tolist() == [3]
    assert w.lru.tolist() == [[1, 2, 3, 0]] and w.buffer_tokens[0, 0] == 14


@pytest.mark.parametrize("impl", IMPLS)
def test_protection_spans_fast_and_long_steps(impl):
    # step 0 (fast) returns identity columns 0..3; step 1 (long) then has nothing to evict -> stop
    w = _hand_world(
        [0, 1, 2, 3, -1, -1],
        [0, 1, 2, 3, 4, 5],
        [0, 1, 2, 3],
        top=[[0, 1, 2, 3], [4, 5, 6, 7]],
        lens=[4, 8],
        hot=4,
    )
    res = run(impl, w.clone())
    assert res.steps_done.tolist() == [1]
    assert res.slots[0, 1].tolist() == [-1] * 4
    again = w.clone()
    again.top_k_pos, again.seq_lens = again.top_k_pos[:, 1:].contiguous(), again.seq_lens[:, 1:].contiguous()
    res = run(impl, again)  # the caller's second call for the rest: protection starts afresh
    assert res.steps_done.tolist() == [1] and res.misses.tolist() == [4]


@pytest.mark.parametrize("impl", IMPLS)
def test_hit_columns_are_protected_too(impl):
    # step 0: 11 hit (col 1), 14 loaded into col 2 -> LRU [0, 3, 2, 1]; step 1 wants 21, 22 and 10:
    # col 0 is a hit, cols 2 and 1 are protected, so one evictable column (3) for two misses -> stop
    w = _hand_world(
        [10, 11, 12, 13, 20, -1],
        [0, 1, 2, 3, 4, 5],
        [2, 0, 3, 1],
        top=[[11, 20, 14, 11], [21, 22, 10, -1]],
        lens=[21, 23],
        hot=4,
    )
    res = run(impl, w)
    assert res.steps_done.tolist() == [1]
    assert res.slots.tolist() == [[[1, 4, 2, 1], [-1, -1, -1, -1]]]
    assert w.lru.tolist() == [[0, 3, 2, 1]] and w.buffer_tokens.tolist() == [[10, 11, 14, 13, 20, -1]]


def _check_world_invariants(w: World, res) -> None:
    hot = w.hot
    for b, row in enumerate(w.req_rows.tolist()):
        assert sorted(w.lru[row].tolist()) == list(range(hot))
        held = [t for t in w.buffer_tokens[row, :hot].tolist() if t >= 0]
        assert len(held) == len(set(held))
        real = (w.seq_lens[b] > 0).nonzero().flatten().tolist()
        if real:
            assert int(res.steps_done[b]) > real[0]  # progress: the first real step always fits
        if hot >= w.seq_lens.shape[1] * w.top_k_pos.shape[2]:
            assert int(res.steps_done[b]) == w.seq_lens.shape[1]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds())
def test_reference_equals_oracle(world):
    oracle_world, ref_world = world.clone(), world.clone()
    expected = swap_in_oracle(*oracle_world.args())
    got = swap_in(*ref_world.args(), impl="torch", validate=True)
    assert_same(oracle_world, expected, ref_world, got, "torch vs oracle")
    assert_canaries(world, ref_world)
    _check_world_invariants(ref_world, got)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds())
def test_compiled_implementation_equals_oracle(world):
    oracle_world, got_world = world.clone(), world.clone()
    expected = swap_in_oracle(*oracle_world.args())
    got = swap_in(*got_world.args(), impl="numba", validate=True)
    assert_same(oracle_world, expected, got_world, got, "numba vs oracle")
    assert_canaries(world, got_world)
    _check_world_invariants(got_world, got)
    assert got.totals == tuple(
        int(v.sum()) for v in (got.hits, got.misses, got.unrecoverable, got.bytes_copied)
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds(max_reqs=12, max_steps=3, hots=(8, 16, 32)))
def test_batched_implementations_equal_oracle_on_wide_batches(world):
    # many requests of different lengths in one call: fast and long paths, stops and misses side by side
    expected_world = world.clone()
    expected = swap_in_oracle(*expected_world.args())
    for impl in ("numba", "torch"):
        got_world = world.clone()
        got = swap_in(*got_world.args(), impl=impl, validate=True)
        assert_same(expected_world, expected, got_world, got, f"{impl} vs oracle")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds(max_reqs=6, max_steps=4))
def test_compiled_implementation_resumes_after_a_stop_like_the_oracle(world):
    # the caller's protocol after a stop: call again with the resolved steps turned into padding
    a, b = world.clone(), world.clone()
    for _ in range(world.seq_lens.shape[1] + 1):
        ra = swap_in_oracle(*a.args())
        rb = swap_in(*b.args(), impl="numba", validate=True)
        assert_same(a, ra, b, rb, "numba vs oracle, resumed")
        done = torch.arange(a.seq_lens.shape[1])[None, :] < ra.steps_done[:, None].long()
        if bool(done.all()):
            break
        a.seq_lens = torch.where(done, 0, a.seq_lens)
        b.seq_lens = a.seq_lens.clone()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds(max_reqs=6, max_steps=4, hots=(4, 8, 16)))
def test_auto_equals_oracle_on_short_calls(world):
    # every step at most HOT long: ``identity_only`` takes the call unless an identity column lacks a slot
    world.seq_lens = world.seq_lens.clamp(max=world.hot)
    expected_world, got_world = world.clone(), world.clone()
    expected = swap_in_oracle(*expected_world.args())
    got = swap_in(*got_world.args(), impl="auto", validate=True)
    assert_same(expected_world, expected, got_world, got, "auto vs oracle")
    assert got.totals == tuple(
        int(v.sum()) for v in (got.hits, got.misses, got.unrecoverable, got.bytes_copied)
    )


def test_identity_only_takes_short_calls_with_slots_and_leaves_the_rest():
    from kernels.swap_in import identity_only

    locs = torch.arange(2 * 6).view(2, 6)  # HOT 4 + 2 newest/draft columns, every column a slot
    top = torch.tensor([[[2, 0, 2, -1]], [[3, 5, 1, 1]]], dtype=torch.int32)
    rows = torch.tensor([1, 0])
    res = identity_only(top, torch.tensor([[3], [4]]), rows, locs, 4)
    assert res is not None
    assert res.slots.tolist() == [[[8, 6, 8, -1]], [[3, -1, 1, 1]]]  # 5 >= n: invalid; duplicates share
    assert res.hits.tolist() == [2, 2] and res.totals == (4, 0, 0, 0)
    assert identity_only(top, torch.tensor([[3], [5]]), rows, locs, 4) is None  # a long step
    holed = locs.clone()
    holed[1, 2] = -1
    assert identity_only(top, torch.tensor([[3], [4]]), rows, holed, 4) is None  # its draft columns decide


def test_auto_on_cpu_runs_the_compiled_loops(monkeypatch):
    import kernels.swap_in_numba

    calls = []
    compiled = kernels.swap_in_numba.swap_in_numba
    monkeypatch.setattr(kernels.swap_in_numba, "swap_in_numba", lambda *a: calls.append(1) or compiled(*a))
    swap_in(*build_world(0, num_reqs=1, num_steps=1, top_k=4, hot=4, extra=2).args(), impl="auto")
    assert len(calls) == 1  # one step of one request: straight to the loops
    num_long = 0
    for seed in range(12):  # small and wide calls, whatever the policy: a long step goes to the loops
        world = build_world(seed, num_reqs=1 + seed % 6, num_steps=2, top_k=4, hot=4, extra=2)
        before = len(calls)
        swap_in(*world.args(), impl="auto", policy=("lru", "slide")[seed % 2])
        if int(world.seq_lens.max()) > world.hot:
            num_long += 1
            assert len(calls) == before + 1
    assert num_long


@pytest.mark.interpreter
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds(max_reqs=3, max_steps=4))
def test_triton_equals_oracle(world):
    oracle_world, tri_world = world.clone(), world.clone()
    expected = swap_in_oracle(*oracle_world.args())
    got = swap_in(*tri_world.args(), impl="triton", validate=True)
    assert_same(oracle_world, expected, tri_world, got, "triton vs oracle")
    assert_canaries(world, tri_world)


@pytest.mark.interpreter
def test_triton_equals_oracle_non_power_of_two_sizes():
    world = build_world(7, num_reqs=2, num_steps=3, top_k=5, hot=6, extra=3, p_no_host=0.2)
    oracle_world, tri_world = world.clone(), world.clone()
    expected = swap_in_oracle(*oracle_world.args())
    got = swap_in(*tri_world.args(), impl="triton")
    assert_same(oracle_world, expected, tri_world, got, "triton vs oracle")


def test_wrapper_rejects_bad_arguments():
    w = build_world(0, num_reqs=2, num_steps=2, top_k=3, hot=4, extra=2)
    args = list(w.args())
    bad = [
        (0, w.top_k_pos.long(), "top_k_pos"),
        (1, w.seq_lens[:, :1], "seq_lens"),
        (2, w.req_rows.int(), "req_rows"),
        (5, w.lru[:, :3], "lru"),
        (4, w.buffer_locs.int(), "buffer_locs"),
        (7, w.host_full.double(), "host_kv"),
        (8, w.device_full[:, :1], "host_kv"),
        (3, w.buffer_tokens.t().contiguous().t(), "buffer_tokens"),
    ]
    for i, value, name in bad:
        broken = list(args)
        broken[i] = value
        with pytest.raises(ValueError, match=name):
            swap_in(*broken, impl="torch")
    with pytest.raises(ValueError, match="hot"):
        swap_in(*args[:-1], 2, impl="torch")
    with pytest.raises(ValueError, match="impl"):
        swap_in(*args, impl="cuda")


def test_validate_catches_broken_state():
    w = build_world(1, num_reqs=2, num_steps=1, top_k=2, hot=4, extra=2)
    dup = list(w.args())
    dup[2] = torch.tensor([w.req_rows[0], w.req_rows[0]])
    with pytest.raises(ValueError, match="req_rows"):
        swap_in(*dup, impl="torch", validate=True)
    w.lru[w.req_rows[0]] = torch.tensor([0, 0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="lru"):
        swap_in(*w.args(), impl="torch", validate=True)


def test_compiled_implementation_says_when_a_call_stopped_early():
    """The compiled path reports ``complete`` (the backend reads it instead of a tensor check):
    False for a call that stopped before its last step, True otherwise; its sums are the counts'."""
    stopped = complete = 0
    for seed in range(60):
        world = build_world(seed, num_reqs=3, num_steps=4, top_k=4, hot=4, extra=2)
        got = swap_in(*world.clone().args(), impl="numba")
        assert got.complete is not None
        assert got.complete == bool((got.steps_done == 4).all())
        assert got.steps_done.dtype == got.hits.dtype == torch.int32
        stopped += not got.complete
        complete += got.complete
    assert stopped and complete  # both kinds of call were seen


@pytest.mark.parametrize(
    "host_dtype,device_dtype",
    [
        (torch.float64, torch.float64),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_compiled_row_copies_move_every_dtype_exactly(host_dtype, device_dtype):
    """The compiled path copies a miss's row as its bits, whatever the element type: the device rows
    equal the oracle's, and the canaries around both pools are untouched."""
    loaded = 0
    for seed in range(12):
        world = build_world(seed, num_reqs=3, num_steps=2, top_k=6, hot=8, extra=2)
        world.host_full = (world.host_full * 1.37 + 0.11).to(host_dtype)  # values with all their bits
        world.device_full = world.device_full.to(device_dtype)
        expected_world, got_world = world.clone(), world.clone()
        expected = swap_in_oracle(*expected_world.args())
        got = swap_in(*got_world.args(), impl="numba")
        assert_same(
            expected_world, expected, got_world, got, f"numba vs oracle, {host_dtype} -> {device_dtype}"
        )
        assert torch.equal(got_world.device_full, expected_world.device_full)
        assert_canaries(world, got_world)
        loaded += int(got.misses.sum())
    assert loaded  # rows were copied
