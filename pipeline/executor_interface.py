"""The executor interface the drivers, the stages and the engine are written against.

Two implementations satisfy it: ``Executor`` (``pipeline/executor.py``: one process owns the model
and the KV memory) and ``DistributedExecutor`` (``pipeline/distributed/executor.py``: rank 0 of a
tensor-parallel group, which forwards every command to the other ranks' own ``Executor`` and merges
their outcomes). Whoever holds one sends it commands (``pipeline/messages.py``) one at a time through
``run``; every other verb is for start-up, shutdown, checks and figures.

Nothing here is thread-safe: one caller at a time (the executor actor while an engine runs, the
synchronous driver, or a test). Request ids are the caller's; a request is known to the executor
from the ``Admit`` that takes it until the ``Release`` that gives it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pipeline.config import EngineConfig
    from pipeline.messages import Command, Outcome
    from pipeline.model.tokenizer import Tokenizer
    from pipeline.sampling import SamplingParams
    from pipeline.startup import EnginePlan
    from statemachines.request import State


@runtime_checkable
class CommandExecutor(Protocol):
    """What the drivers, stages and engine may ask of an executor."""

    @property
    def config(self) -> EngineConfig:
        """The configuration as the user wrote it (read only)."""
        ...

    @property
    def plan(self) -> EnginePlan:
        """What start-up resolved and derived from the configuration (``pipeline.startup``)."""
        ...

    @property
    def num_steps(self) -> int:
        """Draft tokens per speculative round; 0: plain decoding."""
        ...

    @property
    def speculative(self) -> bool:
        """Whether the configuration speculates (``num_steps > 0``)."""
        ...

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (the requests' detokenizers read it)."""
        ...

    @property
    def seqs(self) -> Mapping[str, object]:
        """Request id -> what the executor holds for it: the requests holding memory (read only)."""
        ...

    @property
    def lost(self) -> str | None:
        """Why the executor can no longer run commands (a tensor-parallel rank went away), or None."""
        ...

    def validate(self, token_ids: list[int] | tuple[int, ...], params: SamplingParams) -> None:
        """Request-level checks against the configuration and the model; raises ``RequestError``.
        Changes nothing."""
        ...

    def run(self, command: Command, *, idle: bool = True) -> Outcome:
        """Run one command; what it mutates is the command's (``pipeline/messages.py``): memory, the
        requests it names, the figures. ``idle``: nothing else waits for the device (``CollectReady``
        may then wait for the copies in flight). Never raises for a command that fails: its error
        comes back in ``Outcome.error`` (the distributed executor raises when a rank is lost)."""
        ...

    def wait_staging(self) -> None:
        """Block until every staging copy in flight has landed (changes no request's state)."""
        ...

    def release(self, request_id: str, *, keep_sampling_state: bool = False) -> None:
        """Give back everything ``request_id`` holds, in whatever state it is (shutdown's path, when
        no command may run any more). Idempotent."""
        ...

    def check_integrity(self, *, data: bool = True, states: dict[str, State] | None = None) -> None:
        """Assert the memory's invariants and (``states``: each live request's lifecycle state) each
        request's memory against its state. Changes nothing."""
        ...

    def stats(self) -> dict[str, object]:
        """Pools, transfer, speculative and prefill figures (a fresh dict; changes nothing)."""
        ...

    def pool_counts(self) -> dict[str, int]:
        """Free count of every pool: equal to the initial counts when nothing is live. Finishes a
        release that faults interrupted first."""
        ...

    def close(self) -> None:
        """Release every request, stop the copies and (tensor parallelism) the other ranks."""
        ...
