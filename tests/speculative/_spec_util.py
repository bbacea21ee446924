"""Helpers shared by the speculative tests."""

from __future__ import annotations

import contextlib
import io
import random
from collections.abc import Iterator

import structlog
import torch

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.logs import configure_logging
from pipeline.model.corpus import build_corpus
from pipeline.scheduler import SpecPolicy

BUNDLED_HOT = 64  # the bundled-model tests' HOT


def bundled_config(hisparse: bool, num_steps: int | None, *, draft_rows_on_host: bool = False,
                   draft_keys_on_host: bool = False) -> EngineConfig:
    """The bundled-model tests' config: float64, pages of 8, 3 request rows; speculation without
    the adaptive rules (every turn a round)."""
    return EngineConfig(
        dtype="float64",
        page_size=8,
        max_context_len=512,
        max_running_requests=3,
        device_pool_tokens=1024,
        hisparse=HiSparseConfig(device_buffer_size=BUNDLED_HOT, host_to_device_ratio=2,
                                draft_rows_on_host=draft_rows_on_host, draft_keys_on_host=draft_keys_on_host)
        if hisparse else None,
        speculative=SpeculativeConfig(num_steps=num_steps, max_batch_size=None, timed=False,
                                      min_accept_length=None, plain_tail=False, plain_while_prefilling=False)
        if num_steps else None,
    )


def bundled_prompts() -> list[list[int]]:
    """Three held-out prompts (40, HOT + 9 and 3 * HOT tokens), each starting after a newline."""
    held = build_corpus().held_out
    starts = torch.nonzero(held[:-400] == 10).reshape(-1)[[3, 50, 400]] + 1
    lens = (40, BUNDLED_HOT + 9, 3 * BUNDLED_HOT)
    return [held[int(s) : int(s) + n].tolist() for s, n in zip(starts, lens)]


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """Drop the lifecycle events (info) for the block, then restore whatever was configured.

    Unconfigured, structlog renders and prints every request event; for the hundreds of requests
    the statistical tests run, that is a good part of their time."""
    before = structlog.get_config()
    sink = configure_logging(level="warning", stream=io.StringIO())
    try:
        yield
    finally:
        sink.close()
        structlog.configure(**before)


def oracle_drafter(monkeypatch, executor, truth: dict[str, list[int]]) -> None:
    """Drafts = the true continuation (``truth[request_id]``: prompt and plain output), wrong at one
    pseudo-random position per round (or none), so every accept length occurs."""
    from pipeline.speculative import batch_round as round_module
    from pipeline.speculative.draft_state import DraftState

    real = round_module.draft_chain

    def chain(model, memory, rows, states, params, generators, num_steps):
        states = real(model, memory, rows, states, params, generators, num_steps)
        out = []
        for row, state in zip(rows, states):
            rid = executor._by_row[row]
            n = memory.length(row)
            full = truth[rid]
            drafts = [full[n + j] if n + j < len(full) else 0 for j in range(1, num_steps + 1)]
            wrong = random.Random(f"{rid}:{n}").randint(0, num_steps)  # num_steps = no error
            if wrong < num_steps:
                drafts[wrong] = (drafts[wrong] + 1) % 256
            out.append(DraftState(state.bonus, state.hidden, tuple(drafts), state.draft_probs))
        return out

    monkeypatch.setattr(round_module, "draft_chain", chain)


class RandomSwitch(SpecPolicy):
    """Adaptive speculation forced at random: each turn is a round or a plain step by a coin."""

    def __init__(self, seed: int, p_round: float = 0.5) -> None:
        super().__init__()
        self._coin = random.Random(seed)
        self._p = p_round
        self.rounds = self.plain = 0

    def speculate(self, batch_size: int, *, greedy: bool = False) -> bool:
        go = self._coin.random() < self._p
        self.rounds, self.plain = self.rounds + go, self.plain + (not go)
        return go
