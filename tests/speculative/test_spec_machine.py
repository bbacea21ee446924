"""Stateful property test of speculative decoding on HiSparse memory.

The shared rules of ``shadowed_machine`` (admissions, transfers landing at arbitrary times, staging
collection, finishes and aborts in any phase) plus draft and verify as separate commands, so
requests also end between draft and verify; every run starts with one request past staging, so
that rounds come early. The all-resident shadow drafts and verifies the same way:
drafts and committed tokens must agree. The invariants of docs/invariants.md are checked after every
rule and after every verify; host copies and device columns are checked against the shadow's KV
whenever the copies have landed; every pool is back at its initial count at the end. The shadow
model of the positions (``shadow_model``) is checked after verify binding (each verify token's
column holds its position, its location maps to that column) and after finalize (the accepted ones
where finalize puts them, the rejected ones mapped to nothing).
"""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis.stateful import initialize, precondition, rule
from shadow_model import check_tables, finalized, machine_settings, verify_columns

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.memory.targets import VerifyLayout

from shadowed_machine import ShadowedMachine
from tiny_models import build_tiny_model

SPEC = SpeculativeConfig(num_steps=2, max_batch_size=8)  # rounds for small batches on a CPU too


class SpecMachine(ShadowedMachine):
    model = build_tiny_model(seed=3)
    max_prompt = 30
    config = EngineConfig(
        dtype="float64",
        page_size=4,
        max_context_len=80,
        max_running_requests=4,
        device_pool_tokens=96,
        hisparse=HiSparseConfig(device_buffer_size=8, host_to_device_ratio=3),
        speculative=SPEC,
        prefix_cache=False,  # the shadow must compute exactly what the executor computes
    )
    shadow_config = EngineConfig(
        dtype="float64",
        page_size=4,
        max_context_len=80,
        max_running_requests=4,
        device_pool_tokens=512,
        hisparse=None,
        speculative=SPEC,
        prefix_cache=False,  # the shadow must compute exactly what the executor computes
    )

    def __init__(self) -> None:
        super().__init__()
        verify = self.executor.memory.verify  # (an instance of its own: the test checks each binding)
        self.prepare = verify.prepare
        verify.prepare = self.checked_prepare

    @initialize(length=st.integers(1, 30), seed=st.integers(0, 255))
    def a_request_decoding(self, length: int, seed: int) -> None:
        """Every run starts with a request past staging, so that its rounds come early."""
        self.admit(length, seed)
        self.all_copies_land()
        self.collect()

    @precondition(lambda self: "decode" in self.phase.values())
    @rule()
    def draft(self) -> None:
        ids = [r for r, p in self.phase.items() if p == "decode"]
        d = self.executor.draft_tokens
        runnable, refused = self.executor.reserve(ids, new_tokens=d, speculative=True)
        for rid in refused:  # (the reservations took pages, freed none: the room it lacked still lacks)
            row = self.executor.seqs[rid].row
            demoting = self.config.hisparse.residency == "dynamic"  # (a demotion frees pages)
            assert demoting or not self.executor.memory.can_decode(row, new_tokens=d, speculative=True), rid
        for rid in refused:
            self.end_request(rid)
        drafted = self.executor.draft(runnable)
        assert not drafted.failed, drafted.failed
        self.shadow.reserve(runnable, new_tokens=d, speculative=True)
        self.shadow.draft(runnable)
        for rid in runnable:
            assert self.executor.seqs[rid].draft.drafts == self.shadow.seqs[rid].draft.drafts
            self.phase[rid] = "drafted"

    @precondition(lambda self: "drafted" in self.phase.values())
    @rule()
    def verify(self) -> None:
        ids = [r for r, p in self.phase.items() if p == "drafted"]
        result = self.executor.verify(ids)
        assert not result.failed, result.failed  # (the reasons whole: a check inside a step fails it)
        assert result.tokens == self.shadow.verify(ids).tokens, "HiSparse changed the answer"
        hot, d = self.executor.memory.hot, self.executor.draft_tokens
        for rid in ids:
            self.phase[rid] = "decode"
            count = len(result.tokens[rid])
            assert count == result.accepted[rid] + 1, (rid, result.tokens[rid], result.accepted[rid])
            finalized(self.models[rid], count, d, hot, self.columns(rid))
        self.executor.check_integrity(data=False)
        self.check_model("after finalize: ")

    def checked_prepare(self, rows: list[int], draft_tokens: int) -> VerifyLayout:
        """The coordinator's verify binding, checked against the model before the forward: each
        verify token's column holds its position in every layer, its location maps to that column's
        slot, every other draft-zone column is empty and nothing else changed."""
        layout = self.prepare(rows, draft_tokens)
        coord = self.executor.memory
        # the slots finalize reads on the host are the ones the forward writes
        assert layout.host_slots == tuple(layout.targets.slots.tolist()), "host and device slots differ"
        by_row = {self.executor.seqs[rid].row: rid for rid in self.models}
        models = {rid: attrs.evolve(m, device=dict(m.device)) for rid, m in self.models.items()}
        tokens = coord.buffers.tokens.cpu()
        for row in rows:
            rid = by_row[row]
            model, slots = models[rid], self.columns(rid)
            cols = verify_columns(model.length, draft_tokens, coord.hot)
            for j, col in enumerate(cols):
                pos = model.length + j
                held = tokens[:, row, col]
                assert bool((held == pos).all()), (
                    f"{rid}: verify column {col} holds {held.tolist()}, not {pos}"
                )
                model.device[pos] = slots[col]
            zone = [c for c in range(coord.hot + 1, coord.buffers.columns) if c not in cols]
            assert bool((tokens[:, row, zone] == -1).all()), (
                f"{rid}: a draft-zone column not verifying holds one"
            )
        check_tables(models, coord.alloc, coord.host.map, what="after verify binding: ")
        return layout

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            del self.executor.memory.verify.prepare  # (no cycle from the memory back to the test)


TestSpecMachine = pytest.mark.proptest(SpecMachine.TestCase)
TestSpecMachine.settings = machine_settings(examples=80, steps=40)
