"""The HiSparse machines in configurations their own files do not run.

* Near positions wanted (``near_margin > 0``, the ``near`` policy): the compiled decode path does not
  take them, so every decode step runs the torch path (the indexer's top-k and its margin, the
  swap-in rounds with the near hint, the sparse attention over the hot buffer, and over FULL rows'
  pages with dynamic residency).
* Dynamic residency with the demotions under memory pressure checked against the rule: an admission
  or a decode step demotes the decoding FULL rows whose demotion frees pages, the largest context
  first (ties: the lower row), and an admission is refused exactly when, even with all of them,
  it does not fit.
* Logical and host pools no larger than the device pool (``host_to_device_ratio=1``): decoding
  requests run out of locations, so decode steps refuse requests, and ``can_decode`` must foretell
  each refusal (the executor machine checks it); an admission succeeds exactly when the pools hold
  what it takes.

The machines' checks are unchanged: the tokens and every device and host row equal the all-resident
shadow's."""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis.stateful import precondition, rule
from shadow_model import machine_settings
from test_executor_machine import ExecutorMachine
from test_residency_machine import ResidencyMachine

from pipeline.hisparse.residency import GROWTH_PAGES
from pipeline.memory.interface import Layout

NEAR = {"policy": "near", "near_margin": 2}


def near(config):
    return attrs.evolve(config, hisparse=attrs.evolve(config.hisparse, **NEAR))


class NearExecutorMachine(ExecutorMachine):
    config = near(ExecutorMachine.config)


TestNearExecutorMachine = pytest.mark.proptest(NearExecutorMachine.TestCase)
TestNearExecutorMachine.settings = machine_settings(examples=25, steps=40)


class NearResidencyMachine(ResidencyMachine):
    config = near(ResidencyMachine.config)


TestNearResidencyMachine = pytest.mark.proptest(NearResidencyMachine.TestCase)
TestNearResidencyMachine.settings = machine_settings(examples=10, steps=40)


class TightExecutorMachine(ExecutorMachine):
    config = attrs.evolve(
        ExecutorMachine.config, hisparse=attrs.evolve(ExecutorMachine.config.hisparse, host_to_device_ratio=1)
    )

    @rule(length=st.integers(1, 40), seed=st.integers(0, 255))
    def admit(self, length: int, seed: int) -> None:
        """Admitted exactly when a row, locations, host pages, and device pages for the buffer and
        one chunk's rows are free (a prompt that fits to the last page included)."""
        coord, n = self.executor.memory, min(length, self.max_prompt)
        page, pages = coord.plan.page_size, -(-n // coord.plan.page_size)
        device = coord.buffers.capacity_for(n, speculative=False) // page + coord.plan.chunk_area(n) // page
        fits = (
            coord.rows.num_free > 0
            and min(coord.alloc.logical.num_free_pages, coord.host.allocator.num_free_pages) >= pages
            and coord.alloc.physical.num_free_pages >= device
        )
        before = len(self.phase)
        super().admit(length, seed)
        assert (len(self.phase) > before) == fits, f"admitted: {len(self.phase) > before}, fits: {fits}"

    @precondition(lambda self: "decode" in self.phase.values())
    @rule(steps=st.integers(8, 30))
    def decode_long(self, steps: int) -> None:
        """Many decode steps: the requests grow until the pools refuse some."""
        self.decode(steps)


TestTightExecutorMachine = pytest.mark.proptest(TightExecutorMachine.TestCase)
TestTightExecutorMachine.settings = machine_settings(examples=25, steps=40)


class DemotionOrderMachine(ResidencyMachine):
    def freeable(self) -> dict[int, int]:
        """Row -> the device pages its demotion frees, of every decoding FULL request whose demotion
        frees some, in the order the rule demotes them: the largest context first, ties the lower
        row."""
        coord, page = self.coord, self.coord.plan.page_size
        found = {}
        for rid in self.decoding(Layout.FULL):
            row = self.row(rid)
            covered = max(coord.alloc.req_to_token.covered_len(row), coord.length(row))
            keeps = coord.buffers.capacity_for(covered, speculative=False) // page
            freed = len(coord.alloc.physical.pages_of(row)) - keeps
            if freed > 0:
                found[row] = freed
        return {row: found[row] for row in sorted(found, key=lambda row: (-coord.length(row), row))}

    def fits(self, num_tokens: int) -> bool:
        """Whether a prompt of ``num_tokens`` fits by the rule: a row, locations and host pages for
        it, and device pages for it FULL, or for it HOT once every demotion that frees pages is made."""
        coord, page = self.coord, self.coord.plan.page_size
        pages = -(-num_tokens // page)
        if (
            not coord.rows.num_free
            or min(coord.alloc.logical.num_free_pages, coord.host.allocator.num_free_pages) < pages
        ):
            return False
        free = coord.alloc.physical.num_free_pages
        hot = coord.buffers.capacity_for(num_tokens, speculative=False) // page
        hot += coord.plan.chunk_area(num_tokens) // page
        return free >= pages + GROWTH_PAGES or free + sum(self.freeable().values()) >= hot

    def follow_demotions(self, what: str, *, fresh: int = 0) -> None:
        demoted = [
            self.row(rid)
            for rid, m in self.layouts.items()
            if m.layout is Layout.FULL and self.coord.layout(self.row(rid)) is Layout.HOT
        ]
        if demoted:
            order = list(self.expected)[: len(demoted)]
            assert sorted(demoted) == sorted(order), f"{what}demoted rows {demoted}, the rule says {order}"
        super().follow_demotions(what, fresh=fresh)

    @rule(length=st.integers(1, 40), seed=st.integers(0, 255))
    def admit(self, length: int, seed: int) -> None:
        self.expected = self.freeable()
        fits = self.fits(min(length, self.max_prompt))
        before = len(self.phase)
        super().admit(length, seed)
        admitted = len(self.phase) > before
        assert admitted == fits, f"admitted: {admitted}, the rule says {fits}"

    def decode(self, steps: int) -> None:
        for _ in range(steps):
            self.expected = self.freeable()
            super().decode(1)


TestDemotionOrderMachine = pytest.mark.proptest(DemotionOrderMachine.TestCase)
TestDemotionOrderMachine.settings = machine_settings(examples=15, steps=50)


class PageOneExecutorMachine(ExecutorMachine):
    """Pages of one token (the shadow's too): every location is its own page."""

    config = attrs.evolve(ExecutorMachine.config, page_size=1)
    shadow_config = attrs.evolve(ExecutorMachine.shadow_config, page_size=1)


TestPageOneExecutorMachine = pytest.mark.proptest(PageOneExecutorMachine.TestCase)
TestPageOneExecutorMachine.settings = machine_settings(examples=20, steps=40)
