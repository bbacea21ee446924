"""Replacement policies of swap-in: a worked example of each, then every implementation equal to the
oracle under every policy (single- and multi-step calls, stops and resumes included)."""

from __future__ import annotations

import pytest
import torch
from _swap_in_world import assert_canaries, assert_same, worlds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_swap_in import _hand_world

from kernels.swap_in import swap_in
from kernels.swap_in_oracle import swap_in_oracle
from kernels.swap_in_policy import (
    FAR,
    NEAR_POLICIES,
    POLICIES,
    choose_victims,
    near_margin,
    policy_code,
    slide_distance,
)

IMPLS = ["torch", "numba", pytest.param("triton", marks=pytest.mark.interpreter)]
OTHER_POLICIES = [p for p in POLICIES if p != "lru"]


def test_slide_distance_is_the_gap_to_the_nearest_selected_position_below():
    selected = [3, 10, 11, 40]
    assert [slide_distance(t, selected) for t in (2, 3, 4, 12, 39, 41)] == [FAR, FAR, 1, 1, 28, 1]


def test_policy_names_are_checked():
    assert policy_code("lru") == 0
    with pytest.raises(ValueError, match="policy"):
        policy_code("mru")


def _example(policy: str, impl: str):
    # hot columns 0..3 hold 31, 30, 10, 50 (LRU order 0, 1, 2, 3), newest column 4 holds 60.
    # The step (n = 61) selects 30 and 50 (hits, columns 1 and 3), 60 (newest) and the miss 55:
    # one victim among columns 0 and 2. LRU takes column 0 (least recent); slide predicts each
    # column's next use from the selected position just below it: 31 -> 1 step (30 is selected),
    # 10 -> never (nothing selected below it), so it takes column 2; slide-lru too (10 is dead).
    w = _hand_world([31, 30, 10, 50, 60, -1], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3],
                    top=[[30, 50, 60, 55]], lens=[61], hot=4, max_ctx=64)
    res = swap_in(*w.args(), impl=impl, policy=policy, validate=True)
    return res, w


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("policy,evicted", [("lru", 0), ("slide", 2), ("slide-lru", 2)])
def test_worked_example_each_policy_picks_its_victim(impl, policy, evicted):
    res, w = _example(policy, impl)
    assert (res.hits.tolist(), res.misses.tolist()) == ([3], [1])
    assert w.buffer_tokens[0, evicted] == 55  # the miss took the chosen column
    assert res.slots[0, 0, 3] == evicted  # slots == columns in this world
    kept = 2 - evicted  # the other evictable column
    assert w.lru.tolist() == [[kept, evicted, 1, 3]]  # [kept | loaded | hits]: the common LRU update


def test_choose_victims_keeps_lru_order_among_the_chosen():
    held = [9, 21, 20, 5]  # LRU order; selected: [8]; d: 9 -> 1, 21 -> 13, 20 -> 12, 5 -> FAR
    assert choose_victims("slide", held, [8], 2, hot=16) == [1, 3]
    assert choose_victims("lru", held, [8], 2, hot=16) == [0, 1]
    # slide-lru: 20 and 21 are within hot=16 of 8, so they rank after the dead 5, farthest first
    assert choose_victims("slide-lru", held, [8], 2, hot=16) == [1, 3]
    # with hot=10 all but 9 are dead: the two least recent of them go (slide takes 21 and 5)
    assert choose_victims("slide-lru", held, [8], 2, hot=10) == [1, 2]


def _equal_to_oracle(world, impl, policy, near=None):
    a, b = world.clone(), world.clone()
    expected = swap_in_oracle(*a.args(), policy=policy, near=near)
    got = swap_in(*b.args(), impl=impl, policy=policy, near=near, validate=True)
    assert_same(a, expected, b, got, f"{impl} vs oracle under {policy}")
    assert_canaries(world, b)
    return expected


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds(max_reqs=6, max_steps=4), policy=st.sampled_from(OTHER_POLICIES))
def test_cpu_implementations_equal_the_oracle_under_every_policy(world, policy):
    for impl in ("torch", "numba"):
        _equal_to_oracle(world, impl, policy)


# slow: in CI, test_real_sizes.py runs the Triton kernel under every policy and near row with tiles
# shrunk so that every world crosses them (a harder case than these default-tile worlds)
@pytest.mark.slow
@pytest.mark.interpreter
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds(max_reqs=3, max_steps=3), policy=st.sampled_from(OTHER_POLICIES))
def test_triton_equals_the_oracle_under_every_policy(world, policy):
    _equal_to_oracle(world, "triton", policy)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds(max_reqs=4, max_steps=4), policy=st.sampled_from(OTHER_POLICIES))
def test_resumed_calls_equal_the_oracle_under_every_policy(world, policy):
    # the caller's protocol after a stop: call again with the resolved steps turned into padding
    a, b = world.clone(), world.clone()
    for _ in range(world.seq_lens.shape[1] + 1):
        ra = swap_in_oracle(*a.args(), policy=policy)
        rb = swap_in(*b.args(), impl="numba", policy=policy, validate=True)
        assert_same(a, ra, b, rb, f"numba vs oracle under {policy}, resumed")
        done = torch.arange(a.seq_lens.shape[1])[None, :] < ra.steps_done[:, None].long()
        if bool(done.all()):
            break
        a.seq_lens = torch.where(done, 0, a.seq_lens)
        b.seq_lens = a.seq_lens.clone()


def test_swap_in_rejects_an_unknown_policy():
    _, w = _example("lru", "torch")
    with pytest.raises(ValueError, match="policy"):
        swap_in(*w.args(), impl="torch", policy="fifo")


@pytest.mark.parametrize("impl", IMPLS)
def test_adaptive_follows_slide_only_when_the_selection_slid(impl):
    # the stable world of _example: 30 and 50 are wanted again (in the recent columns), nothing is
    # one past a recent position -> LRU's victim (column 0)
    res, w = _example("adaptive", impl)
    assert w.buffer_tokens[0, 0] == 55 and w.lru.tolist() == [[2, 0, 1, 3]]
    # a slid world: 30 and 50 are one past the recent 29 and 49 -> slide's victims: the positions
    # with nothing selected below them (29 and 10), then 49 (the next selected below is 30, 19 back);
    # 31 (30 is selected just below it) stays, where LRU would keep 49 instead
    for policy, kept_col in (("adaptive", 0), ("slide", 0), ("lru", 3)):
        w = _hand_world([31, 29, 10, 49, 60, -1], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3],
                        top=[[30, 50, 60, 55]], lens=[61], hot=4, max_ctx=64)
        res = swap_in(*w.args(), impl=impl, policy=policy, validate=True)
        assert res.misses.tolist() == [3]
        assert w.lru[0, 0] == kept_col, policy  # the one column kept comes first in the new order
        assert w.buffer_tokens[0, kept_col] == [31, 29, 10, 49][kept_col]


def _near_rows(world, seed: int, margin: int) -> torch.Tensor:
    """``[B, S, margin]`` near positions: held tokens, fresh positions, -1 and out-of-range ones."""
    g = torch.Generator().manual_seed(seed)
    b, steps, _ = world.top_k_pos.shape
    out = torch.full((b, steps, margin), -1, dtype=torch.int32)
    for i, row in enumerate(world.req_rows.tolist()):
        for s in range(steps):
            n = max(int(world.seq_lens[i, s]), 1)
            extra = torch.randint(-2, n + 3, (margin + 1,), generator=g)
            pool = torch.cat([world.buffer_tokens[row].long(), extra])
            out[i, s] = pool[torch.randint(0, pool.numel(), (margin,), generator=g)].int()
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("policy", NEAR_POLICIES)
@pytest.mark.parametrize("near,evicted", [(None, 0), ([[31, -1]], 2), ([[10, 70]], 0), ([[31, 10]], 0)])
def test_worked_example_near_keeps_what_the_indexer_ranked_next(impl, policy, near, evicted):
    # _example's world: the one miss (55) takes column 0 (31) or column 2 (10). ``near`` evicts
    # first the columns holding a position neither selected nor near, least recent first: with 31
    # near it takes column 2; with 10 near (70 is out of range) or both near, LRU's column 0. The
    # selection does not slide (30 and 50 stay), so near-adaptive keeps near's victims.
    w = _hand_world(
        [31, 30, 10, 50, 60, -1],
        [0, 1, 2, 3, 4, 5],
        [0, 1, 2, 3],
        top=[[30, 50, 60, 55]],
        lens=[61],
        hot=4,
        max_ctx=64,
    )
    rows = None if near is None else torch.tensor([near], dtype=torch.int32)
    res = swap_in(*w.args(), impl=impl, policy=policy, near=rows, validate=True)
    assert (res.hits.tolist(), res.misses.tolist()) == ([3], [1])
    assert w.buffer_tokens[0, evicted] == 55
    assert w.lru.tolist() == [[2 - evicted, evicted, 1, 3]]


def test_choose_victims_near_evicts_the_unranked_first_in_lru_order():
    held = [9, 21, 20, 5]  # LRU order; selected [8], near {20, 9}
    assert choose_victims("near", held, [8], 1, hot=16, near=[20, 9]) == [1]
    assert choose_victims("near", held, [8], 3, hot=16, near=[20, 9]) == [0, 1, 3]
    assert choose_victims("near", held, [8, 21], 2, hot=16, near=[]) == [0, 2]  # a selected one stays too


def test_the_near_margin_defaults_to_top_k_under_a_near_policy_or_a_trace():
    assert near_margin(None, "near", 64) == near_margin(None, "near-adaptive", 64) == 64
    assert near_margin(None, "lru", 64) == 0
    assert near_margin(None, "lru", 64, tracing=True) == 64
    assert near_margin(8, "lru", 64) == 8


def test_swap_in_checks_the_near_rows():
    _, w = _example("lru", "torch")
    with pytest.raises(ValueError, match="near"):
        swap_in(*w.args(), impl="torch", policy="near", near=torch.zeros(1, 2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="near"):
        swap_in(*w.args(), impl="torch", policy="near", near=torch.zeros(1, 1, 3, dtype=torch.int64))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=worlds(max_reqs=6, max_steps=4),
    policy=st.sampled_from(NEAR_POLICIES),
    seed=st.integers(0, 2**31 - 1),
    margin=st.integers(0, 9),
)
def test_cpu_implementations_equal_the_oracle_under_the_near_policies(world, policy, seed, margin):
    near = _near_rows(world, seed, margin)
    for impl in ("torch", "numba"):
        _equal_to_oracle(world, impl, policy, near)


@pytest.mark.slow  # (see test_triton_equals_the_oracle_under_every_policy)
@pytest.mark.interpreter
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=worlds(max_reqs=3, max_steps=3),
    policy=st.sampled_from(NEAR_POLICIES),
    seed=st.integers(0, 2**31 - 1),
    margin=st.integers(0, 6),
)
def test_triton_equals_the_oracle_under_the_near_policies(world, policy, seed, margin):
    _equal_to_oracle(world, "triton", policy, _near_rows(world, seed, margin))
