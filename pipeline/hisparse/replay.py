"""Offline replay of a top-k trace against replacement policies, Belady's MIN as the floor.

For every (request, layer) the records of a trace (``docs/topk-trace.md``) become the sequence of
swap-in steps the engine ran, modelled exactly as ``kernels.swap_in`` resolves them:

* a request's hot region starts as positions ``0..hot-1`` (its identity columns) when its buffer is
  assigned, at admission: a retracted request's re-admission starts afresh;
* a prefill chunk that starts past HOT (a long prompt's later chunks, or the first one after a
  prefix-cache hit) reads its earlier positions through workspace rows the forward borrows: the hot
  region keeps its positions, and the columns holding a position the chunk's queries selected become
  the most recent (in their previous order), as ``pipeline/hisparse/prefill_swap.py`` leaves them.
  A chunk is a run of consecutive records of one request and layer: in a model of more than one
  layer, the records of the other layers always separate two forwards (in a one-layer model two
  chunks of a prompt prefilled alone read as one). Replay takes it that the forward borrowed all
  the workspace rows it asked for; a device pool too full to lend them makes the chunk evict hot
  columns instead, which the trace does not show;
* a step whose query sees ``n <= hot`` positions takes the fast path (no miss; in a verify call its
  positions are protected for the later steps of the call);
* a long step wants its valid positions (``0 <= t < n``) except those held by the newest column
  (the last committed position once the request is long, and after every verify) or the draft zone
  (the verify call's own tokens at ``hot`` or later);
* a verify call's steps are resolved in order on the evolving state, so a position loaded by one step
  is a hit for the next, and no step evicts a position an earlier step of the call returned; a step
  that would need more evictable columns than remain starts a new round, protection afresh (the
  attention backend's rounds).

Policies: the engine's online ones (``kernels.swap_in_policy``: ``lru``, ``slide``, ``slide-lru``,
``adaptive``, ``near``, ``near-adaptive``, exactly the engine's rule, so a trace recorded with a policy
reproduces the engine's miss counters for it; the near-policies read each record's ``near`` positions, none in
a trace without them, as an engine with ``near_margin=0``), **CLOCK** (second chance: a hand sweeps the slots,
clearing reference bits, and evicts the first unreferenced slot the step does not hold), and **MIN** (Belady:
evicts the evictable position whose next use lies farthest in the future; offline, the optimum under the same
rules).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from kernels.swap_in_policy import POLICIES, choose_victims, step_policy
from pipeline.hisparse.trace import read_header, read_trace

OFFLINE = ("clock", "min")
ALL_POLICIES = (*POLICIES, *OFFLINE)


@attrs.frozen
class Step:
    """One swap-in step of one (request, layer)."""

    want: tuple[int, ...]  # long path: positions wanted from the hot region, first appearance order
    selected: tuple[int, ...]  # valid positions of the step, sorted (what the slide policies read)
    long: bool  # n > hot (a fast step only protects its positions for the rest of the call)
    call_start: bool  # first step of a swap-in call: protection starts afresh
    reset: bool  # the request's buffer was (re)assigned before this step: identity hot region
    near: tuple[int, ...] = ()  # valid positions the indexer ranked next after the top-k (version 3)
    # per prefill chunk since the previous step that started past HOT: the earlier positions its
    # queries selected (their hot columns became the most recent, chunk by chunk, after any reset)
    prefill: tuple[tuple[int, ...], ...] = ()


def _check(rec: Any) -> tuple[str, int, str, int, list[int]]:  # rec: a parsed JSON value
    try:
        return rec["request"], rec["layer"], rec.get("phase", "decode"), rec["position"], rec["top_k"]
    except (AttributeError, KeyError, TypeError):
        raise ValueError(f"not a top-k trace record: {str(rec)[:60]}") from None


def swap_in_steps(records: Iterable[dict], hot: int) -> dict[tuple[str, int], list[Step]]:
    """(request, layer) -> the swap-in steps the engine ran for it, in order."""
    streams: dict[tuple[str, int], list[Step]] = collections.defaultdict(list)
    newest: dict[tuple[str, int], int] = {}  # position in the newest column, -1 empty
    finalize: set[tuple[str, int]] = set()  # a verify call ran last: its finalize sets the newest
    fresh: set[tuple[str, int]] = set()  # buffer (re)assigned, no step since
    call: dict[tuple[str, int], int] = {}  # committed length of the verify call in progress
    # prefill chunks since the last step: earlier positions
    chunks: dict[tuple[str, int], list[set[int]]] = {}
    chunk: dict[tuple[str, int], tuple[int, int]] = {}  # the open prefill chunk: (start, next position)
    previous: tuple[tuple[str, int], str] | None = None  # the key and phase of the record before
    for rec in records:
        request, layer, phase, position, top_k = _check(rec)
        key = (request, layer)
        last, previous = previous, (key, phase)
        if phase == "prefill":
            first, end = chunk.get(key, (-1, -1))
            if last != (key, "prefill") or position != end:  # a new chunk (another forward)
                if position != end:  # not where the last chunk ended: a new admission
                    chunks[key] = []
                first = position
                chunks[key].append(set())
            chunk[key] = (first, position + 1)
            if first > hot:  # the chunk's reads of earlier positions go through the hot region
                chunks[key][-1].update(t for t in top_k if 0 <= t < first)
            newest[key] = -1
            finalize.discard(key)
            fresh.add(key)
            call.pop(key, None)
            continue
        if phase not in ("decode", "verify"):
            raise ValueError(f"unknown phase {phase!r} in {str(rec)[:60]}")
        step_index = rec.get("step") if phase == "verify" else 0
        if not isinstance(step_index, int):
            raise ValueError("a verify record without its 'step' (a version 1 trace): record the trace again")
        start = step_index == 0
        if start:
            if key in finalize:  # the last verify committed up to here: its last token is the newest
                newest[key] = position - 1
                finalize.discard(key)
            if phase == "decode" and position >= hot:
                newest[key] = position  # prepare_decode writes the token into the newest column
            if phase == "verify":
                call[key] = position
                finalize.add(key)
        n = position + 1
        valid = list(dict.fromkeys(t for t in top_k if 0 <= t < n))
        held = {newest.get(key, -1)}
        if phase == "verify":
            held.update(range(max(call[key], hot), n))  # the call's verify tokens in the draft zone
        want = tuple(t for t in valid if t not in held) if n > hot else ()
        near = tuple(t for t in rec.get("near", ()) if 0 <= t < n)
        chunk.pop(key, None)
        read = tuple(tuple(sorted(c)) for c in chunks.pop(key, ()) if c)
        streams[key].append(Step(want, tuple(sorted(valid)), n > hot, start, key in fresh, near, read))
        fresh.discard(key)
    return streams


def _rounds(steps: list[Step], hot: int) -> Iterable[tuple[Step, set[int], bool]]:
    """Each step with the protected set it sees (mutated by the caller: what the step returned),
    and whether the hot region restarts at identity first."""
    protected: set[int] = set()
    for step in steps:
        if step.call_start or step.reset:
            protected = set()
        if step.long and len(protected | set(step.want)) > hot:
            protected = set()  # more loads than evictable columns: the backend's next round
        yield step, protected, step.reset
        protected |= set(step.want) if step.long else set(step.selected)


def online_misses(steps: list[Step], hot: int, policy: str, top_k: int | None = None) -> int:
    """Loads of an engine policy over one (request, layer)'s steps (the swap-in rules on positions);
    ``top_k``: the width of the engine's top-k rows (what ``adaptive`` reads; default ``hot``)."""
    recent_width = top_k if top_k is not None else hot
    order = list(range(hot))  # least recent first
    misses = 0
    for step, protected, reset in _rounds(steps, hot):
        if reset:
            order = list(range(hot))
        for chunk in step.prefill:  # a chunk's hits in the hot region become the most recent
            read = set(chunk)
            order = [p for p in order if p not in read] + [p for p in order if p in read]
        if not step.long:
            continue
        want = set(step.want)
        resident = set(order)
        hits = [p for p in order if p in want]
        kept = [p for p in order if p not in want and p in protected]
        evictable = [p for p in order if p not in want and p not in protected]
        missed = [t for t in step.want if t not in resident]
        misses += len(missed)
        keys = step_policy(policy, list(step.want), order[max(0, hot - recent_width) :]) if missed else policy
        chosen = set(choose_victims(keys, evictable, list(step.selected), len(missed), hot, step.near))
        order = [p for i, p in enumerate(evictable) if i not in chosen] + kept + missed + hits
    return misses


def clock_misses(steps: list[Step], hot: int) -> int:
    slots: list[int] = []
    where: dict[int, int] = {}
    referenced: list[bool] = []
    hand = misses = 0
    for step, protected, reset in _rounds(steps, hot):
        if reset or not slots:
            slots = list(range(hot))
            where = {p: i for i, p in enumerate(slots)}
            referenced = [False] * hot
            hand = 0
        if not step.long:
            continue
        pinned = set(step.want) | protected
        for t in step.want:
            if t in where:
                referenced[where[t]] = True
        for t in step.want:
            if t in where:
                continue
            misses += 1
            while slots[hand] in pinned or referenced[hand]:  # second chance; never what the call holds
                if slots[hand] not in pinned:
                    referenced[hand] = False
                hand = (hand + 1) % hot
            del where[slots[hand]]
            slots[hand], where[t], referenced[hand] = t, hand, True
            pinned.add(t)
            hand = (hand + 1) % hot
    return misses


def min_misses(steps: list[Step], hot: int) -> int:
    """Belady's MIN under the same rules: the farthest next use (within the buffer's lifetime) goes."""
    segment = 0
    uses: dict[tuple[int, int], collections.deque[int]] = collections.defaultdict(collections.deque)
    for i, step in enumerate(steps):
        segment += step.reset
        for t in step.want:
            uses[(segment, t)].append(i)
    resident: set[int] = set()
    misses = segment = 0
    for i, (step, protected, reset) in enumerate(_rounds(steps, hot)):
        if reset or i == 0:
            resident = set(range(hot))
        segment += step.reset
        for t in step.want:
            uses[(segment, t)].popleft()
        pinned = set(step.want) | protected
        for t in step.want:
            if t in resident:
                continue
            misses += 1
            victim = max(
                (p for p in resident if p not in pinned), key=lambda p: (_next_use(uses, segment, p), -p)
            )
            resident.remove(victim)
            resident.add(t)
    return misses


def _next_use(uses: dict[tuple[int, int], collections.deque[int]], segment: int, position: int) -> float:
    later = uses.get((segment, position))
    return later[0] if later else float("inf")


def policy_function(name: str, top_k: int | None = None) -> Callable[[list[Step], int], int]:
    if name == "clock":
        return clock_misses
    if name == "min":
        return min_misses
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {ALL_POLICIES}, got {name!r}")
    return lambda steps, hot: online_misses(steps, hot, name, top_k)


@attrs.frozen
class ReplayResult:
    hot: int
    steps: int  # long swap-in steps (request x layer)
    wanted: int  # positions wanted from the hot region, summed over long steps
    misses: dict[str, list[int]]  # policy -> positions loaded, per layer
    row_bytes: int | None  # bytes of one row (one layer), when known

    def total(self, policy: str) -> int:
        return sum(self.misses[policy])

    def as_dict(self) -> dict[str, object]:
        floor = self.total("min") or 1
        out: dict[str, object] = {"hot": self.hot, "steps": self.steps, "wanted": self.wanted, "policies": {}}
        for name, per_layer in self.misses.items():
            entry: dict[str, object] = {
                "misses": sum(per_layer),
                "misses_per_layer": list(per_layer),
                "over_min": round(sum(per_layer) / floor, 4),
            }
            if self.row_bytes is not None:
                entry["h2d_bytes"] = sum(per_layer) * self.row_bytes
                entry["h2d_bytes_per_layer"] = [m * self.row_bytes for m in per_layer]
            out["policies"][name] = entry  # type: ignore[index]
        out["row_bytes"] = self.row_bytes
        return out


def replay(
    records: Iterable[dict],
    hot: int,
    *,
    policies: Iterable[str] = ALL_POLICIES,
    row_bytes: int | None = None,
    top_k: int | None = None,
) -> ReplayResult:
    """Every policy over the trace's swap-in steps at ``hot``; ``top_k``: the engine's top-k width
    (the trace header's; default: the widest record)."""
    if not isinstance(hot, int) or hot < 1:
        raise ValueError(f"hot={hot}: must be >= 1")
    records = list(records)
    if top_k is None:
        top_k = max((len(r["top_k"]) for r in records if isinstance(r, dict) and "top_k" in r), default=1)
    functions = {name: policy_function(name, top_k) for name in policies}
    streams = swap_in_steps(records, hot)
    widest = max((len(s.want) for steps in streams.values() for s in steps), default=0)
    if widest > hot:
        raise ValueError(f"a step wants {widest} positions, more than hot={hot} can hold")
    num_layers = 1 + max((layer for _, layer in streams), default=-1)
    misses = {name: [0] * num_layers for name in functions}
    for (_, layer), steps in streams.items():
        for name, fn in functions.items():
            misses[name][layer] += fn(steps, hot)
    long_steps = [s for steps in streams.values() for s in steps if s.long]
    return ReplayResult(hot, len(long_steps), sum(len(s.want) for s in long_steps), misses, row_bytes)


def report_lines(result: ReplayResult, engine_policy: str | None = None) -> list[str]:
    """The side-by-side table: a row per policy, its misses per layer and in total, bytes, x MIN."""
    layers = len(next(iter(result.misses.values()), []))
    floor = result.total("min") if "min" in result.misses else 0
    head = ["policy", *[f"layer {i}" for i in range(layers)], "misses", "host->device MB", "x MIN"]
    rows = []
    for name, per_layer in result.misses.items():
        total = sum(per_layer)
        mb = f"{total * result.row_bytes / 1e6:.2f}" if result.row_bytes is not None else "?"
        ratio = f"{total / floor:.3f}" if floor else "-"
        label = f"{name} (engine)" if name == engine_policy else name
        rows.append([label, *map(str, per_layer), str(total), mb, ratio])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hispec replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a JSON-lines top-k trace (hispec generate --topk-trace FILE)")
    parser.add_argument(
        "--hot",
        type=int,
        action="append",
        help="HOT to replay with (repeatable; default: the device_buffer_size the trace was recorded with)",
    )
    parser.add_argument("--policy", action="append", choices=ALL_POLICIES, help="only these (repeatable)")
    parser.add_argument("--row-bytes", type=int, help="bytes per row per layer (default: the trace's)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("-v", "--verbose", action="store_true", help="print an error's traceback too")
    args = parser.parse_args(argv)
    header = read_header(args.trace)
    records = read_trace(args.trace)
    hots = args.hot or ([header["hot"]] if isinstance(header.get("hot"), int) else None)
    if not hots:
        parser.error("--hot is required: the trace does not say which device_buffer_size it ran with")
    traced_bytes = value if isinstance(value := header.get("row_bytes"), int) else None
    row_bytes = args.row_bytes if args.row_bytes is not None else traced_bytes
    policies = args.policy or list(ALL_POLICIES)
    top_k = value if isinstance(value := header.get("top_k"), int) else None
    results = [replay(records, hot, policies=policies, row_bytes=row_bytes, top_k=top_k) for hot in hots]
    engine = value if isinstance(value := header.get("policy"), str) else None
    if args.json:
        payload = {"trace": str(args.trace), "recorded": header, "results": [r.as_dict() for r in results]}
        json.dump(payload, sys.stdout, indent=2)
        print()
        return 0
    for result in results:
        recorded = f" (recorded with HOT={header['hot']}, policy {engine})" if header.get("hot") else ""
        recorded += f", {header.get('near_margin', 0)} near positions per step"
        print(
            f"HOT={result.hot}{recorded}: {result.steps} long swap-in steps (request x layer), "
            f"{result.wanted} positions wanted from the hot region"
        )
        ran = engine if header.get("hot") == result.hot else None
        print("\n".join(report_lines(result, ran)))
    return 0
