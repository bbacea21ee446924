"""The engine's actors: admission, prefill, staging, decode, and the executor actor that owns the device.

Each stage keeps its decisions in a plain synchronous core (testable without an event loop) and
moves messages in and out of it in a thin async loop.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream


def drain(inbox: MemoryObjectReceiveStream) -> Iterator[object]:
    """Every message already waiting in ``inbox``, without blocking."""
    while True:
        try:
            yield inbox.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream):
            return
