"""One device arena under dynamic residency: at one device budget, a dynamic engine runs whole
contexts on the device for as many requests as an all-resident engine seats, while it seats what a
HiSparse engine seats (docs/residency.md, "The memory plan").

Before the arena the two device pools were fixed at start-up: the indexer keys of every HiSparse seat
held device memory whether the seat was used or not, and at a load all-resident held, part of the
requests ran through hot buffers. These tests fail if the keys' memory goes back to being a pool of
its own (fewer FULL rows than all-resident seats) or if the arena loses HiSparse's seats.
"""

from __future__ import annotations

import torch
from speculative._spec_util import quiet_logs

from pipeline.config import EngineConfig, HiSparseConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.memory.interface import Layout, Residency
from pipeline.sampling import SamplingParams

PAGE = 4
HOT = 16
PROMPT, NEW = 60, 60
CONTEXT = PROMPT + NEW
# bytes of the KV memory layer: all-resident seats a few requests of CONTEXT. The arena also pays
# for HiSparse's request rows (their tables and buffer bookkeeping) and loses a little to whole
# frames, so at a budget that all-resident's pool fills exactly a dynamic engine can be a few
# positions short of the last request (its growth then demotes one); this budget leaves both room.
BUDGET = 450_000


def config(residency: str | None) -> EngineConfig:
    return EngineConfig(
        dtype="float64",
        page_size=PAGE,
        max_context_len=CONTEXT,
        device_memory_bytes=BUDGET,
        hisparse=None
        if residency is None
        else HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=4, residency=residency),
        speculative=None,
        chunked_prefill_tokens=None,
        prefix_cache=False,
    )


def prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (PROMPT,), generator=gen).tolist() for _ in range(count)]


def serve(model, cfg: EngineConfig, count: int) -> tuple[list[list[int]], int, int, dict | None, int]:
    """``count`` requests submitted together on the synchronous driver: (their tokens, the most
    requests decoding FULL at once, the most admitted at once, the residency figures, the seats the
    plan gives)."""
    executor = Executor(cfg, model=model)
    seats = executor.plan.device.seats(CONTEXT).running
    initial = executor.pool_counts()
    driver = SyncDriver(executor, check=True)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    reqs = [driver.submit(p, params, f"req-{i}") for i, p in enumerate(prompts(count))]
    most_full = most_decoding = 0
    with quiet_logs():
        while driver.step():
            memory = executor.memory
            full = sum(
                1
                for seq in executor.seqs.values()
                if memory.residency(seq.row) is Residency.RESIDENT
                and getattr(memory, "layout", lambda row: None)(seq.row) is Layout.FULL
            )
            most_full = max(most_full, full)
            most_decoding = max(most_decoding, len(executor.seqs))
    assert executor.pool_counts() == initial, "a pool is not back at its initial free count"
    figures = executor.stats().get("residency")
    executor.close()
    return [r.output_ids for r in reqs], most_full, most_decoding, figures, seats


def test_at_one_budget_dynamic_runs_full_every_request_all_resident_seats(tiny_model):
    resident = Executor(config(None), model=tiny_model)
    held = resident.plan.device.seats(CONTEXT).running
    resident.close()
    assert held >= 2, f"the budget must seat a few resident requests, seats {held}"
    want, _, _, _, _ = serve(tiny_model, config(None), held)
    got, most_full, _, figures, seats = serve(tiny_model, config("dynamic"), held)
    assert seats > held, (seats, held)
    assert got == want
    assert most_full == held, f"{most_full} requests FULL at once, all-resident seats {held}"
    assert figures is not None and figures["demotions"] == 0, figures


def test_at_one_budget_dynamic_seats_what_hisparse_seats(tiny_model):
    resident = Executor(config(None), model=tiny_model)
    resident_seats = resident.plan.device.seats(CONTEXT).running
    resident.close()
    _, _, most_hisparse, _, hisparse_seats = serve(tiny_model, config("always"), 10)
    assert hisparse_seats > resident_seats + 1, (hisparse_seats, resident_seats)
    want, _, most_resident, _, _ = serve(tiny_model, config(None), hisparse_seats)
    got, most_full, most_live, figures, seats = serve(tiny_model, config("dynamic"), hisparse_seats)
    assert seats == hisparse_seats
    assert got == want
    # every one admitted at once, as HiSparse does (all-resident could not): FULL while their short
    # contexts fit, demoted as they grow past what the arena holds whole
    seated = (most_live, most_hisparse, most_resident)
    assert most_live == min(most_hisparse, hisparse_seats) > most_resident, seated
    assert most_full > resident_seats, (most_full, resident_seats)
    assert figures is not None and figures["demotions"] >= most_live - resident_seats, figures


def test_the_executor_tells_the_memory_how_far_each_request_can_grow(tiny_model):
    """``admit``'s ``final`` hint (what promotions keep room for): the prompt, ``max_new_tokens``
    and a round's drafts."""
    executor = Executor(config("dynamic"), model=tiny_model)
    driver = SyncDriver(executor, check=True)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    driver.submit(prompts(1)[0], params, "req-0")
    with quiet_logs():
        driver.step()
    (seq,) = executor.seqs.values()
    assert executor.memory._mem[seq.row].final == PROMPT + NEW + executor.draft_tokens
    with quiet_logs():
        while driver.step():
            pass
    executor.close()
