"""Helpers of the engine tests: configurations, prompts, the synchronous oracle, gates."""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
import torch

from pipeline import Engine
from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.sampling import SamplingParams

PAGE = 8  # draft zone of 7 columns: num_steps up to 6
HOT = 16


def config(
    *,
    hisparse: bool = True,
    num_steps: int | None = None,
    device_pool_tokens: int = 1024,
    max_running_requests: int = 8,
    max_context_len: int = 320,
    ratio: int = 2,
) -> EngineConfig:
    return EngineConfig(
        dtype="float64",
        page_size=PAGE,
        max_context_len=max_context_len,
        max_running_requests=max_running_requests,
        device_pool_tokens=device_pool_tokens,
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=ratio) if hisparse else None,
        speculative=SpeculativeConfig(num_steps=num_steps, max_batch_size=None, timed=False,
                                       min_accept_length=None, plain_tail=False, plain_while_prefilling=False)
        if num_steps else None,
    )


def make_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def driver_outputs(
    model, cfg: EngineConfig, prompts: list[list[int]], params: list[SamplingParams], ids: list[str]
) -> dict[str, list[int]]:
    """The synchronous driver's output tokens for the same requests (the oracle)."""
    executor = Executor(cfg, model=model)
    driver = SyncDriver(executor)
    reqs = [driver.submit(p, sp, request_id=rid) for p, sp, rid in zip(prompts, params, ids)]
    driver.run()
    executor.close()
    return {r.request_id: list(r.output_ids) for r in reqs}


class Gate:
    """Holds the first call of an executor method whose arguments match, until ``open()``.

    The call blocks in the executor's worker thread; the event loop keeps running, so the test can
    act while a request sits in the state that command puts it in. (The engine runs its commands
    in the executor's thread by default; ``install`` makes sure of it, since on the event loop
    (``executor_thread=False``) a gate would block the test too.)
    """

    def __init__(self, match: Callable[..., bool] = lambda *args: True) -> None:
        self.match = match
        self.entered = threading.Event()
        self._open = threading.Event()
        self._used = False

    def wrap(self, fn: Callable) -> Callable:
        def gated(*args, **kwargs):
            if not self._used and self.match(*args):
                self._used = True
                self.entered.set()
                self._open.wait()
            return fn(*args, **kwargs)

        return gated

    def install(self, engine: Engine, method: str) -> Gate:
        engine._pipe.actor._thread.inline = False
        setattr(engine.executor, method, self.wrap(getattr(engine.executor, method)))
        return self

    def open(self) -> None:
        self._open.set()

    async def wait_entered(self) -> None:
        with anyio.fail_after(60):  # a hang guard, not a timing assertion
            while not self.entered.is_set():
                await anyio.sleep(0.002)


class Hold:
    """Holds a stage's first executor command of one of ``types`` (and matching ``match``) on the
    event loop, before it is sent, until ``open()``.

    Unlike a ``Gate`` the executor stays free: the other stages go on while this one waits, so the
    requests it owns stay in their state (a decode stage held before its ``Decode`` keeps its batch
    in DECODE and the requests that staged meanwhile in READY, since it joins them between steps).
    """

    def __init__(self, *types: type, match: Callable[[object], bool] = lambda command: True) -> None:
        self.types = types
        self.match = match
        self.entered = threading.Event()
        self._open = anyio.Event()
        self._used = False

    def install(self, stage) -> Hold:
        """Wrap ``stage``'s executor client (``stage._client.call``)."""
        client = stage._client
        real = client.call

        async def held(command):
            if not self._used and isinstance(command, self.types) and self.match(command):
                self._used = True
                self.entered.set()
                client.pause()  # it waits for the test, not for the executor: nobody waits for it
                await self._open.wait()
                client.busy()
            return await real(command)

        client.call = held
        return self

    def open(self) -> None:
        self._open.set()

    wait_entered = Gate.wait_entered


async def until(predicate: Callable[[], bool]) -> None:
    """Yield to the engine until ``predicate()`` holds (hang guard: 60 s)."""
    with anyio.fail_after(60):
        while not predicate():
            await anyio.sleep(0.002)


def live_request(engine, request_id: str):
    return engine._registry.live.get(request_id)
