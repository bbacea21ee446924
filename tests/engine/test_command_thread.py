"""The executor actor's command thread: order, errors, log context, cancellation, ending."""

from __future__ import annotations

import contextvars
import threading
import time

import anyio
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
    takes effect at the scope's next checkpoint."""
    finished = threading.Event()

    def slow() -> str:
        time.sleep(0.2)
        finished.set()
        return "done"

    async def main() -> tuple[object, bool, bool]:
        thread = CommandThread()
        got: list[object] = []
        try:
            with anyio.move_on_after(0.02) as scope:
                got.append(await thread.run(slow))
                await anyio.sleep(1)  # the cancellation lands here
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
    worker.join(timeout=5)
    assert not worker.is_alive()
    assert worker.daemon  # an engine left open never keeps a process from exiting
