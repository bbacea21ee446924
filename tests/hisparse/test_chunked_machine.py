"""Stateful property test of the scheduler with chunked prefill, HiSparse and memory pressure.

Requests of prompts from a few tokens to several chunks (and past HOT) arrive while others are
prefilled chunk by chunk or decode (a chunk in the decode step's forward: mixed steps); scheduler
steps, aborts in any state (applied at once, or asked for and applied at the owning part's next
turn) and retractions (the pools are small: decode runs out of room) interleave. After every step
the synchronous driver checks every invariant (``check=True``: the core's ownership, the executor's
rows, each row's residency against its request's state, the memory's I1-I8); once everything has
ended every pool is back at its initial count, and every request that finished has the tokens the
same prompt gets alone from the all-resident engine with whole-prompt prefill. Nothing is injected, so
a forward that raises fails the test rather than being bisected (``forward_unisolated``: bisection
would rerun a failed mixed forward as plain ones and hide it), and the tables' mirrors are distinct
tensors, so a missed mirror update shows.
"""

from __future__ import annotations

from unittest import mock

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import event
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule
from shadow_model import machine_settings

from pipeline import executor as executor_module
from pipeline.config import EngineConfig, HiSparseConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.sampling import SamplingParams

from shadowed_machine import check_counters, forward_unisolated
from tiny_models import build_tiny_model

MODEL = build_tiny_model()
LENGTHS = (3, 9, 17, 30, 45)
PARAMS = SamplingParams(max_new_tokens=18, ignore_eos=True)
CONFIG = EngineConfig(
    dtype="float64",
    page_size=4,
    max_context_len=64,
    max_running_requests=4,
    device_pool_tokens=64,  # a buffer of 12 columns and a chunk's rows per request
    chunked_prefill_tokens=7,
    hisparse=HiSparseConfig(device_buffer_size=8, host_to_device_ratio=2),  # 128 locations
    speculative=None,
)
REFERENCE = EngineConfig(
    dtype="float64",
    page_size=4,
    max_context_len=64,
    max_running_requests=1,
    device_pool_tokens=128,
    chunked_prefill_tokens=None,
    hisparse=None,
    speculative=None,
)
_alone: dict[tuple[int, ...], list[int]] = {}


def alone(prompt: tuple[int, ...]) -> list[int]:
    """The tokens ``prompt`` gets by itself, all resident, prefilled whole."""
    if prompt not in _alone:
        executor = Executor(REFERENCE, model=MODEL)
        (req,) = SyncDriver(executor).generate([list(prompt)], PARAMS)
        executor.close()
        _alone[prompt] = list(req.output_ids)
    return _alone[prompt]


def prompt_of(length: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 256, (length,), generator=gen).tolist())


class ChunkedSchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.unisolated = mock.patch.object(executor_module, "isolate", forward_unisolated)
        self.unisolated.start()  # (stopped by ``teardown``, or here if the machine cannot start)
        try:
            self.executor = Executor(CONFIG, model=MODEL)
        except BaseException:
            self.unisolated.stop()
            raise
        # distinct mirrors: the coordinator's check compares them with the tables, so a missed update shows
        self.executor.memory.mirror_tables(separate=True)
        self.initial = self.executor.pool_counts()
        self.driver = SyncDriver(self.executor, check=True)
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.counters: dict[str, list] | None = None  # the HiSparse counters at the last check

    @rule(length=st.sampled_from(LENGTHS), seed=st.integers(0, 2))
    def submit(self, length: int, seed: int) -> None:
        req = self.driver.submit(list(prompt_of(length, seed)), PARAMS)
        self.prompts[req.request_id] = req.prompt_ids

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self.driver.step()
        self.counters = check_counters(self.executor, self.counters)

    @precondition(lambda self: any(not r.is_finished for r in self.driver.requests.values()))
    @rule(data=st.data())
    def abort(self, data) -> None:
        live = sorted(rid for rid, r in self.driver.requests.items() if not r.is_finished)
        self.driver.abort(data.draw(st.sampled_from(live)))
        self.driver.check_integrity()

    @precondition(lambda self: any(not r.is_finished for r in self.driver.requests.values()))
    @rule(data=st.data())
    def ask_abort(self, data) -> None:
        """An abort asked for as the engine asks: the owning part applies it at its next turn (a
        mixed step's parts included)."""
        live = sorted(rid for rid, r in self.driver.requests.items() if not r.is_finished)
        self.driver.core.aborts.add(data.draw(st.sampled_from(live)))

    def teardown(self) -> None:
        try:
            self._finish()
        finally:
            self.unisolated.stop()

    def _finish(self) -> None:
        self.driver.run()
        reqs = self.driver.requests.values()
        mixed = self.executor.stats()["prefill"]["mixed_forwards"]
        event("a chunk shared a decode step's forward" if mixed else "no mixed step")
        event("a request was retracted" if any(r.metrics.num_retractions for r in reqs) else "no retraction")
        event(
            "a prompt took several chunks"
            if any(len(p) > 7 for p in self.prompts.values())
            else "one chunk each"
        )
        assert self.executor.pool_counts() == self.initial, "a pool did not return to its initial count"
        for rid, req in self.driver.requests.items():
            if req.finish_reason == "length":
                assert list(req.output_ids) == alone(self.prompts[rid]), (
                    f"{rid}: chunked prefill changed the answer"
                )
            else:
                assert req.finish_reason == "abort", (rid, req.finish_reason, req.error)
        self.executor.close()


TestChunkedSchedulerMachine = pytest.mark.proptest(ChunkedSchedulerMachine.TestCase)
TestChunkedSchedulerMachine.settings = machine_settings(examples=25, steps=30)
