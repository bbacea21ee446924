"""Offline replay of a top-k trace against replacement policies: LRU, CLOCK and Belady's MIN.

For every (request, layer) the decode steps of a trace form a sequence of wanted sets. Each policy
keeps ``hot`` positions resident and counts the wanted positions it must load:

* **LRU** is exactly hispec's swap-in rule for one decode step (hits become most recent, misses take
  the least recently used columns in miss order), so replaying a plain-decode trace reproduces the
  engine's miss counters;
* **CLOCK** (second chance): a hand sweeps the slots, clearing reference bits, and evicts the first
  unreferenced slot that the current step does not need;
* **MIN** (Belady): evicts the resident position whose next use lies farthest in the future — the
  optimum, since the whole trace is known afterwards.

As in the engine, a request's cache starts as positions ``0..hot-1`` (its identity columns) at its
first long step (``position + 1 > hot``); the query's own position sits in the newest column and is
never a miss. Only ``decode`` records are replayed (a verify resolves several steps at once).
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Iterable

import attrs

from pipeline.hisparse.trace import read_trace


@attrs.frozen
class ReplayResult:
    steps: int
    wanted: int  # positions requested from the hot region, summed over steps
    misses: dict[str, int]  # policy -> positions loaded


def wanted_sets(records: Iterable[dict], hot: int) -> dict[tuple[str, int], list[list[int]]]:
    """(request, layer) -> the hot-region positions each long decode step wants, in order."""
    streams: dict[tuple[str, int], list[list[int]]] = collections.defaultdict(list)
    for rec in records:
        try:
            phase, query, top_k = rec.get("phase", "decode"), rec["position"], rec["top_k"]
            key = (rec["request"], rec["layer"])
        except (AttributeError, KeyError, TypeError):
            raise ValueError(f"not a top-k trace record: {str(rec)[:60]}") from None
        if phase != "decode" or query + 1 <= hot:
            continue
        want = list(dict.fromkeys(t for t in top_k if 0 <= t < query))
        streams[key].append(want)
    return streams


def lru_misses(steps: list[list[int]], hot: int) -> int:
    order = list(range(hot))  # least recent first
    misses = 0
    for want in steps:
        want_set = set(want)
        resident = set(order)
        hits = [p for p in order if p in want_set]
        evictable = [p for p in order if p not in want_set]
        missed = [t for t in want if t not in resident]
        misses += len(missed)
        order = evictable[len(missed) :] + missed + hits
    return misses


def clock_misses(steps: list[list[int]], hot: int) -> int:
    slots = list(range(hot))
    referenced = [False] * hot
    where = {p: i for i, p in enumerate(slots)}
    hand = misses = 0
    for want in steps:
        want_set = set(want)
        for t in want:
            if t in where:
                referenced[where[t]] = True
        for t in want:
            if t in where:
                continue
            misses += 1
            while slots[hand] in want_set or referenced[hand]:  # second chance; never what this step needs
                if slots[hand] not in want_set:
                    referenced[hand] = False
                hand = (hand + 1) % hot
            del where[slots[hand]]
            slots[hand], where[t], referenced[hand] = t, hand, True
            hand = (hand + 1) % hot
    return misses


def min_misses(steps: list[list[int]], hot: int) -> int:
    uses: dict[int, collections.deque[int]] = collections.defaultdict(collections.deque)
    for i, want in enumerate(steps):
        for t in want:
            uses[t].append(i)
    resident = set(range(hot))
    misses = 0
    for want in steps:
        for t in want:
            uses[t].popleft()
        want_set = set(want)
        for t in want:
            if t in resident:
                continue
            misses += 1
            victim = max(
                (p for p in resident if p not in want_set),
                key=lambda p: uses[p][0] if uses[p] else float("inf"),
            )
            resident.remove(victim)
            resident.add(t)
    return misses


POLICIES = {"lru": lru_misses, "clock": clock_misses, "min": min_misses}


def replay(records: Iterable[dict], hot: int) -> ReplayResult:
    if hot < 1:
        raise ValueError(f"hot={hot}: must be >= 1")
    streams = wanted_sets(records, hot)
    widest = max((len(w) for s in streams.values() for w in s), default=0)
    if widest > hot:
        raise ValueError(f"a step wants {widest} positions, more than hot={hot} can hold")
    misses = {name: sum(fn(steps, hot) for steps in streams.values()) for name, fn in POLICIES.items()}
    steps = sum(len(s) for s in streams.values())
    wanted = sum(len(w) for s in streams.values() for w in s)
    return ReplayResult(steps, wanted, misses)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hispec replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a JSON-lines top-k trace (Executor(trace_path=...))")
    parser.add_argument("--hot", type=int, required=True, help="device_buffer_size to replay with")
    parser.add_argument("-v", "--verbose", action="store_true", help="print an error's traceback too")
    args = parser.parse_args(argv)
    result = replay(read_trace(args.trace), args.hot)
    print(
        f"{result.steps} long decode steps (request x layer), {result.wanted} positions wanted from HOT={args.hot}"
    )
    best = result.misses["min"] or 1
    for name, misses in result.misses.items():
        rate = misses / result.wanted if result.wanted else 0.0
        print(f"{name:>5}: {misses} misses ({rate:.1%} of wanted, {misses / best:.2f}x MIN)")
    return 0
