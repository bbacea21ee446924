"""The contracts between the core, the executors and the memory, checked without duck typing.

* both executors (local and tensor-parallel) implement ``CommandExecutor``: every member, with
  parameters the protocol's callers may pass;
* the core forms a mixed step from a ``Decode`` and a ``Prefill`` only, and splits its outcome
  into each part's (a step that failed as a whole fails both);
* both memories report their transfer totals (zeros for resident memory), which a command's
  figures are the difference of.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from _engine_util import config

from kernels.swap_in_result import SwapInResult
from pipeline.distributed.executor import DistributedExecutor
from pipeline.executor import Executor
from pipeline.executor_interface import CommandExecutor
from pipeline.memory.interface import TransferTotals
from pipeline.messages import (
    NO_SWAPS,
    CollectReady,
    Decode,
    Mixed,
    MixedResult,
    Outcome,
    Prefill,
    PrefillChunk,
    PrefillResult,
    Release,
    StepResult,
    SwapCounts,
)
from pipeline.scheduler import mix, split

DECODE = Decode(("a", "b"))
PREFILL = Prefill((PrefillChunk("c", 0, 8),))


def protocol_members() -> dict[str, object]:
    return {
        name: value for name, value in vars(CommandExecutor).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


@pytest.mark.parametrize("cls", [Executor, DistributedExecutor])
def test_both_executors_have_every_member_of_the_protocol(cls):
    """Methods with the protocol's parameters; the attributes as properties or set in ``__init__``
    (the instance check below and the type checker see those)."""
    set_in_init = cls.__init__.__code__.co_names  # (the attribute names ``__init__`` touches)
    for name, member in protocol_members().items():
        if isinstance(member, property):
            assert isinstance(getattr(cls, name, None), property) or name in set_in_init, name
            continue
        have = inspect.signature(getattr(cls, name)).parameters
        for param in inspect.signature(member).parameters.values():
            assert param.name in have, f"{cls.__name__}.{name} lacks {param.name!r}"
            assert have[param.name].kind is param.kind, f"{cls.__name__}.{name}: {param.name!r} kind"


def test_a_local_executor_is_a_command_executor(tiny_model):
    executor = Executor(config(), model=tiny_model)
    try:
        assert isinstance(executor, CommandExecutor)
        assert executor.lost is None
    finally:
        executor.close()


@pytest.mark.parametrize("a, b", [(DECODE, PREFILL), (PREFILL, DECODE)])
def test_a_decode_and_a_prefill_mix_in_either_order(a, b):
    assert mix(a, b) == Mixed(DECODE, PREFILL)


@pytest.mark.parametrize(
    "a, b",
    [(DECODE, DECODE), (PREFILL, PREFILL), (DECODE, Release(("a",))), (CollectReady(("c",)), PREFILL)],
)
def test_no_other_pair_mixes(a, b):
    assert mix(a, b) is None
    assert mix(b, a) is None


def test_each_part_gets_its_own_outcome():
    step = Outcome(StepResult({"a": (1,), "b": (2,)}), SwapCounts(3, 1, 64), True, None, 0.5, mixed=True)
    chunk = Outcome(PrefillResult({}), NO_SWAPS, True, None, 0.5, mixed=True)
    assert split(Outcome(MixedResult(step, chunk), SwapCounts(3, 1, 64), True, None, 0.5)) == (step, chunk)


def test_a_mixed_step_that_failed_as_a_whole_fails_both_parts():
    decode, prefill = split(Outcome(None, NO_SWAPS, True, "RuntimeError: boom", 0.25))
    assert decode == prefill
    assert decode.error == "RuntimeError: boom" and decode.result is None and decode.mixed


def test_resident_memory_moves_nothing(tiny_model):
    executor = Executor(config(hisparse=False), model=tiny_model)
    try:
        assert executor.memory.transfer_totals() == TransferTotals((0, 0, 0), (0, 0, 0))
    finally:
        executor.close()


def test_hisparse_totals_sum_the_layer_counters(tiny_model):
    executor = Executor(config(), model=tiny_model)
    try:
        counters = executor.memory.counters
        assert executor.memory.transfer_totals() == TransferTotals((0, 0, 0), (0, 0, 0))
        ones = torch.ones(1, 1, dtype=torch.int32)
        for layer, (hits, misses, moved) in ((0, (5, 0, 128)), (-1, (0, 2, 0))):
            counters.add_swap_in(layer, SwapInResult(ones, ones, 1, totals=(hits, misses, 0, moved)))
        counters.add_prefill_loads(-1, 4, 0, 192)
        counters.add_prefill_loads(0, 0, 3, 0)
        assert executor.memory.transfer_totals() == TransferTotals((5, 2, 128), (4, 3, 192))
    finally:
        executor.close()


def test_tensor_parallel_outcomes_keep_their_residency_events():
    """Every rank reports the same Demoted / Promoted events; the merged outcome (and a mixed step's
    decode part) carries them, and ranks that disagree are a divergence."""
    from pipeline.distributed.executor import RanksDiverged, merge
    from statemachines.request import Demoted, Promoted

    moves = (("a", Demoted(4096)), ("b", Promoted(8192)))
    step = StepResult({"a": (1,), "b": (2,)})
    one = Outcome(step, NO_SWAPS, True, None, 0.0, residency=moves)
    assert merge(DECODE, [one, one]).residency == moves
    mixed = Mixed(DECODE, PREFILL)
    prefill = Outcome(PrefillResult({}, {}), NO_SWAPS, True, None, 0.0)
    both = Outcome(MixedResult(one, prefill), NO_SWAPS, True, None, 0.0)
    merged = merge(mixed, [both, both])
    assert merged.result_as(MixedResult).decode.residency == moves
    other = Outcome(step, NO_SWAPS, True, None, 0.0, residency=moves[:1])
    with pytest.raises(RanksDiverged, match="moved"):
        merge(DECODE, [one, other])
