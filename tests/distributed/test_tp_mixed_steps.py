"""Mixed steps under tensor parallelism: rank 0 forwards the ``Mixed`` command like any other, every
rank's own executor runs the decode step and the prefill chunk as one forward, and the merged
outcome answers each part. The tokens are those of one process without mixed steps, and the ranks
ran mixed forwards (HiSparse on, prompts chunked past the hot region).
"""

from __future__ import annotations

import attrs
import pytest
from _engine_util import config, make_prompts

from pipeline.distributed.executor import DistributedExecutor
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.executor_interface import CommandExecutor
from pipeline.sampling import SamplingParams
from statemachines.request import State

RUNNING = (5, 16, 9)  # prompt lengths of the requests decoding when the long ones arrive
LONG = (40, 57)  # prefilled in chunks while the others decode
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


def serve(executor: CommandExecutor) -> dict[str, list[int]]:
    """The running requests reach decode, then the long prompts arrive (checks after every step)."""
    driver = SyncDriver(executor, check=True)
    prompts = make_prompts([*RUNNING, *LONG], seed=21)
    reqs = [driver.submit(p, PARAMS, request_id=f"run-{i}") for i, p in enumerate(prompts[: len(RUNNING)])]
    while not all(r.state is State.DECODE or r.is_finished for r in reqs):
        driver.step()
    reqs += [driver.submit(p, PARAMS, request_id=f"long-{i}") for i, p in enumerate(prompts[len(RUNNING) :])]
    driver.run()
    return {r.request_id: list(r.output_ids) for r in reqs}


@pytest.mark.slow
def test_mixed_steps_under_tp_give_the_tokens_of_one_process_without_them(tiny_model):
    cfg = attrs.evolve(config(), chunked_prefill_tokens=7)
    alone = Executor(attrs.evolve(cfg, mixed_steps=False), model=tiny_model)
    try:
        expected = serve(alone)
        assert alone.stats()["prefill"]["mixed_forwards"] == 0
    finally:
        alone.close()
    executor = DistributedExecutor(attrs.evolve(cfg, tensor_parallel_size=2), model=tiny_model)
    try:
        assert isinstance(executor, CommandExecutor)
        initial = executor.pool_counts()
        assert serve(executor) == expected
        assert executor.stats()["prefill"]["mixed_forwards"] > 0  # rank 0's; every rank ran the same
        assert executor.pool_counts() == initial  # every rank's pools (rank1.* keys)
    finally:
        executor.close()
