"""A stateful test harness: a HiSparse executor and an all-resident shadow run the same commands.

The HiSparse executor's transfers land only when a rule lets them (``ManualStreams``), so a missing
wait shows up as corrupted data instead of passing by luck. Subclasses add the decode rules (plain
steps, or draft and verify); the shared rules admit requests, land copies, collect staged requests
and end requests in any phase. Checked against the shadow, which ran the same commands with all KV
resident (docs/invariants.md):

* after every rule, item 6: every device row holding a committed position (a buffer column, or a
  staging prompt's mapped slot) equals the shadow's KV of that position. It waits for no copy: device
  rows are written by the forward, by swap-in loads and by device-to-device moves, none of which is
  a transfer the test holds back, so a load that read a host copy too early shows up here;
* whenever no copy is in flight, every committed position's host copy equals the shadow's KV; once
  every copy has landed, the memory's own data checks too (``check_integrity()``);
* after every rule, the device mirrors of ``req_to_token`` and ``req_to_host`` (kept as distinct
  tensors here, updated row by row as the tables change) equal a fresh copy of the tables;
* after every rule (and every decode step, verify binding and finalize of the subclasses), the
  token table, the host map, the logical-to-physical map and the newest and draft-zone columns equal
  the shadow model (``shadow_model``) of where every position of every request must be, updated by
  each rule from what it did: a prompt's last chunk mapped to its columns and chunk rows, nothing
  mapped once staging is collected, a decoded position in its column, finalize's accepted positions;
* item 9 per request: ending a request raises every pool's free count by exactly what that request
  owned (its row, and its logical, physical and host pages, plus the prefix-cache pages it was the
  last to share), and once no request is live every pool is back at its initial free count, in the
  shadow too, and every pool the stats report is wholly free;
* after every rule, the shadow's own invariants, and the HiSparse counters (``check_counters``);
* nothing is injected, so a forward that raises fails the test instead of being bisected to the
  requests that make it fail (``forward_unisolated``: the bisection reruns a failed batch in parts,
  and a failure of the batched path alone would pass unseen).
"""

from __future__ import annotations

from unittest import mock

import hypothesis.strategies as st
import torch
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from shadow_model import PositionModel, check_buffers, check_tables, last_chunk_start, prefilled

from pipeline import executor as executor_module
from pipeline.config import EngineConfig
from pipeline.driver import prefill_whole
from pipeline.executor import Executor, NewSequence
from pipeline.memory import page_slots
from pipeline.sampling import SamplingParams

from manual_transfer import ManualStreams

GREEDY = SamplingParams(max_new_tokens=10_000, ignore_eos=True)


class ShadowedMachine(RuleBasedStateMachine):
    model = None
    config: EngineConfig
    shadow_config: EngineConfig
    max_prompt = 40

    def __init__(self) -> None:
        super().__init__()
        # a prefix-cache hit computes a prompt's suffix in a forward of another shape than the
        # shadow's whole prompt (equal tokens, not equal bits): both run without the cache
        assert not self.config.prefix_cache and not self.shadow_config.prefix_cache
        self.unisolated = mock.patch.object(executor_module, "isolate", forward_unisolated)
        self.unisolated.start()  # (stopped by ``teardown``, or here if the machine cannot start)
        try:
            self.streams = self.make_streams()
            self.executor = Executor(self.config, model=self.model, transfer=self.streams)
        except BaseException:
            self.unisolated.stop()
            raise
        self.executor.memory.mirror_tables(separate=True)  # a missed mirror update shows
        self.shadow = Executor(self.shadow_config, model=self.model)
        self.initial = self.executor.pool_counts()
        self.shadow_initial = self.shadow.pool_counts()
        self.counters: dict[str, list] | None = None  # the HiSparse counters at the last check
        self.phase: dict[str, str] = {}  # request id -> phase, in admission order
        self.models: dict[str, PositionModel] = {}  # request id -> where its positions must be
        self.next_id = 0

    def make_streams(self) -> ManualStreams:
        """The transfer streams the executor gets (a subclass may inject failures)."""
        return ManualStreams()

    @rule(length=st.integers(1, 40), seed=st.integers(0, 255))
    def admit(self, length: int, seed: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = tuple((seed * 7 + i * 13) % 256 for i in range(min(length, self.max_prompt)))
        result = prefill_whole(self.executor, [NewSequence(rid, prompt, GREEDY)])
        if rid not in result.first_tokens:  # not admitted: memory is short, nothing changed
            assert not result.failed and not self.executor.can_admit(len(prompt))
            return
        shadow = prefill_whole(self.shadow, [NewSequence(rid, prompt, GREEDY)])
        assert shadow.first_tokens == result.first_tokens
        self.phase[rid] = "staging"
        coord, row = self.executor.memory, self.executor.seqs[rid].row
        start = last_chunk_start(
            len(prompt), self.executor.plan.prefill_budget, self.config.chunked_prefill_tokens
        )
        area = torch.cat(
            [
                coord.buffers.locs[row, coord.hot :].cpu(),
                page_slots(coord._mem[row].chunk_pages, coord.plan.page_size),
            ]
        )
        self.models[rid] = model = PositionModel(row)
        prefilled(model, len(prompt), start, coord.hot, area, self.columns(rid))

    @rule(stream=st.sampled_from(["staging", "backup"]), count=st.integers(0, 3))
    def land(self, stream: str, count: int) -> None:
        """Some copies in flight complete (in issue order)."""
        self.streams.streams[stream].run_some(count)

    @rule()
    def collect(self) -> None:
        ready = self.executor.collect_ready()
        staged = [r for r, p in self.phase.items() if p == "staging"]
        assert ready == staged[: len(ready)], "collect_ready must pop in FIFO order"
        for rid in ready:
            self.phase[rid] = "decode"
            self.models[rid].device = {}  # decode reads through the buffer
        self.shadow.collect_ready()

    @precondition(lambda self: bool(self.phase))
    @rule(data=st.data())
    def end(self, data) -> None:
        """A finish or an abort, in any phase (staging and between draft and verify included)."""
        self.end_request(data.draw(st.sampled_from(sorted(self.phase))))

    @rule()
    def all_copies_land(self) -> None:
        for stream in self.streams.streams.values():
            stream.synchronize()
        self.check_kv_against_shadow()
        # the data checks too: every copy has landed, so they wait for nothing the test holds back
        self.executor.check_integrity()

    @invariant()
    def integrity(self) -> None:
        # data=False: the coordinator's data check waits for the copies in flight (it compares
        # against host copies) and so would hide a missing wait; item 6 is checked against the
        # shadow instead, without waiting
        self.executor.check_integrity(data=False)
        self.shadow.check_integrity()  # (the all-resident memory's own invariants)
        assert set(self.executor.seqs) == set(self.phase)
        assert self.executor.staging() == [r for r, p in self.phase.items() if p == "staging"]
        self.counters = check_counters(self.executor, self.counters)
        self.check_device_kv()
        if all(s.done == s.issued for s in self.streams.streams.values()):
            self.check_host_kv()
        self.check_model()

    def check_model(self, what: str = "") -> None:
        """The tables and the buffers' newest and draft columns equal the shadow model."""
        coord = self.executor.memory
        assert set(self.models) == set(self.phase)
        check_tables(self.models, coord.alloc, coord.host.map, what=what)
        check_buffers(self.models, coord.buffers, what=what)

    def columns(self, rid: str) -> list[int]:
        """The device slot of each column of ``rid``'s buffer (-1 past its capacity)."""
        return self.executor.memory.buffers.locs[self.executor.seqs[rid].row].tolist()

    @invariant()
    def mirrors_match_tables(self) -> None:
        coord = self.executor.memory
        tables = {
            "req_to_token": (coord.req_to_token_device, coord.req_to_token),
            "req_to_host": (coord.req_to_host_device, coord.host.req_to_host),
        }
        for name, (mirror, table) in tables.items():
            assert mirror is not table, f"{name}: the mirror should be a distinct tensor in this test"
            assert torch.equal(mirror, table.to(mirror.device)), f"{name}: the device mirror missed an update"

    def check_kv_against_shadow(self) -> None:
        """Host copies and device rows (the host copies only once every copy has landed)."""
        self.check_host_kv()
        self.check_device_kv()

    def _true_kv(self, rid: str, layers: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The shadow's KV of ``positions`` of ``rid`` in ``layers`` (broadcast together)."""
        truth = self.shadow.memory
        return truth.store.kv[layers, truth.req_to_token[self.shadow.seqs[rid].row, positions]]

    def check_host_kv(self) -> None:
        """Every committed position's host copy is its KV (valid once the copies have landed)."""
        coord = self.executor.memory
        every = torch.arange(coord.num_layers)[:, None]
        for rid in self.phase:
            row = self.executor.seqs[rid].row
            positions = torch.arange(coord.length(row))
            host_kv = coord.host.kv[:, coord.host.req_to_host[row, positions]]  # [L, n, dim]
            true_kv = self._true_kv(rid, every, positions[None, :])
            assert torch.equal(host_kv, true_kv), f"{rid}: a host copy differs from the position's KV"

    def check_device_kv(self) -> None:
        """Invariant I6, every layer: a device row holding a committed position is its KV."""
        coord = self.executor.memory
        every = torch.arange(coord.num_layers)[:, None]
        for rid, phase in self.phase.items():
            row = self.executor.seqs[rid].row
            length = coord.length(row)
            if phase == "staging":  # the last chunk's rows are read through the mapping
                positions = torch.arange(length)
                slots = coord.alloc.lookup(coord.req_to_token[row, positions])
                positions, slots = positions[slots > 0], slots[slots > 0]
                device_rows = coord.device_kv[:, slots.to(coord.device)].cpu()  # [L, n, dim]
                true_kv = self._true_kv(rid, every, positions[None, :])
                assert torch.equal(device_rows, true_kv), f"{rid}: a staging prompt's device row differs"
            held = coord.buffers.tokens[:, row].long().cpu()  # [L, columns]
            layers, cols = torch.nonzero((held >= 0) & (held < length), as_tuple=True)
            device_rows = coord.device_kv[layers, coord.buffers.locs[row, cols]].cpu()
            true_kv = self._true_kv(rid, layers, held[layers, cols])
            assert torch.equal(device_rows, true_kv), f"{rid}: a device column holds stale KV"

    def end_request(self, rid: str) -> None:
        """Release ``rid`` in both executors; invariant I9 for that request."""
        coord, row = self.executor.memory, self.executor.seqs[rid].row
        # cached pages it was the last to share become free too (the cache gives them to whoever asks)
        last = sum(1 for entry in coord._mem[row].shared if entry.refs == 1)
        owned = {
            "rows": 1,
            "logical_pages": len(coord.alloc.logical.pages_of(row)) + last,
            "physical_pages": len(coord.alloc.physical.pages_of(row)),
            "host_pages": len(coord.host.allocator.pages_of(row)) + last,
        }
        before = self.executor.pool_counts()
        self.executor.release(rid)
        self.shadow.release(rid)
        del self.phase[rid]
        del self.models[rid]
        after = self.executor.pool_counts()
        freed = {pool: after[pool] - before[pool] for pool in after}
        if getattr(coord.alloc, "arena", None) is not None:
            # one arena's two sides share its free frames: a page freed on one side can give the
            # other a whole frame, so only the direction is exact per request (and every count is
            # back at its initial value once nothing is live, below)
            for pool in ("logical_pages", "physical_pages"):
                assert freed[pool] >= owned[pool], f"{rid}: ending it freed {freed}, it owned {owned}"
                freed[pool] = owned[pool]
        assert freed == owned, f"{rid}: ending it freed {freed}, it owned {owned}"
        if not self.phase:
            assert after == self.initial, "a pool is not back at its initial free count with nothing live"
            assert self.shadow.pool_counts() == self.shadow_initial, "a shadow pool is not back"
            for executor in (self.executor, self.shadow):
                check_pools_free(executor)

    def teardown(self) -> None:
        try:
            self._finish()
        finally:
            self.unisolated.stop()

    def _finish(self) -> None:
        self.all_copies_land()
        for rid in list(self.phase):
            self.end_request(rid)
        self.executor.check_integrity()
        self.shadow.check_integrity()
        assert self.executor.pool_counts() == self.initial
        assert self.shadow.pool_counts() == self.shadow_initial
        for executor in (self.executor, self.shadow):
            check_pools_free(executor)
        self.executor.close()
        self.shadow.close()


def check_pools_free(executor) -> None:
    """With nothing live, every pool the stats report is wholly free, and the row pool's count is
    the one ``pool_counts`` gives."""
    pools = executor.stats()["pools"]
    for name, pool in pools.items():
        assert pool["free"] == pool["capacity"], f"{name}: {pool} with nothing live"
    assert pools["request_rows"]["free"] == executor.pool_counts()["rows"]


def forward_unisolated(items, run, what):
    """``isolate`` for a run without faults: a forward that raises is a defect to report, not a batch
    to bisect (bisection would rerun a failed batched or mixed forward in parts and hide it)."""
    return run(items), {}


COUNTERS = (
    "hits",
    "misses",
    "unrecoverable",
    "h2d_bytes",
    "d2h_bytes",
    "prefill_hits",
    "prefill_loads",
    "prefill_h2d_bytes",
    "hit_rate",
)


def check_counters(executor, before: dict[str, list] | None) -> dict[str, list]:
    """The HiSparse counters (``Executor.stats()["hisparse"]``): one entry per layer of each; every
    host->device byte is a miss's or a prefill load's row, every device->host copy moves the same
    rows in every layer; no miss is unrecoverable; the counts never go down. Returns them, for the
    next check."""
    counters = executor.stats()["hisparse"]
    assert tuple(counters) == COUNTERS, f"the counters are {tuple(counters)}"
    row_bytes = executor.memory.host.row_bytes
    layers = executor.memory.num_layers
    assert all(len(counters[name]) == layers for name in COUNTERS), counters
    for layer in range(layers):
        hits, misses = counters["hits"][layer], counters["misses"][layer]
        assert counters["h2d_bytes"][layer] == misses * row_bytes, (layer, counters)
        assert counters["prefill_h2d_bytes"][layer] == counters["prefill_loads"][layer] * row_bytes, counters
        assert counters["hit_rate"][layer] == round(hits / (hits + misses) if hits + misses else 1.0, 4)
        assert counters["unrecoverable"][layer] == 0, counters
    d2h = counters["d2h_bytes"]
    assert len(set(d2h)) == 1 and d2h[0] % row_bytes == 0, f"device->host bytes {d2h}"
    if before is not None:
        for name in COUNTERS[:-1]:
            assert all(a >= b for a, b in zip(counters[name], before[name])), f"{name} went down"
    return counters
