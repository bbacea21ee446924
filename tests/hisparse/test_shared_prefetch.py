"""A shared indexer layer's swap-in issued with the full layer before it (``prefetch_shared``).

A GLM-5 "shared" layer reuses the previous full layer's top-k, so its swap-in (its own buffer, LRU
and pool) can be issued as soon as that top-k exists: on CUDA on a load stream, beside the full
layer's attention and MLP. On a CPU it runs in order, which these tests force on to check what
does not depend on the device: the same tokens as all-resident and as without it, the same
transfer counts, and the call really made while the full layer is still attending.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pipeline import startup
from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.hisparse.backend import HiSparseBackend
from pipeline.hisparse.coordinator import HiSparseCoordinator
from pipeline.sampling import SamplingParams

from tiny_models import build_tiny_model

LAYERS = ("full", "shared", "shared", "full")
PROMPT_LENS = (6, 23, 41, 70)  # below HOT to several times it
NEW_TOKENS = 12


def engine_config(hisparse: bool, num_steps: int | None) -> EngineConfig:
    return EngineConfig(
        dtype="float64",
        page_size=4,
        max_context_len=128,
        max_running_requests=4,
        device_pool_tokens=512,
        hisparse=HiSparseConfig(device_buffer_size=16, host_to_device_ratio=2) if hisparse else None,
        speculative=SpeculativeConfig(num_steps=num_steps, max_batch_size=None, timed=False)
        if num_steps
        else None,
    )


@pytest.fixture(scope="module")
def shared_model():
    model = build_tiny_model(
        model_type="glm_moe_dsa", num_hidden_layers=4, indexer_types=list(LAYERS), first_k_dense_replace=1
    )
    assert model.cfg.indexer_types == LAYERS
    return model


def serve(model, cfg: EngineConfig, monkeypatch, prefetch: bool | None, events: list | None = None):
    """Each request's tokens, the HiSparse counters, and (``events``) the order of the decode
    backends' layer calls and the coordinator's swap-ins."""
    with monkeypatch.context() as patch:
        made = functools.partial(HiSparseCoordinator, prefetch_shared=prefetch)
        patch.setattr(startup, "HiSparseCoordinator", made)
        if events is not None:
            attend, swap_in = HiSparseBackend.attend, HiSparseCoordinator.swap_in

            def logged_attend(self, inputs):
                if self.steps:
                    events.append(("enter", inputs.layer, self.steps))
                out = attend(self, inputs)
                if self.steps:
                    events.append(("exit", inputs.layer, self.steps))
                return out

            def logged_swap_in(self, layer, *args, **kwargs):
                events.append(("swap", layer))
                return swap_in(self, layer, *args, **kwargs)

            patch.setattr(HiSparseBackend, "attend", logged_attend)
            patch.setattr(HiSparseCoordinator, "swap_in", logged_swap_in)
        executor = Executor(cfg, model=model)
        initial = executor.pool_counts()
        gen = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
        reqs = SyncDriver(executor, check=True).generate(
            prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        )
        counters = executor.memory.counters_dict()
        assert executor.pool_counts() == initial
        executor.close()
    return [list(r.output_ids) for r in reqs], counters


@pytest.mark.parametrize("num_steps", [None, 2], ids=["plain", "speculative"])
def test_prefetched_swap_ins_change_nothing(shared_model, monkeypatch, num_steps):
    resident, _ = serve(shared_model, engine_config(False, num_steps), monkeypatch, None)
    without, counts = serve(shared_model, engine_config(True, num_steps), monkeypatch, False)
    events: list = []
    ahead, counts_ahead = serve(shared_model, engine_config(True, num_steps), monkeypatch, True, events)
    assert ahead == without == resident
    assert counts_ahead == counts and sum(counts["misses"]) > 0  # (swap-ins that load rows)
    # every decode (and verify) forward: layer 0 issued the swap-ins of layers 1 and 2 while it
    # attended; layer 3 reuses nothing
    windows = windows_of(events, 0)
    assert {steps for steps, _ in windows} == ({1} if num_steps is None else {1, num_steps + 1})
    for _, window in windows:
        assert ("swap", 1) in window and ("swap", 2) in window and ("swap", 3) not in window


def windows_of(events: list, layer: int) -> list[tuple[int, list]]:
    """(tokens per request, the events inside) of each call of ``layer``'s attention."""
    out, start = [], None
    for i, event in enumerate(events):
        if event[:2] == ("enter", layer):
            start = i
        elif event[:2] == ("exit", layer):
            out.append((event[2], events[start + 1 : i]))
    return out


def test_without_prefetch_the_shared_layer_swaps_in_itself(shared_model, monkeypatch):
    events: list = []
    serve(shared_model, engine_config(True, None), monkeypatch, False, events)
    assert all(("swap", 1) not in window for _, window in windows_of(events, 0))
    assert all(("swap", 1) in window for _, window in windows_of(events, 1))


def test_which_layers_prefetch(shared_model):
    """Each full layer issues the shared layers that follow it, up to the next full layer; none
    without ``prefetch_shared`` (the default off a CUDA device)."""
    plan = startup.plan_engine(engine_config(True, None), shared_model.cfg, log_choices=False).memory
    make = functools.partial(HiSparseCoordinator, plan=plan, num_layers=6, row_dim=8, index_dim=4)
    coord = make(shared_layers=(1, 2, 4), prefetch_shared=True)
    assert [coord.shared_after(layer) for layer in range(6)] == [(1, 2), (), (), (4,), (), ()]
    assert all(make(shared_layers=(1, 2, 4)).shared_after(layer) == () for layer in range(6))
