"""Stateful property test of speculative decoding on HiSparse memory.

The shared rules of ``shadowed_machine`` (admissions, transfers landing at arbitrary times, staging
collection, finishes and aborts in any phase) plus draft and verify as separate commands, so
requests also end between draft and verify. The all-resident shadow drafts and verifies the same way:
drafts and committed tokens must agree. The invariants of docs/invariants.md are checked after every
rule and after every verify; host copies and device columns are checked against the shadow's KV
whenever the copies have landed; every pool is back at its initial count at the end.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import precondition, rule

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig

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

    @precondition(lambda self: "decode" in self.phase.values())
    @rule()
    def draft(self) -> None:
        ids = [r for r, p in self.phase.items() if p == "decode"]
        d = self.executor.draft_tokens
        runnable, refused = self.executor.reserve(ids, new_tokens=d, speculative=True)
        for rid in refused:
            self.end_request(rid)
        assert not self.executor.draft(runnable).failed
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
        assert not result.failed
        assert result.tokens == self.shadow.verify(ids).tokens, "HiSparse changed the answer"
        for rid in ids:
            self.phase[rid] = "decode"
        self.executor.check_integrity(data=False)


TestSpecMachine = SpecMachine.TestCase
TestSpecMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
