"""``hispec bench soak``: a long seeded workload with injected faults, checked round by round.

Each round draws a workload from its seed (mixed prompt lengths, greedy and sampled requests, stop
strings, every way a request can be given up: ``abort``, a cancelled consumer, a timeout, leaving a
stream block early), serves it on pools small enough to retract requests, alternately with
speculation on and off, and injects faults pinned on a few *culprit* requests:

* ``forward``: a batched forward raises whenever a culprit is in it (the executor bisects);
* ``sampling``: the culprit's own sampling raises at its n-th token;
* ``swap_in``: swap-in raises for a culprit's row (HiSparse decode);
* ``staging``: the culprit's prompt copy to host fails;
* ``release``: releasing a culprit's memory raises once (it must be freed all the same);
* ``host``: the host pool refuses a culprit's finalize (speculation: the round rolls back);
* ``executor``: a whole command raises (every request of that command is a culprit).

With ``--faults`` the culprits' faults are instead the fault points of ``pipeline.benchmarks.faults``
(admission, a prefill forward, a staging copy, a backup copy, swap-in, drafting, verify, finalize,
sampling, release; ``--faults admit,backup`` picks some), each firing at a random passage of its
culprit through its point, in rounds that go round HiSparse on and off, speculation on and off, and
a failing copy reported by the transfer worker or raised as it is issued.

After each round: no hang (a watchdog), every request ended in a terminal state, only culprits
failed (a release fault fails nobody: its request has ended), every greedy request that was not given
up has exactly the tokens of a fault-free run of the synchronous driver (a sampled one too, without
speculation), the request served after the round (after every fault) is too, every pool is back at
its initial count, and the lifecycle log replays legally. ``run_round`` is what the reliability tests
call with a small workload; the benchmark runs rounds for ``--minutes`` (or ``--requests``) and
reports requests, faults by kind, failures (of which culprits), hangs, leaks and the process's RSS
growth.
"""

from __future__ import annotations

import argparse
import logging
import random
import resource
import time
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import ExitStack, contextmanager, suppress
from typing import Any, Required, TypedDict

import anyio
import attrs
import structlog

from pipeline.benchmarks.faults import POINTS, Culprit, Injector, applies
from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig

FAULTS = ("forward", "sampling", "swap_in", "staging", "release", "host", "executor")
# how many passages of its culprit through a fault point go by before the fault fires, drawn from
# 0 up to this (about how often a request passes it; an all-resident admission allocates once, and
# its release frees once)
LATEST = dict(admit=3, prefill=1, staging=1, backup=12, swap_in=12, draft=6, verify=6, finalize=6, sample=8,
              release=3)
RESIDENT_LATEST = dict(LATEST, admit=0, release=0)
GIVE_UPS = ("finish", "finish", "finish", "abort", "cancel", "timeout", "leave")


@attrs.frozen
class Item:
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampled: bool
    stop: tuple[str, ...]
    give_up: str  # one of GIVE_UPS
    # one of FAULTS (or of the fault points, ``faults.POINTS``) when this request is a culprit
    fault: str | None
    after: int = 0  # a fault point's passages of the culprit that go by before it fires


@attrs.frozen
class RoundReport:
    requests: int
    faults: int  # culprits with a fault injected
    failed: int  # requests that ended FAILED
    failed_culprits: int  # of which culprits
    wrong: tuple[str, ...]  # requests whose tokens differ from the fault-free run
    leaked: bool  # a pool not back at its initial count
    illegal: int  # lifecycle events that do not replay
    fired: dict[str, int] = attrs.Factory(dict)  # faults that fired, by kind


def workload(
    seed: int, *, size: int, fault_rate: float, points: tuple[str, ...] | None = None, hisparse: bool = True
) -> list[Item]:
    """``size`` seeded requests, a share ``fault_rate`` of them culprits: of ``FAULTS``, or with
    ``points`` of those fault points, each at a random passage (a ``sample`` culprit samples;
    ``hisparse``: the memory the round runs on)."""
    rng = random.Random(seed)
    latest = LATEST if hisparse else RESIDENT_LATEST
    items = []
    for i in range(size):
        n = rng.choice([rng.randint(1, 12), rng.randint(13, 60)])
        prompt = tuple(rng.randrange(0, 250) for _ in range(n))
        fault = rng.choice(points or FAULTS) if rng.random() < fault_rate else None
        stop = ("\n\n",) if rng.random() < 0.2 else ()
        max_new, sampled, give_up = rng.randint(1, 40), rng.random() < 0.3, rng.choice(GIVE_UPS)
        after = rng.randint(0, latest[fault]) if points and fault else 0
        items.append(
            Item(f"s{seed}-{i}", prompt, max_new, sampled or fault == "sample", stop, give_up, fault, after)
        )
    return items


def params_of(item: Item):
    from pipeline.sampling import SamplingParams

    seed = hash(item.request_id) % (1 << 31)
    if item.sampled:
        return SamplingParams(max_new_tokens=item.max_new_tokens, temperature=0.8, seed=seed, stop=item.stop)
    return SamplingParams(max_new_tokens=item.max_new_tokens, stop=item.stop)


def round_config(speculative: bool, hisparse: bool = True) -> EngineConfig:
    """float64, pages of 8, HOT 16, pools small enough that long requests are retracted."""
    return EngineConfig(
        dtype="float64",
        page_size=8,
        max_context_len=112,
        max_running_requests=6,
        device_pool_tokens=128,
        hisparse=HiSparseConfig(device_buffer_size=16, host_to_device_ratio=2) if hisparse else None,
        # rounds at any batch size (a CPU's default rule would keep them to a request alone)
        speculative=SpeculativeConfig(num_steps=2, max_batch_size=None) if speculative else None,
    )


def reference(model, cfg: EngineConfig, items: list[Item]) -> dict[str, list[int]]:
    """The fault-free tokens of every request, from the synchronous driver."""
    from pipeline.driver import SyncDriver
    from pipeline.executor import Executor

    executor = Executor(cfg, model=model)
    driver = SyncDriver(executor)
    reqs = [driver.submit(list(it.prompt), params_of(it), request_id=it.request_id) for it in items]
    driver.run()
    executor.close()
    return {r.request_id: list(r.output_ids) for r in reqs}


@attrs.define
class Fired:
    """What the injector did: faults that fired, by kind, and the requests of whole commands that
    were made to fail (an executor fault fails its command's every request: they are culprits too)."""

    counts: dict[str, int] = attrs.Factory(lambda: dict.fromkeys(FAULTS, 0))
    victims: set[str] = attrs.Factory(set)


@contextmanager
def injected(engine, items: list[Item]) -> Iterator[Fired]:
    """Install every culprit's fault into ``engine``. The patches are class-level where the classes
    keep no instance dictionary, and each checks that it acts on this engine's objects only."""
    from kernels import hisparse_attend_numba
    from pipeline import sampling
    from pipeline.hisparse.coordinator import HiSparseCoordinator
    from pipeline.hisparse.verify import VerifyBuffers
    from pipeline.memory import HostPool, OutOfMemory

    ex = engine.executor
    culprits = {it.request_id: it.fault for it in items if it.fault}
    fired = Fired()

    def rows_of(kind: str) -> set[int]:
        return {s.row for rid, s in list(ex.seqs.items()) if culprits.get(rid) == kind}

    with ExitStack() as stack:

        def patch(owner, name, make: Callable):
            real = getattr(owner, name)
            setattr(owner, name, make(real))
            stack.callback(setattr, owner, name, real)

        def forward(real):
            def run(self, group):
                seqs = [item[0] if isinstance(item, tuple) else item for item in group]
                if self is ex and any(culprits.get(s.request_id) == "forward" for s in seqs):
                    fired.counts["forward"] += 1
                    raise RuntimeError("injected forward fault")
                return real(self, group)

            return run

        for name in ("_prefill_forward", "_decode_forward"):
            patch(type(ex), name, forward)

        draws: dict[str, int] = {}

        def sample(real):
            def run(logits, params, generator):
                rid = next((r for r, s in list(ex.seqs.items()) if s.params is params), None)
                if rid is not None and culprits.get(rid) == "sampling":
                    draws[rid] = draws.get(rid, 0) + 1
                    if draws[rid] == 3:
                        fired.counts["sampling"] += 1
                        raise FloatingPointError("injected sampling fault")
                return real(logits, params, generator)

            return run

        patch(sampling, "sample", sample)

        def swap_in(real):
            def run(self, layer, top_k_pos, seq_lens, rows, **kwargs):
                if self is ex.memory and rows_of("swap_in") & set(rows.tolist()):
                    fired.counts["swap_in"] += 1
                    raise RuntimeError("injected swap-in fault")
                return real(self, layer, top_k_pos, seq_lens, rows, **kwargs)

            return run

        patch(HiSparseCoordinator, "swap_in", swap_in)

        def one_call(real):  # a decode layer's swap-in inside the one-call CPU attention: the same fault
            def run(pools, views, *rest):
                pool = getattr(ex.memory, "device_kv", None)  # this engine's HiSparse pool, or none
                ours = pool is not None and pools.kv.ctypes.data == pool.data_ptr()
                if ours and rows_of("swap_in") & set(views.token_rows.tolist()):
                    fired.counts["swap_in"] += 1
                    raise RuntimeError("injected swap-in fault")
                return real(pools, views, *rest)

            return run

        patch(hisparse_attend_numba, "attend_views", one_call)

        def start_staging(real):
            def run(self, row, length):
                real(self, row, length)
                if self is ex.memory and row in rows_of("staging"):
                    fired.counts["staging"] += 1
                    self._mem[row].staging.wait()  # the data lands; the transfer reports a failure
                    self._mem[row].staging = _BrokenCopy()

            return run

        patch(HiSparseCoordinator, "start_staging", start_staging)

        def release(real):
            done: set[str] = set()

            def run(request_id, **kwargs):
                if culprits.get(request_id) == "release" and request_id not in done:
                    done.add(request_id)
                    fired.counts["release"] += 1
                    raise RuntimeError("injected release fault")
                return real(request_id, **kwargs)

            return run

        patch(ex, "release", release)
        finalizing = [False]

        def finalize(real):
            def run(self, rows, accepted, layout):
                finalizing[0] = self is getattr(ex.memory, "verify", None)
                try:
                    return real(self, rows, accepted, layout)
                finally:
                    finalizing[0] = False

            return run

        def reserve(real):
            def run(self, row, length):
                if finalizing[0] and self is ex.memory.host and row in rows_of("host"):
                    fired.counts["host"] += 1
                    raise OutOfMemory("host (injected)", 1, 0)
                return real(self, row, length)

            return run

        patch(VerifyBuffers, "finalize", finalize)
        patch(HostPool, "reserve", reserve)

        def dispatch(real):
            def run(self, command, idle):
                ids = getattr(command, "request_ids", ())
                if (
                    self is ex
                    and type(command).__name__ == "Decode"
                    and any(culprits.get(r) == "executor" for r in ids)
                ):
                    fired.counts["executor"] += 1
                    fired.victims.update(ids)
                    raise RuntimeError("injected executor fault")
                return real(self, command, idle)

            return run

        patch(type(ex), "_dispatch", dispatch)
        yield fired


class _BrokenCopy:
    """A copy handle that reports a failure (the data landed, the transfer says it did not)."""

    def query(self) -> bool:
        raise OSError("injected staging copy fault")

    def wait(self) -> None:
        raise OSError("injected staging copy fault")

    def order_after(self) -> None:
        raise OSError("injected staging copy fault")


async def serve(engine, items: list[Item]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}

    async def one(it: Item) -> None:
        from pipeline.errors import RequestFailed

        got: list[int] = []
        tokens[it.request_id] = got
        try:
            if it.give_up == "timeout":
                with suppress(TimeoutError):
                    await engine.generate_text(
                        list(it.prompt), params_of(it), request_id=it.request_id, timeout=0.01
                    )
                return
            with anyio.CancelScope() as scope:
                async with engine.generate(
                    list(it.prompt), params_of(it), request_id=it.request_id
                ) as stream:
                    async for delta in stream:
                        got.extend(delta.token_ids)
                        if got and it.give_up == "abort":
                            engine.abort(it.request_id)
                        elif got and it.give_up == "cancel":
                            scope.cancel()
                        elif got and it.give_up == "leave":
                            break
        except RequestFailed:
            pass

    async with anyio.create_task_group() as tg:
        for it in items:
            tg.start_soon(one, it)
    return tokens


def run_round(
    model,
    items: list[Item],
    *,
    speculative: bool,
    hisparse: bool = True,
    points: bool = False,
    copy_mode: str = "worker",
    watchdog_s: float = 300.0,
) -> RoundReport:
    """One round (see the module docstring); raises ``TimeoutError`` on a hang. ``points``: the
    items' faults are fault points (``pipeline.benchmarks.faults``), failing copies the
    ``copy_mode`` way; else they are ``FAULTS``."""
    from pipeline.engine import Engine
    from pipeline.logs import replay
    from statemachines.request import State

    cfg = round_config(speculative, hisparse)
    after = Item(f"next-{items[0].request_id}", items[0].prompt, 8, False, (), "finish", None)
    expected = reference(model, cfg, [*items, after])
    states: dict[str, State] = {}

    async def main():
        with _lifecycle_logs() as logs:
            async with Engine(cfg, model=model) as engine:
                install = injected(engine, items) if not points else _points(engine, items, copy_mode)
                with install as fired, anyio.fail_after(watchdog_s):
                    got = await serve(engine, items)
                    await engine.wait_idle()
                    # whatever fired, left nothing behind: the next request is served as ever
                    got.update(await serve(engine, [after]))
                for rid in got:
                    req = engine._registry.live.get(rid)
                    assert req is None, f"{rid} still live"
        try:
            states.update(replay(logs))
        except Exception:  # an illegal transition in the log
            states["__illegal__"] = State.FAILED
        return engine, got, fired

    engine, got, fired = anyio.run(main)
    # (a release fault comes after its request has ended: it must fail nobody)
    culprits = {it.request_id for it in items if it.fault and not (points and it.fault == "release")}
    culprits |= fired.victims
    failed = {rid for rid, s in states.items() if s is State.FAILED}
    wrong = []
    for it in [*items, after]:
        rid = it.request_id
        if rid in failed or rid in culprits:
            continue
        exact = not it.sampled or not speculative  # sampled + speculation: same distribution, not tokens
        complete = it.give_up == "finish" and states.get(rid) is State.FINISHED
        if exact and (got[rid] != expected[rid] if complete else got[rid] != expected[rid][: len(got[rid])]):
            wrong.append(rid)
    innocent = sorted(failed - culprits)
    ended = (State.FINISHED, State.ABORTED, State.FAILED)
    return RoundReport(
        requests=len(items),
        faults=sum(fired.counts.values()),
        failed=len(failed),
        failed_culprits=len(failed & culprits),
        wrong=tuple(sorted(set(wrong + innocent))),
        leaked=engine.final_pool_counts != engine.initial_pool_counts,
        illegal=illegal_of(states, got, ended),
        fired={kind: n for kind, n in fired.counts.items() if n},
    )


@contextmanager
def _points(engine, items: list[Item], copy_mode: str) -> Iterator[Fired]:
    """The items' fault points installed into ``engine`` (``faults.Injector``), reported as ``Fired``."""
    culprits = [Culprit(it.request_id, it.fault, it.after) for it in items if it.fault]
    with Injector(engine.executor, culprits, copy_mode=copy_mode).installed() as fired:
        report = Fired(counts=fired.counts)
        yield report


@contextmanager
def _lifecycle_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Capture every event at info level and above (whatever level the application configured)."""
    before = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with structlog.testing.capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(**before)


def illegal_of(states, got, ended) -> int:
    """Requests whose log does not end in a terminal state (a log that does not replay counts all)."""
    if states.get("__illegal__"):
        return len(got)
    return sum(1 for rid in got if states.get(rid) not in ended)


def build_model(seed: int = 0):
    from pipeline.model import ModelConfig, init_weights
    from pipeline.model.model import DeepseekV32

    cfg = ModelConfig(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        routed_scaling_factor=1.0,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_layer_types=("dense", "sparse"),
        hidden_act="silu",
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=2,
        tie_word_embeddings=False,
        eos_token_id=256,
        num_nextn_predict_layers=1,
        dtype="float64",
    )
    import torch

    return init_weights(DeepseekV32(cfg), seed=seed).to_dtype(torch.float64).eval()


def _fault_points(value: str) -> tuple[str, ...]:
    points = POINTS if value == "all" else tuple(p.strip() for p in value.split(",") if p.strip())
    unknown = sorted(set(points) - set(POINTS))
    if unknown or not points:
        raise argparse.ArgumentTypeError(f"fault points are {', '.join(POINTS)} (or all); got {value!r}")
    return points


class RoundKind(TypedDict, total=False):
    """``run_round``'s configuration arguments."""

    speculative: Required[bool]
    hisparse: bool
    points: bool
    copy_mode: str


class RoundPoints(TypedDict, total=False):
    """``workload``'s fault arguments."""

    points: tuple[str, ...] | None
    hisparse: bool


def round_kind(round_no: int, points: bool) -> RoundKind:
    """A round's configuration: speculation alternates; with fault points, HiSparse too, and the
    way a failing copy reports (on the transfer worker, or as it is issued)."""
    if not points:
        return RoundKind(speculative=round_no % 2 == 1)
    return RoundKind(
        speculative=round_no % 2 == 1,
        hisparse=round_no % 4 < 2,
        points=True,
        copy_mode="worker" if round_no % 8 < 4 else "issue",
    )


def round_points(kind: RoundKind, points: tuple[str, ...] | None) -> RoundPoints:
    """``workload``'s fault arguments for a round of ``kind``: the points its configuration has."""
    if points is None:
        return RoundPoints()
    hisparse, speculative = bool(kind["hisparse"]), bool(kind["speculative"])
    return RoundPoints(
        points=tuple(p for p in points if applies(p, hisparse=hisparse, speculative=speculative)) or None,
        hisparse=hisparse,
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hispec bench soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=None, help="stop once this many requests ran")
    parser.add_argument("--size", type=int, default=24, help="requests per round")
    parser.add_argument("--fault-rate", type=float, default=0.2, help="share of requests that are culprits")
    parser.add_argument(
        "--faults",
        type=_fault_points,
        nargs="?",
        const=POINTS,
        default=None,
        metavar="POINTS",
        help=f"inject faults at these points ({','.join(POINTS)}; all when none is named) instead of the "
        f"classic kinds ({','.join(FAULTS)})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from pipeline.logs import configure_logging

    configure_logging(level="warning", stream=open("/dev/null", "w"))  # noqa: SIM115 - the run's whole life
    model = build_model(args.seed)
    start = time.monotonic()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    totals = dict(
        rounds=0, requests=0, faults=0, failed=0, failed_culprits=0, wrong=0, hangs=0, leaks=0, illegal=0
    )
    kinds = args.faults or FAULTS
    by_kind = dict.fromkeys(kinds, 0)
    round_no = 0

    def more() -> bool:
        if args.requests is not None and totals["requests"] >= args.requests:
            return False
        return time.monotonic() - start < args.minutes * 60

    while more():
        kind = round_kind(round_no, args.faults is not None)
        items = workload(
            args.seed * 100_003 + round_no,
            size=args.size,
            fault_rate=args.fault_rate,
            **round_points(kind, args.faults),
        )
        try:
            report = run_round(model, items, **kind)
        except TimeoutError:
            totals["hangs"] += 1
            round_no += 1
            continue
        totals["rounds"] += 1
        for key in ("requests", "faults", "failed", "failed_culprits", "illegal"):
            totals[key] += getattr(report, key)
        for fault, n in report.fired.items():
            by_kind[fault] = by_kind.get(fault, 0) + n
        totals["wrong"] += len(report.wrong)
        totals["leaks"] += int(report.leaked)
        round_no += 1
        if round_no % 10 == 0:
            print(
                f"  {round_no} rounds, {totals['requests']} requests, {time.monotonic() - start:.0f}s",
                flush=True,
            )
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        f"soak: {totals['rounds']} rounds in {(time.monotonic() - start) / 60:.1f} min, "
        f"{totals['requests']} requests, {totals['faults']} faults injected, {totals['failed']} failed "
        f"(of which {totals['failed_culprits']} culprits), {totals['wrong']} wrong outputs, "
        f"{totals['hangs']} hangs, {totals['leaks']} rounds with pools not restored, "
        f"{totals['illegal']} illegal lifecycles, peak RSS {rss0 / 1024:.0f} -> {rss1 / 1024:.0f} MiB"
    )
    print("faults injected by kind: " + ", ".join(f"{kind} {n}" for kind, n in by_kind.items()))
    print(f"leaks: {totals['leaks']}")
    bad = totals["hangs"] + totals["leaks"] + totals["wrong"] + totals["illegal"]
    return 1 if bad else 0
