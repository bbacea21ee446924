"""Which data-parallel replica serves a request: the routing policies, pure and synchronous.

The router sees token ids, the replicas' loads (requests in flight, as the server counts them) and
which replicas live; it never touches a process or a socket. ``Router.route`` picks a replica and
records the prompt there; ``begin`` / ``end`` move a replica's load; ``mark_dead`` takes a replica
out for good; ``clear`` forgets what a replica cached (it flushed its prefix cache).

Policies (``--router-policy``):

* ``round_robin``: the live replicas in turn.
* ``least_load``: the live replica with the fewest requests in flight (the lowest index on a tie).
* ``cache_aware`` (the default; SGLang's cache-aware router, on token ids):

  1. imbalance first: when the busiest live replica has more than ``balance_abs_threshold``
     requests more than the idlest, and more than ``balance_rel_threshold`` times as many, the
     idlest wins whatever the caches hold (a popular prefix cannot pile every request on one
     replica);
  2. else the longest cached prefix: each replica's ``PrefixTree`` holds the prompts routed there;
     when the longest match covers at least ``cache_threshold`` of the prompt, the replica holding
     it wins (the lighter load on a tie of equal matches);
  3. else the least loaded replica (on a tie, the one whose tree holds the fewest pages: the most
     room for a new prefix).

A replica's tree is what the router *sent* there, not what its prefix cache holds now: the cache
keeps a request's pages only once it ends and evicts under pressure, and the tree is bounded
(``max_pages``, least recently used out first). It is a forecast, and a cheap one.

``PrefixTree`` is a radix tree over whole pages, flattened: the node of a prompt's first ``k``
pages is the chained hash ``h_k = hash((h_{k-1}, page_k))``, so looking up a prompt walks its pages
until the first one the tree lacks. A partial last page is not recorded (the prefix cache shares
whole pages only).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import attrs

POLICIES = ("cache_aware", "round_robin", "least_load")


class NoReplica(RuntimeError):
    """No live replica is left to route to."""


@attrs.frozen
class RouterConfig:
    """The cache-aware policy's thresholds (SGLang's names and meaning)."""

    # a match of at least this share of the prompt's tokens routes by cache, in [0, 1]
    cache_threshold: float = 0.3
    # imbalance: max_load - min_load > balance_abs_threshold and max_load > min_load * rel
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_pages: int = 65536  # pages each replica's tree holds at most (least recently used out first)

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold={self.cache_threshold}: must be in [0, 1]")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold={self.balance_abs_threshold}: must be at least 0")
        if self.balance_rel_threshold < 1:
            raise ValueError(f"balance_rel_threshold={self.balance_rel_threshold}: must be at least 1")
        if self.max_pages < 1:
            raise ValueError(f"max_pages={self.max_pages}: must be at least 1")


def page_hashes(token_ids: Sequence[int], page_size: int) -> Iterator[int]:
    """The chained hash of each whole page of ``token_ids``, in order."""
    h = 0
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        h = hash((h, tuple(token_ids[start : start + page_size])))
        yield h


@attrs.define(eq=False)
class PrefixTree:
    """The page-prefixes of the prompts routed to one replica, at most ``max_pages`` of them."""

    page_size: int
    max_pages: int
    # chained page hash -> None, least recently used first
    _nodes: OrderedDict[int, None] = attrs.field(factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._nodes)

    def match(self, token_ids: Sequence[int]) -> int:
        """Tokens of the longest recorded prefix of ``token_ids`` (whole pages)."""
        pages = 0
        for h in page_hashes(token_ids, self.page_size):
            if h not in self._nodes:
                break
            pages += 1
        return pages * self.page_size

    def insert(self, token_ids: Sequence[int]) -> None:
        """Record every whole-page prefix of ``token_ids`` as the most recently used; the least
        recently used pages go beyond ``max_pages``."""
        for h in page_hashes(token_ids, self.page_size):
            self._nodes[h] = None
            self._nodes.move_to_end(h)
        while len(self._nodes) > self.max_pages:
            self._nodes.popitem(last=False)

    def clear(self) -> None:
        self._nodes.clear()


@attrs.frozen
class Route:
    """Where one request goes, and why."""

    replica: int
    reason: str  # "cache" | "balance" | "load" | "round_robin"
    matched_tokens: int  # the chosen replica's recorded prefix of the prompt (before this request)


@attrs.define(eq=False)
class Router:
    """Routes requests over ``num_replicas`` replicas by ``policy`` (one of ``POLICIES``).

    Mutates only itself: ``route`` records the prompt in the chosen replica's tree; ``begin`` /
    ``end`` count a replica's requests in flight; ``mark_dead`` and ``clear`` as their names say.
    """

    num_replicas: int
    page_size: int
    policy: str = "cache_aware"
    config: RouterConfig = attrs.Factory(RouterConfig)
    # every replica has a load and a tree, dead ones included (their trees are emptied);
    # alive is a subset of range(num_replicas)
    loads: list[int] = attrs.field(init=False)
    trees: list[PrefixTree] = attrs.field(init=False)
    alive: set[int] = attrs.field(init=False)
    _turns: Iterator[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: must be one of {', '.join(POLICIES)}")
        if self.num_replicas < 1 or self.page_size < 1:
            raise ValueError("num_replicas and page_size must be at least 1")
        self.loads = [0] * self.num_replicas
        self.trees = [PrefixTree(self.page_size, self.config.max_pages) for _ in range(self.num_replicas)]
        self.alive = set(range(self.num_replicas))
        self._turns = itertools.cycle(range(self.num_replicas))

    def route(self, token_ids: Sequence[int]) -> Route:
        """The replica for a prompt of ``token_ids`` (``NoReplica`` if none lives); the prompt is
        recorded in that replica's tree."""
        if not self.alive:
            raise NoReplica("no replica is serving")
        if self.policy == "round_robin":
            index = next(i for i in self._turns if i in self.alive)
            chosen = Route(index, "round_robin", self.trees[index].match(token_ids))
        elif self.policy == "least_load":
            index = self._least_loaded()
            chosen = Route(index, "load", self.trees[index].match(token_ids))
        else:
            chosen = self._cache_aware(token_ids)
        self.trees[chosen.replica].insert(token_ids)
        return chosen

    def _cache_aware(self, token_ids: Sequence[int]) -> Route:
        cfg = self.config
        live = sorted(self.alive)
        most = max(self.loads[i] for i in live)
        least = min(self.loads[i] for i in live)
        if most - least > cfg.balance_abs_threshold and most > least * cfg.balance_rel_threshold:
            index = self._least_loaded()
            return Route(index, "balance", self.trees[index].match(token_ids))
        matches = {i: self.trees[i].match(token_ids) for i in live}
        best = max(matches.values())
        if token_ids and best > 0 and best >= cfg.cache_threshold * len(token_ids):
            index = min((i for i in live if matches[i] == best), key=lambda i: (self.loads[i], i))
            return Route(index, "cache", best)
        index = min(live, key=lambda i: (self.loads[i], len(self.trees[i]), i))
        return Route(index, "load", matches[index])

    def _least_loaded(self) -> int:
        return min(self.alive, key=lambda i: (self.loads[i], i))

    def begin(self, replica: int) -> None:
        """One more request in flight on ``replica``."""
        self.loads[replica] += 1

    def end(self, replica: int) -> None:
        """A request on ``replica`` ended (however it ended)."""
        if self.loads[replica] <= 0:
            raise ValueError(f"replica {replica} has no request in flight to end")
        self.loads[replica] -= 1

    def mark_dead(self, replica: int) -> None:
        """``replica`` serves no more: it is never chosen again, and its tree is dropped."""
        self.alive.discard(replica)
        self.trees[replica].clear()

    def clear(self, replica: int) -> None:
        """``replica`` flushed its prefix cache: forget what was routed there."""
        self.trees[replica].clear()
