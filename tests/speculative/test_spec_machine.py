"""Stateful property test of speculative decoding on HiSparse memory.

Admissions, transfers landing whenever the test lets them (a manual stream), staging collection,
draft and verify as separate commands, and finishes and aborts at any point — between draft and
verify included — under a device pool small enough to refuse steps. A shadow executor with all KV
resident and the same drafter runs the same commands: the tokens must agree. After every rule the
invariants of ARCHITECTURE §7 hold (check_integrity, the data check excluded because it would wait
for copies and hide a missing wait); after every verify and whenever the copies in flight have
landed, every host copy and every device column holding a committed position equals the shadow's KV
for it. At the end every pool is back at its initial free count.
"""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.executor import Executor, NewSequence
from pipeline.sampling import SamplingParams

from manual_transfer import ManualStreams
from tiny_models import build_tiny_model

MODEL = build_tiny_model(seed=3)
SPEC = SpeculativeConfig(num_steps=2)
CONFIG = EngineConfig(
    dtype="float64",
    page_size=4,
    max_context_len=80,
    max_running_requests=4,
    device_pool_tokens=96,
    hisparse=HiSparseConfig(device_buffer_size=8, host_to_device_ratio=3),
    speculative=SPEC,
)
SHADOW = EngineConfig(
    dtype="float64",
    page_size=4,
    max_context_len=80,
    max_running_requests=4,
    device_pool_tokens=512,
    hisparse=None,
    speculative=SPEC,
)
GREEDY = SamplingParams(max_new_tokens=10_000, ignore_eos=True)


class SpecMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.streams = ManualStreams()
        self.executor = Executor(CONFIG, model=MODEL, transfer=self.streams)
        self.shadow = Executor(SHADOW, model=MODEL)
        self.initial = self.executor.pool_counts()
        self.phase: dict[str, str] = {}  # "staging" | "decode" | "drafted"
        self.next_id = 0

    @rule(length=st.integers(1, 30), seed=st.integers(0, 255))
    def admit(self, length: int, seed: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = tuple((seed * 5 + i * 11) % 256 for i in range(length))
        result = self.executor.prefill([NewSequence(rid, prompt, GREEDY)])
        if rid in result.refused:
            return
        assert self.shadow.prefill([NewSequence(rid, prompt, GREEDY)]).first_tokens == result.first_tokens
        self.phase[rid] = "staging"

    @rule(stream=st.sampled_from(["staging", "backup"]), count=st.integers(0, 3))
    def land(self, stream: str, count: int) -> None:
        self.streams.streams[stream].run_some(count)

    @rule()
    def collect(self) -> None:
        ready = self.executor.collect_ready()
        staged = [r for r, p in self.phase.items() if p == "staging"]
        assert ready == staged[: len(ready)]
        for rid in ready:
            self.phase[rid] = "decode"
        self.shadow.collect_ready()

    @precondition(lambda self: "decode" in self.phase.values())
    @rule()
    def draft(self) -> None:
        ids = [r for r, p in self.phase.items() if p == "decode"]
        result = self.executor.draft(ids)
        for rid in result.refused:
            self._end(rid)
        runnable = [r for r in ids if r not in result.refused]
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

    @precondition(lambda self: bool(self.phase))
    @rule(data=st.data())
    def end(self, data) -> None:
        """Finish or abort in any phase: staging, between steps, or between draft and verify."""
        self._end(data.draw(st.sampled_from(sorted(self.phase))))

    @rule()
    def all_copies_land(self) -> None:
        for stream in self.streams.streams.values():
            stream.synchronize()
        coord, truth = self.executor.memory, self.shadow.memory
        layers = coord.num_layers
        for rid in self.phase:
            row, shadow_row = self.executor.seqs[rid].row, self.shadow.seqs[rid].row
            length = coord.length(row)
            positions = torch.arange(length)
            true_kv = truth.store.kv[:layers, truth.req_to_token[shadow_row, positions]]
            host_kv = coord.host.kv[:, coord.host.req_to_host[row, positions]]
            assert torch.equal(host_kv, true_kv), f"{rid}: a host copy differs from the position's KV"
            if self.phase[rid] != "staging":
                for layer in range(layers):
                    held = coord.buffers.tokens[layer, row].long()
                    cols = torch.nonzero((held >= 0) & (held < length)).reshape(-1)
                    dev = coord.device_kv[layer, coord.buffers.locs[row, cols]]
                    assert torch.equal(dev, true_kv[layer, held[cols]]), f"{rid}: stale device row"

    @invariant()
    def integrity(self) -> None:
        self.executor.check_integrity(data=False)
        assert set(self.executor.seqs) == set(self.phase)

    def _end(self, rid: str) -> None:
        self.executor.release(rid)
        self.shadow.release(rid)
        del self.phase[rid]

    def teardown(self) -> None:
        self.all_copies_land()
        for rid in list(self.phase):
            self._end(rid)
        self.executor.check_integrity()
        assert self.executor.pool_counts() == self.initial
        self.executor.close()
        self.shadow.close()


TestSpecMachine = SpecMachine.TestCase
TestSpecMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
