"""The executor actor's command thread: order, errors, log context, cancellation, ending."""

from __future__ import annotations

import contextvars
import itertools
import threading

import anyio
import anyio.lowlevel
import pytest

from pipeline.stages.executor_actor import CommandThread

FIELD = contextvars.ContextVar("field", default=None)


def test_commands_run_in_one_thread_in_order_and_return_their_values():
    seen: list[tuple[int, str]] = []

    def work(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * i

    async def main() -> list[int]:
        thread = CommandThread(name="cmd-test")
        try:
            return [await thread.run(work, i) for i in range(5)]
        finally:
            thread.close()

    assert anyio.run(main) == [0, 1, 4, 9, 16]
    assert [i for i, _ in seen] == list(range(5))
    assert {name for _, name in seen} == {"cmd-test"}  # not the event loop's thread, one thread throughout


def test_a_failing_command_raises_at_the_caller_and_the_thread_goes_on():
    def boom() -> None:
        raise ValueError("bad command")

    async def main() -> int:
        thread = CommandThread()
        try:
            with pytest.raises(ValueError, match="bad command"):
                await thread.run(boom)
            return await thread.run(lambda: 7)
        finally:
            thread.close()

    assert anyio.run(main) == 7


def test_a_command_sees_the_callers_context():
    async def main() -> object:
        thread = CommandThread()
        FIELD.set("request-7")
        try:
            return await thread.run(FIELD.get)
        finally:
            thread.close()

    assert anyio.run(main) == "request-7"


def test_cancelling_the_caller_waits_for_the_running_command():
    """A cancel scope around the call does not abandon a running command: the caller returns only
    after it ended (the executor's state is never left half-changed), and the cancellation then
    takes effect at the scope's next checkpoint. The scope is cancelled while the command is
    known to run, and the command ends only after that: no timing is assumed."""
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        release.wait(timeout=60)  # a hang guard only
        finished.set()
        return "done"

    async def main() -> tuple[object, bool, bool]:
        thread = CommandThread()
        got: list[object] = []
        try:
            async with anyio.create_task_group() as tg:
                with anyio.CancelScope() as scope:

                    async def cancel_while_running() -> None:
                        while not started.is_set():
                            await anyio.sleep(0.001)
                        scope.cancel()
                        release.set()

                    tg.start_soon(cancel_while_running)
                    got.append(await thread.run(slow))
                    await anyio.sleep_forever()  # the cancellation lands here
            return got[0] if got else None, finished.is_set(), scope.cancelled_caught
        finally:
            thread.close()

    value, ended, caught = anyio.run(main)
    assert value == "done" and ended and caught


def test_close_ends_the_thread_after_the_commands_given():
    async def main() -> threading.Thread:
        thread = CommandThread(name="cmd-close")
        await thread.run(lambda: None)
        worker = next(t for t in threading.enumerate() if t.name == "cmd-close")
        thread.close()
        return worker

    worker = anyio.run(main)
    worker.join(timeout=60)  # a hang guard, not a timing assertion
    assert not worker.is_alive()
    assert worker.daemon  # an engine left open never keeps a process from exiting


def test_inline_commands_run_on_the_loop_and_the_loop_gets_a_turn_after_each():
    """``inline``: each command runs in the caller's thread (the event loop's), a failure raises
    at the caller, and another task of the loop runs between two commands, even when the caller
    sends them back to back."""
    order: list[str] = []

    async def main() -> list[int]:
        thread = CommandThread(inline=True)
        loop_thread = threading.current_thread().name

        def work(i: int) -> int:
            assert threading.current_thread().name == loop_thread
            order.append(f"command {i}")
            return i + 1

        async def other() -> None:
            for i in range(3):
                order.append(f"other {i}")
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            with pytest.raises(ValueError, match="bad"):
                await thread.run(lambda: (_ for _ in ()).throw(ValueError("bad")))
            values = [await thread.run(work, i) for i in range(3)]
        thread.close()  # nothing to end
        return values

    assert anyio.run(main) == [1, 2, 3]
    commands = [i for i, what in enumerate(order) if what.startswith("command")]
    # between any two commands the other task ran at least once
    assert all(any(o.startswith("other") for o in order[a + 1 : b]) for a, b in itertools.pairwise(commands))


@pytest.mark.parametrize(("device", "tp", "setting", "thread"), [
    ("cpu", 1, None, True), ("cuda", 1, None, True), ("cpu", 2, None, True),
    ("cpu", 1, True, True), ("cpu", 1, False, False), ("cuda", 1, False, False),
])
def test_where_commands_run_follows_the_config(device, tp, setting, thread):
    from types import SimpleNamespace

    from pipeline.stages.executor_actor import runs_in_thread

    config = SimpleNamespace(device=device, tensor_parallel_size=tp, executor_thread=setting)
    assert runs_in_thread(config) is thread


def test_executor_thread_is_validated():
    from pipeline.config import EngineConfig
    from pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match="executor_thread"):
        EngineConfig(executor_thread=1)
    assert EngineConfig(executor_thread=False).executor_thread is False
