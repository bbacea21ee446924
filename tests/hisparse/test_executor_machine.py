"""Stateful property test of HiSparse decoding through the executor.

Interleaves admissions (prompts shorter and longer than HOT), transfers landing in arbitrary order of
time (a manual stream: a copy lands only when the test lets it or someone waits for it), staging
collection, decode steps, finishes and aborts in every state (staging included), under a device pool
small enough that admissions and steps are refused for memory. A shadow executor with all KV
resident runs the same commands.

After every rule ARCHITECTURE §7 items 1-5, 7 and 8 hold (``check_integrity``) and the tokens equal
the shadow's. Whenever the copies in flight have landed, item 6 holds against the *shadow's* KV:
every host copy of a committed position, and every device column holding one, equals the KV the
resident run computed for it — so a committed token evicted from the hot region is never lost. At
the end, with every request ended, every pool is back at its initial free count.
"""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pipeline.config import EngineConfig, HiSparseConfig
from pipeline.executor import Executor, NewSequence
from pipeline.sampling import SamplingParams

from manual_transfer import ManualStreams
from tiny_models import build_tiny_model

MODEL = build_tiny_model()
CONFIG = EngineConfig(
    dtype="float64",
    page_size=4,
    max_context_len=96,
    max_running_requests=4,
    device_pool_tokens=96,  # a few buffers' worth: pressure is real
    hisparse=HiSparseConfig(device_buffer_size=8, host_to_device_ratio=3),
    speculative=None,
)
SHADOW = EngineConfig(
    dtype="float64",
    page_size=4,
    max_context_len=96,
    max_running_requests=4,
    device_pool_tokens=512,
    hisparse=None,
    speculative=None,
)
GREEDY = SamplingParams(max_new_tokens=10_000, ignore_eos=True)


class ExecutorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.streams = ManualStreams()
        self.executor = Executor(CONFIG, model=MODEL, transfer=self.streams)
        self.shadow = Executor(SHADOW, model=MODEL)
        self.initial = self.executor.pool_counts()
        self.phase: dict[str, str] = {}  # request id -> "staging" | "decode", in admission order
        self.next_id = 0

    # --- rules ----------------------------------------------------------------------------------

    @rule(length=st.integers(1, 40), seed=st.integers(0, 255))
    def admit(self, length: int, seed: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = tuple((seed * 7 + i * 13) % 256 for i in range(length))
        result = self.executor.prefill([NewSequence(rid, prompt, GREEDY)])
        if rid in result.refused:
            assert not self.executor.can_admit(length)
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

    @precondition(lambda self: "decode" in self.phase.values())
    @rule(steps=st.integers(1, 5))
    def decode(self, steps: int) -> None:
        for _ in range(steps):
            ids = [r for r, p in self.phase.items() if p == "decode"]
            result = self.executor.decode(ids)
            for rid in result.refused:  # memory pressure: the request is retracted
                self._end(rid)
            shadow = self.shadow.decode(list(result.tokens))
            assert shadow.tokens == result.tokens, "HiSparse changed the answer"

    @precondition(lambda self: bool(self.phase))
    @rule(data=st.data())
    def end(self, data) -> None:
        """A finish (decode) or an abort (any state, staging included)."""
        self._end(data.draw(st.sampled_from(sorted(self.phase))))

    @rule()
    def all_copies_land(self) -> None:
        for stream in self.streams.streams.values():
            stream.synchronize()
        self._check_kv_against_shadow()

    # --- checks ---------------------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        # data=False: the data check would wait for copies and so hide a missing wait
        self.executor.check_integrity(data=False)
        assert set(self.executor.seqs) == set(self.phase)
        assert self.executor.staging() == [r for r, p in self.phase.items() if p == "staging"]

    def _check_kv_against_shadow(self) -> None:
        coord = self.executor.memory
        truth = self.shadow.memory
        layers = coord.num_layers
        for rid in self.phase:
            row, shadow_row = self.executor.seqs[rid].row, self.shadow.seqs[rid].row
            length = coord.length(row)
            positions = torch.arange(length)
            true_kv = truth.store.kv[:layers, truth.req_to_token[shadow_row, positions]]  # [L, n, dim]
            host_kv = coord.host.kv[:, coord.host.req_to_host[row, positions]]
            assert torch.equal(host_kv, true_kv), f"{rid}: a host copy differs from the position's KV"
            if self.phase[rid] == "decode":
                for layer in range(layers):
                    held = coord.buffers.tokens[layer, row].long()
                    cols = torch.nonzero((held >= 0) & (held < length)).reshape(-1)
                    device_rows = coord.device_kv[layer, coord.buffers.locs[row, cols]]
                    assert torch.equal(device_rows, true_kv[layer, held[cols]]), f"{rid}: stale device row"

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


TestExecutorMachine = ExecutorMachine.TestCase
TestExecutorMachine.settings = settings(max_examples=50, stateful_step_count=50, deadline=None)
