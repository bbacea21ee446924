"""Stateful property test of plain HiSparse decoding through the executor.

Interleaves admissions (prompts shorter and longer than HOT), transfers landing at arbitrary times, staging
collection, decode steps, finishes and aborts in every state (staging included), under a device pool small
enough that admissions and steps are refused for memory; a shadow executor with all KV resident runs the same
commands (``shadowed_machine``). After every rule the invariants of docs/invariants.md items 1-5, 7 and 8 hold
and the tokens equal the shadow's; after every rule and every decode step, item 6 holds against the shadow's
KV without waiting for any copy (so a load from a host copy that had not landed, or a column overwritten too
early, shows up); whenever no copy is in flight every host copy equals the shadow's KV, so a committed token
evicted from the hot region is never lost. Item 9 is checked per request: ending one frees exactly what it
owned, and once none is live every pool is back at its initial free count.
"""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis.stateful import precondition, rule
from shadow_model import decoded, machine_settings

from pipeline.config import EngineConfig, HiSparseConfig

from shadowed_machine import ShadowedMachine
from tiny_models import build_tiny_model


class ExecutorMachine(ShadowedMachine):
    model = build_tiny_model()
    config = EngineConfig(
        dtype="float64",
        page_size=4,
        max_context_len=96,
        max_running_requests=4,
        device_pool_tokens=96,  # a few buffers' worth: pressure is real
        hisparse=HiSparseConfig(device_buffer_size=8, host_to_device_ratio=3),
        speculative=None,
        prefix_cache=False,  # the shadow must compute exactly what the executor computes
    )
    shadow_config = EngineConfig(
        dtype="float64",
        page_size=4,
        max_context_len=96,
        max_running_requests=4,
        device_pool_tokens=512,
        hisparse=None,
        speculative=None,
        prefix_cache=False,  # the shadow must compute exactly what the executor computes
    )

    @precondition(lambda self: "decode" in self.phase.values())
    @rule(steps=st.integers(1, 5))
    def decode(self, steps: int) -> None:
        for _ in range(steps):
            ids = [r for r, p in self.phase.items() if p == "decode"]
            # the first request's room is reserved first: ``can_decode`` foretells its refusal
            fits = bool(ids) and self.executor.memory.can_decode(self.executor.seqs[ids[0]].row)
            result = self.executor.decode(ids)
            assert not ids or fits == (ids[0] not in result.refused), f"can_decode said {fits}"
            assert not result.failed, result.failed
            for rid in result.refused:  # (the step took pages, freed none: the room it lacked still lacks)
                assert not self.executor.memory.can_decode(self.executor.seqs[rid].row), rid
            for rid in result.refused:  # memory pressure: the request is retracted
                self.end_request(rid)
            shadow = self.shadow.decode(list(result.tokens))
            assert shadow.tokens == result.tokens, "HiSparse changed the answer"
            for rid, new in result.tokens.items():
                assert len(new) == 1, (rid, new)
                decoded(self.models[rid], self.executor.memory.hot, self.columns(rid))
            self.check_device_kv()
            self.mirrors_match_tables()
            self.check_model("after a decode step: ")


TestExecutorMachine = pytest.mark.proptest(ExecutorMachine.TestCase)
TestExecutorMachine.settings = machine_settings(examples=50, steps=50)


class ChunkedExecutorMachine(ExecutorMachine):
    """The same rules with prompts prefilled 6 tokens per forward (the resident shadow in the same
    chunks, so that every KV row comes from a forward of the same shape): later chunks read the
    earlier ones through the hot region while their copies are held back."""

    config = attrs.evolve(ExecutorMachine.config, chunked_prefill_tokens=6)
    shadow_config = attrs.evolve(ExecutorMachine.shadow_config, chunked_prefill_tokens=6)


TestChunkedExecutorMachine = pytest.mark.proptest(ChunkedExecutorMachine.TestCase)
TestChunkedExecutorMachine.settings = machine_settings(examples=30, steps=40)
