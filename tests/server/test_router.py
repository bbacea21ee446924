"""The data-parallel router, pure: the policies' rules, and properties over any run of routes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pipeline.server.router import NoReplica, PrefixTree, Router, RouterConfig

PAGE = 4


def prompt(prefix: int, suffix: int, *, prefix_pages: int = 4, suffix_len: int = 3) -> list[int]:
    """A prompt of ``prefix_pages`` pages shared by every prompt of the same ``prefix``, then a tail
    of its own."""
    return [1000 + prefix] * (prefix_pages * PAGE) + [suffix] * suffix_len


def test_the_tree_matches_whole_pages_of_the_longest_recorded_prefix():
    tree = PrefixTree(PAGE, max_pages=100)
    tree.insert(list(range(10)))  # two whole pages; the last two tokens are not recorded
    assert len(tree) == 2
    assert tree.match(list(range(10))) == 8
    assert tree.match([*range(6), 99, 99, 99]) == 4  # the second page differs
    assert tree.match([7, *range(1, 10)]) == 0
    assert tree.match([0, 1, 2]) == 0  # less than a page


def test_the_tree_forgets_the_least_recently_used_pages_past_its_bound():
    tree = PrefixTree(PAGE, max_pages=3)
    tree.insert([1] * 8)
    tree.insert([2] * 8)  # 4 pages: the oldest one ([1]*4) goes
    assert len(tree) == 3
    assert tree.match([1] * 8) == 0 and tree.match([2] * 8) == 8


def test_cache_aware_sends_a_shared_prefix_to_the_replica_that_holds_it():
    router = Router(3, PAGE)
    first = router.route(prompt(7, 1))
    router.begin(first.replica)
    again = router.route(prompt(7, 2))
    assert (again.replica, again.reason, again.matched_tokens) == (first.replica, "cache", 4 * PAGE)


def test_cache_aware_spreads_prompts_that_share_nothing_by_load():
    router = Router(2, PAGE)
    chosen = []
    for p in range(4):
        route = router.route(prompt(p, p))
        router.begin(route.replica)
        chosen.append(route.replica)
    assert chosen == [0, 1, 0, 1]


def test_a_short_match_does_not_route_by_cache():
    router = Router(2, PAGE, config=RouterConfig(cache_threshold=0.5))
    router.route([5] * PAGE + [6] * 20)  # replica 0 holds one page of the next prompt
    router.begin(0)
    route = router.route([5] * PAGE + [7] * 20)  # 4 of 24 tokens match: under half
    assert (route.replica, route.reason) == (1, "load")


def test_imbalance_beyond_both_thresholds_routes_to_the_least_loaded_whatever_the_cache():
    router = Router(2, PAGE, config=RouterConfig(balance_abs_threshold=2, balance_rel_threshold=1.5))
    for _ in range(3):
        router.route(prompt(1, 1))
        router.begin(0)
    assert router.loads == [3, 0]
    route = router.route(prompt(1, 2))  # 3 - 0 > 2 and 3 > 0 * 1.5
    assert (route.replica, route.reason) == (1, "balance")
    router.begin(1)
    router.begin(1)
    assert router.route(prompt(1, 3)).reason == "cache"  # 3 vs 2: balanced enough


def test_round_robin_and_least_load_skip_a_dead_replica():
    rr = Router(3, PAGE, "round_robin")
    rr.mark_dead(1)
    assert [rr.route([i]).replica for i in range(4)] == [0, 2, 0, 2]
    ll = Router(3, PAGE, "least_load")
    ll.begin(0)
    ll.mark_dead(1)
    assert ll.route([1]).replica == 2


def test_a_dead_replica_is_never_chosen_even_holding_the_prefix():
    router = Router(2, PAGE)
    assert router.route(prompt(3, 1)).replica == 0
    router.mark_dead(0)
    assert router.route(prompt(3, 2)).replica == 1
    router.mark_dead(1)
    with pytest.raises(NoReplica):
        router.route(prompt(3, 3))


def test_a_flushed_replica_holds_nothing_for_the_router():
    router = Router(2, PAGE)
    router.route(prompt(4, 1))
    router.clear(0)
    router.begin(0)
    assert router.route(prompt(4, 2)).reason == "load"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cache_threshold", 1.5),
        ("balance_abs_threshold", -1),
        ("balance_rel_threshold", 0.5),
        ("max_pages", 0),
    ],
)
def test_thresholds_out_of_range_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**{field: value})


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        Router(2, PAGE, "random")


class RouterMachine(RuleBasedStateMachine):
    """Any interleaving of routes, ends and deaths: the router never picks a dead replica, the
    cache-aware policy never leaves the imbalance beyond both thresholds when it could help, and a
    prefix routed by cache goes to a replica that was sent it before."""

    ABS, REL = 2, 1.5

    def __init__(self) -> None:
        super().__init__()
        self.router = Router(
            3, PAGE, config=RouterConfig(balance_abs_threshold=self.ABS, balance_rel_threshold=self.REL)
        )
        self.in_flight: list[int] = []  # the replica of each request not ended
        self.sent: dict[int, set[int]] = {}  # prefix -> the replicas it went to

    @precondition(lambda self: self.router.alive)
    @rule(prefix=st.integers(0, 3), suffix=st.integers(0, 50))
    def route(self, prefix: int, suffix: int) -> None:
        loads = list(self.router.loads)
        live = sorted(self.router.alive)
        route = self.router.route(prompt(prefix, suffix))
        assert route.replica in live
        most, least = max(loads[i] for i in live), min(loads[i] for i in live)
        if most - least > self.ABS and most > least * self.REL:
            assert loads[route.replica] == least
        if route.reason == "cache":
            assert route.replica in self.sent.get(prefix, set())
        self.sent.setdefault(prefix, set()).add(route.replica)
        self.router.begin(route.replica)
        self.in_flight.append(route.replica)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        replica = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        self.router.end(replica)

    @precondition(lambda self: len(self.router.alive) > 1)
    @rule(data=st.data())
    def die(self, data: st.DataObject) -> None:
        replica = data.draw(st.sampled_from(sorted(self.router.alive)))
        self.router.mark_dead(replica)
        for replicas in self.sent.values():
            replicas.discard(replica)

    @invariant()
    def loads_count_what_is_in_flight(self) -> None:
        assert self.router.loads == [self.in_flight.count(i) for i in range(3)]


TestRouterMachine = pytest.mark.proptest(RouterMachine.TestCase)
TestRouterMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


@given(st.lists(st.integers(0, 5), min_size=1, max_size=40))
@settings(max_examples=50, deadline=None)
def test_a_prompt_routed_before_is_matched_whole_pages(tokens):
    tree = PrefixTree(PAGE, max_pages=1000)
    tree.insert(tokens)
    assert tree.match(tokens) == len(tokens) // PAGE * PAGE
