"""Faults pinned on culprit requests, at every point where one request's work can fail.

The fault matrix test and ``hispec bench soak --faults`` install an ``Injector`` into a running
engine's executor. Each culprit names one point (``POINTS``) and how many of its passages through
that point go by before the fault fires (``after``); a fault fires for its culprit only, and stops
once the culprit has ended, so from the engine's side every fault is transient: the next request
never meets it.

* ``admit``: an allocation in the middle of the culprit's admission raises;
* ``prefill``: a prefill forward (a chunk, alone or mixed with decode) raises while the culprit's
  chunk is in it (the executor bisects);
* ``staging``: a copy of the culprit's prompt KV to host fails (on the transfer worker, or as it is
  issued);
* ``backup``: a copy of the culprit's decoded KV to host fails (the same two ways);
* ``swap_in``: swap-in raises while the culprit's row is in it;
* ``draft`` / ``verify``: the culprit's chain drafting, or its verify forward's binding, raises;
* ``finalize``: taking the host pages of the culprit's accepted tokens raises;
* ``sample``: the culprit's sampling raises (a sampled culprit: greedy decode steps draw nothing);
* ``release``: a free in the middle of releasing the culprit's memory raises (the culprit ended
  already: it must not fail, and every page must come back).

``FaultyStream`` wraps a transfer stream and fails the copies a predicate picks, the way a broken
transfer reports it: from the worker, through the copy's handle (``mode="worker"``), or at once,
from ``copy_rows`` (``mode="issue"``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

POINTS = (
    "admit",
    "prefill",
    "staging",
    "backup",
    "swap_in",
    "draft",
    "verify",
    "finalize",
    "sample",
    "release",
)
# all-resident memory has no such step
HISPARSE_ONLY = frozenset({"staging", "backup", "swap_in", "finalize"})
SPECULATIVE_ONLY = frozenset({"draft", "verify", "finalize"})


def applies(point: str, *, hisparse: bool, speculative: bool) -> bool:
    """Whether a configuration has the step ``point`` names."""
    return (hisparse or point not in HISPARSE_ONLY) and (speculative or point not in SPECULATIVE_ONLY)


class InjectedFault(RuntimeError):
    """What every injected fault raises (its message names the point)."""


def _raise(message: str) -> None:
    raise InjectedFault(message)


class FaultyStream:
    """A ``TransferStream`` whose copies fail while ``fails(dst_idx)`` says so (``dst_idx``: the
    copy's destination rows); the others go to ``inner`` unchanged. ``mode``: ``"worker"``, the
    failure is reported by the copy's handle, as a copy that failed on the transfer worker is (it
    runs there, after the copies before it); ``"issue"``, ``copy_rows`` itself raises."""

    def __init__(
        self,
        inner,
        fails: Callable[[torch.Tensor], bool],
        *,
        mode: str = "worker",
        message: str = "injected copy fault",
    ) -> None:
        assert mode in ("worker", "issue"), mode
        self.inner = inner
        self.fails = fails
        self.mode = mode
        self.message = message
        self.fired = 0

    def copy_rows(self, dst, dst_idx, src, src_idx):
        if not self.fails(dst_idx):
            return self.inner.copy_rows(dst, dst_idx, src, src_idx)
        self.fired += 1
        if self.mode == "issue":
            raise InjectedFault(self.message)
        from pipeline.hisparse.transfer import _FutureHandle

        pool = getattr(self.inner, "_pool", None)
        assert pool is not None, "worker faults need the CPU transfer stream (its worker thread)"
        # the failing job runs on the worker, in issue order, and is the stream's newest copy
        self.inner._last = pool.submit(_raise, self.message)
        return _FutureHandle(self.inner._last)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def close(self) -> None:
        self.inner.close()


@attrs.define
class Culprit:
    request_id: str
    point: str  # one of POINTS
    after: int = 0  # passages of the culprit through the point that go by before the fault fires


@attrs.define
class Fired:
    """What the injector did: faults that fired, by point."""

    counts: dict[str, int] = attrs.Factory(lambda: dict.fromkeys(POINTS, 0))


class Injector:
    """Installs every culprit's fault into ``executor`` (an ``Executor`` whose model, memory and
    streams it may patch) for the duration of ``installed()``. Class-level patches check that they
    act on this executor's objects only."""

    def __init__(self, executor, culprits: list[Culprit], *, copy_mode: str = "worker") -> None:
        self.ex = executor
        self.culprits = {c.request_id: c for c in culprits}
        self.copy_mode = copy_mode
        self.fired = Fired()
        self._seen: collections.Counter[str] = collections.Counter()  # passages per culprit
        self._admitting: str | None = None  # the request whose admission is running
        self._releasing: str | None = None  # the request whose memory is being released
        self._finalizing = False

    # --- deciding ---------------------------------------------------------------------------------

    def _live(self, point: str) -> dict[str, Any]:
        """Live culprits of ``point``: request id -> its executor ``Sequence``."""
        seqs = self.ex.seqs
        return {rid: seqs[rid] for rid, c in self.culprits.items() if c.point == point and rid in seqs}

    def _due(self, rid: str) -> bool:
        """Count one passage of culprit ``rid`` through its point; True when its fault fires now."""
        culprit = self.culprits[rid]
        self._seen[rid] += 1
        if self._seen[rid] <= culprit.after:
            return False
        self.fired.counts[culprit.point] += 1
        return True

    def _fire_if(self, point: str, rids) -> None:
        for rid in rids:
            if rid in self.culprits and self.culprits[rid].point == point and self._due(rid):
                raise InjectedFault(f"injected {point} fault")

    def _rows(self, point: str) -> dict[int, str]:
        return {seq.row: rid for rid, seq in self._live(point).items()}

    # --- installing -----------------------------------------------------------------------------

    @contextmanager
    def installed(self) -> Iterator[Fired]:
        with ExitStack() as stack:
            self._install(stack)
            yield self.fired

    def _install(self, stack: ExitStack) -> None:
        from kernels import hisparse_attend_numba
        from pipeline import sampling
        from pipeline.forward import Forwards
        from pipeline.hisparse.coordinator import HiSparseCoordinator
        from pipeline.memory import HostPool, PagedAllocator
        from pipeline.memory.paged import page_slots
        from pipeline.speculative import batch_round as spec_round

        ex, me = self.ex, self
        memory = ex.memory
        hisparse = isinstance(memory, HiSparseCoordinator)
        memory_type = type(memory)

        def patch(owner, name, make: Callable) -> None:
            real = getattr(owner, name)
            setattr(owner, name, make(real))
            stack.callback(setattr, owner, name, real)

        # admit: an allocation while the culprit's admission runs
        def admit_one(real):
            def run(self, seq):
                if self is ex:
                    me._admitting = seq.request_id
                try:
                    return real(self, seq)
                finally:
                    me._admitting = None

            return run

        def allocate(real):
            def run(self, num_pages, owner):
                rid = me._admitting
                if rid in me.culprits and me.culprits[rid].point == "admit" and me._due(rid):
                    raise InjectedFault("injected admit fault")
                return real(self, num_pages, owner)

            return run

        patch(type(ex), "_admit_one", admit_one)
        patch(PagedAllocator, "allocate", allocate)

        # prefill: a forward carrying the culprit's chunk (alone or mixed with decode tokens)
        def prefill_batch(real):
            def run(self, items):
                if self.memory is ex.memory:
                    me._fire_if("prefill", [seq.request_id for seq, *_ in items])
                return real(self, items)

            return run

        patch(Forwards, "prefill_batch", prefill_batch)

        # staging / backup: the culprit's rows among a copy's host destinations
        if hisparse:

            def copy_fails(point: str) -> Callable[[torch.Tensor], bool]:
                def fails(dst_idx: torch.Tensor) -> bool:
                    targets = set(dst_idx.tolist())
                    for rid, seq in self._live(point).items():
                        pages = memory.host.map.pages(seq.row)
                        mine = set(page_slots(pages, memory.plan.page_size).tolist()) if pages else set()
                        if targets & mine and self._due(rid):
                            return True
                    return False

                return fails

            for point, attr in (("staging", "_staging_stream"), ("backup", "_backup_stream")):
                real_stream = getattr(memory, attr)
                setattr(
                    memory,
                    attr,
                    FaultyStream(
                        real_stream,
                        copy_fails(point),
                        mode=self.copy_mode,
                        message=f"injected {point} copy fault",
                    ),
                )
                stack.callback(setattr, memory, attr, real_stream)

            # swap_in: the step-by-step path and the one-call CPU attention (which runs the same loop)
            def swap_in(real):
                def run(self, layer, top_k_pos, seq_lens, rows, **kwargs):
                    if self is memory:
                        culprit_rows = me._rows("swap_in")
                        me._fire_if("swap_in", [culprit_rows[r] for r in rows.tolist() if r in culprit_rows])
                    return real(self, layer, top_k_pos, seq_lens, rows, **kwargs)

                return run

            def one_call(real):
                def run(pools, views, *rest):
                    if pools.kv.ctypes.data == memory.device_kv.data_ptr():
                        culprit_rows = me._rows("swap_in")
                        rows = set(views.token_rows.tolist())
                        me._fire_if("swap_in", [rid for r, rid in culprit_rows.items() if r in rows])
                    return real(pools, views, *rest)

                return run

            patch(HiSparseCoordinator, "swap_in", swap_in)
            patch(hisparse_attend_numba, "attend_views", one_call)

            # finalize: the host pages of the culprit's accepted tokens
            def finalize_verify(real):
                def run(self, *args, **kwargs):
                    me._finalizing = self is memory
                    try:
                        return real(self, *args, **kwargs)
                    finally:
                        me._finalizing = False

                return run

            def reserve(real):
                def run(self, row, length):
                    if me._finalizing and self is memory.host:
                        culprit_rows = me._rows("finalize")
                        if row in culprit_rows:
                            me._fire_if("finalize", [culprit_rows[row]])
                    return real(self, row, length)

                return run

            patch(HiSparseCoordinator, "finalize_verify", finalize_verify)
            patch(HostPool, "reserve", reserve)

        # draft / verify: the culprit's chain drafting, its verify forward's binding
        def draft(real):
            def run(model, mem, group, num_steps):
                if mem is memory:
                    me._fire_if("draft", [seq.request_id for seq in group])
                return real(model, mem, group, num_steps)

            return run

        def prepare_verify(real):
            def run(self, rows, draft_tokens):
                if self is memory:
                    culprit_rows = me._rows("verify")
                    me._fire_if("verify", [culprit_rows[r] for r in rows if r in culprit_rows])
                return real(self, rows, draft_tokens)

            return run

        patch(spec_round, "draft", draft)
        patch(memory_type, "prepare_verify", prepare_verify)

        # sample: the culprit's own draws (found by its parameters)
        def sample(real):
            def run(logits, params, generator):
                rid = next((r for r, seq in self._live("sample").items() if seq.params is params), None)
                if rid is not None:
                    me._fire_if("sample", [rid])
                return real(logits, params, generator)

            return run

        patch(sampling, "sample", sample)

        # release: one free in the middle of the culprit's memory release
        def executor_release(real):
            def run(self, request_id, **kwargs):
                culprit = me.culprits.get(request_id)
                armed = (
                    self is ex
                    and culprit is not None
                    and culprit.point == "release"
                    and request_id in ex.seqs
                )
                if armed:
                    me._releasing = request_id
                try:
                    return real(self, request_id, **kwargs)
                finally:
                    if armed:
                        me._releasing = None

            return run

        def free(real):
            def run(self, pages, owner):
                rid = me._releasing
                if rid is not None and me._due(rid):
                    me._releasing = None  # once per release
                    raise InjectedFault("injected release fault")
                return real(self, pages, owner)

            return run

        patch(type(ex), "release", executor_release)
        patch(PagedAllocator, "free", free)
