"""A stateful test harness: a HiSparse executor and an all-resident shadow run the same commands.

The HiSparse executor's transfers land only when a rule lets them (``ManualStreams``), so a missing
wait shows up as corrupted data instead of passing by luck. Subclasses add the decode rules (plain
steps, or draft and verify); the shared rules admit requests, land copies, collect staged requests,
end requests in any phase, and compare every host copy and device column holding a committed
position against the shadow's KV once the copies have landed.
"""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pipeline.config import EngineConfig
from pipeline.executor import Executor, NewSequence
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
        self.streams = ManualStreams()
        self.executor = Executor(self.config, model=self.model, transfer=self.streams)
        self.shadow = Executor(self.shadow_config, model=self.model)
        self.initial = self.executor.pool_counts()
        self.phase: dict[str, str] = {}  # request id -> phase, in admission order
        self.next_id = 0

    @rule(length=st.integers(1, 40), seed=st.integers(0, 255))
    def admit(self, length: int, seed: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = tuple((seed * 7 + i * 13) % 256 for i in range(min(length, self.max_prompt)))
        result = self.executor.prefill([NewSequence(rid, prompt, GREEDY)])
        if rid in result.refused:
            assert not self.executor.can_admit(len(prompt))
            return
        shadow = self.shadow.prefill([NewSequence(rid, prompt, GREEDY)])
        assert shadow.first_tokens == result.first_tokens
        self.phase[rid] = "staging"

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

    @invariant()
    def integrity(self) -> None:
        # data=False: the data check would wait for copies and so hide a missing wait
        self.executor.check_integrity(data=False)
        assert set(self.executor.seqs) == set(self.phase)
        assert self.executor.staging() == [r for r, p in self.phase.items() if p == "staging"]

    def check_kv_against_shadow(self) -> None:
        coord, truth = self.executor.memory, self.shadow.memory
        layers = coord.num_layers
        for rid, phase in self.phase.items():
            row, shadow_row = self.executor.seqs[rid].row, self.shadow.seqs[rid].row
            length = coord.length(row)
            positions = torch.arange(length)
            true_kv = truth.store.kv[:layers, truth.req_to_token[shadow_row, positions]]  # [L, n, dim]
            host_kv = coord.host.kv[:, coord.host.req_to_host[row, positions]]
            assert torch.equal(host_kv, true_kv), f"{rid}: a host copy differs from the position's KV"
            if phase == "staging":
                continue
            for layer in range(layers):
                held = coord.buffers.tokens[layer, row].long()
                cols = torch.nonzero((held >= 0) & (held < length)).reshape(-1)
                device_rows = coord.device_kv[layer, coord.buffers.locs[row, cols]]
                assert torch.equal(device_rows, true_kv[layer, held[cols]]), f"{rid}: stale device row"

    def end_request(self, rid: str) -> None:
        self.executor.release(rid)
        self.shadow.release(rid)
        del self.phase[rid]

    def teardown(self) -> None:
        self.all_copies_land()
        for rid in list(self.phase):
            self.end_request(rid)
        self.executor.check_integrity()
        assert self.executor.pool_counts() == self.initial
        self.executor.close()
        self.shadow.close()
