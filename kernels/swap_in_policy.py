"""Replacement policies of swap-in: which evictable hot columns a step's misses take.

Every policy keeps the same state, the per-request LRU order of the hot columns (a permutation, least
recent first), updated the same way after each step (``kernels.swap_in``, rule 4). They differ only
in the *victims*: of a step's evictable columns, the ``m`` with the smallest **eviction key** take
its ``m`` loadable misses (the m-th miss, in order of first appearance, takes the m-th victim in LRU
order). The key of an evictable column at LRU index ``i`` holding position ``t``:

* ``lru``: ``i``: the least recently used columns go first;
* ``slide``: ``(FAR - d, i)``, where ``d = t - s`` for ``s`` the largest position the step selects
  below ``t`` (``d = FAR`` when there is none): the column whose position is predicted to be wanted
  farthest in the future goes first, ties least recently used first. The prediction: a selection
  that slides forward by one position per decoded token (the induction- and recent-window-like
  patterns of DSA indexers) wants ``t`` again in ``d`` steps exactly when it wants ``t - d`` now;
* ``slide-lru``: ``(0, i)`` when ``d > hot`` (no slide would bring ``t`` back within ``hot`` steps:
  treated as dead, least recent first), else ``(1 + hot - d, i)`` (farthest predicted use first);
* ``adaptive``: ``slide``'s keys when the step's selection looks like a slide of the previous one,
  else ``lru``'s. With ``M`` the positions of the ``K`` most recently used hot columns before the
  step (``K`` = the top-k row's width; the previous step's wanted positions are among them) and
  ``W`` the step's unique wanted positions (those looked up in the hot columns): it slides when
  more of ``W`` are one past a position of ``M`` than are in ``M`` themselves
  (``|{t in W: t - 1 in M}| > |W & M|``). Layers whose selection moves with the query then use the
  prediction, layers whose selection stays put keep LRU (``docs/cache-policy.md``).

The selected positions are the step's *valid* top-k entries (``0 <= t < n``), wherever they are
held. Keys need no state beyond the LRU order and the step's own top-k row, so per-layer state stays
O(HOT). Packed as one int64 (``key_of``), a smaller key is evicted first.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

POLICIES = ("lru", "slide", "slide-lru", "adaptive", "near", "near-adaptive")
# the policies that read the positions the indexer ranked just past the top-k (``near``)
NEAR_POLICIES = ("near", "near-adaptive")
DEFAULT_POLICY = "lru"
FAR = 1 << 30  # the predicted distance of a position with no selected position below it
KEY_SHIFT = 32  # key = priority << KEY_SHIFT | LRU index


def default_near_margin(top_k: int) -> int:
    """How many positions past the top-k the indexer ranks for the near-policies by default."""
    return top_k


def near_margin(configured: int | None, policy: str, top_k: int, *, tracing: bool = False) -> int:
    """The margin a forward ranks: ``configured`` when given, else the default under a near-policy
    or while a trace is recorded (the trace then serves every policy), else 0."""
    if configured is not None:
        return configured
    return default_near_margin(top_k) if policy in NEAR_POLICIES or tracing else 0


def policy_code(policy: str) -> int:
    """The policy's index in ``POLICIES`` (what the kernels take); raises ``ValueError`` naming it."""
    try:
        return POLICIES.index(policy)
    except ValueError:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}") from None


def step_policy(policy: str, wanted: list[int], recent: list[int]) -> str:
    """The keys a step uses: ``policy`` itself, or for ``adaptive`` ``slide`` or ``lru``, for
    ``near-adaptive`` ``slide`` or ``near``.

    ``wanted``: the step's unique wanted positions; ``recent``: the positions of its ``K`` most
    recently used hot columns before the step."""
    if policy not in ("adaptive", "near-adaptive"):
        return policy
    held = {p for p in recent if p >= 0}
    slid = sum(1 for t in wanted if t - 1 in held)
    stayed = sum(1 for t in wanted if t in held)
    if slid > stayed:
        return "slide"
    return "lru" if policy == "adaptive" else "near"


def slide_distance(token: int, selected: list[int]) -> int:
    """``token`` minus the largest of ``selected`` (sorted ascending) below it; ``FAR`` when none."""
    at = bisect.bisect_left(selected, token)
    return token - selected[at - 1] if at > 0 else FAR


def priority(
    policy: str, token: int, selected: list[int], hot: int, keep: frozenset[int] = frozenset()
) -> int:
    """The policy's eviction priority of a column holding ``token`` (smaller: evicted sooner);
    ``keep``: the step's selected and near positions (what ``near`` keeps)."""
    if policy == "lru":
        return 0
    if policy == "near":
        return 1 if token in keep else 0
    d = slide_distance(token, selected)
    if policy == "slide":
        return FAR - d
    return 0 if d > hot else 1 + hot - d  # slide-lru


def choose_victims(
    policy: str, held: list[int], selected: list[int], count: int, hot: int, near: Iterable[int] = ()
) -> list[int]:
    """Indices into ``held`` of the ``count`` evictable columns the policy evicts, ascending.

    ``held`` is the position each evictable column holds, the columns in LRU order (least recent
    first; ties of priority go to the earlier one); ``selected`` the step's valid top-k positions,
    sorted ascending; ``near`` the step's valid near positions (any order; ``near`` reads them).
    """
    if policy == "lru" or count == 0:
        return list(range(min(count, len(held))))
    if policy == "near":  # two classes, each in LRU order: no sort needed
        keep = frozenset(near).union(selected)
        ranked = [i for i, t in enumerate(held) if t not in keep] + [
            i for i, t in enumerate(held) if t in keep
        ]
        return sorted(ranked[:count])
    ranked = sorted(range(len(held)), key=lambda i: (priority(policy, held[i], selected, hot), i))
    return sorted(ranked[:count])
