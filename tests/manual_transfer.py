"""A transfer stream whose copies land only when the test says so (or someone waits for them).

It models arbitrary transfer latency deterministically: a copy issued but not yet run leaves its
destination stale, so a missing wait (reading a host copy too early, overwriting a source column
before its backup ran, freeing slots under a copy) corrupts data visibly instead of by luck.
"""

from __future__ import annotations

import collections

import torch

from kernels.kv_copy import copy_rows


class _Handle:
    def __init__(self, stream: ManualTransferStream, seq: int) -> None:
        self._stream = stream
        self._seq = seq

    def query(self) -> bool:
        return self._seq < self._stream.done

    def wait(self) -> None:
        self._stream.run_until(self._seq + 1)

    def order_after(self) -> None:
        self.wait()  # the work that follows runs here and now: the copy must have run


class ManualTransferStream:
    """Copies queue up in order; ``run_until``/``wait``/``synchronize`` execute them."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self._pending: collections.deque = collections.deque()
        self.issued = 0
        self.done = 0

    def copy_rows(self, dst, dst_idx, src, src_idx) -> _Handle:
        self._pending.append((dst, dst_idx.clone(), src, src_idx.clone()))
        self.issued += 1
        return _Handle(self, self.issued - 1)

    def run_until(self, count: int) -> None:
        while self.done < min(count, self.issued):
            dst, dst_idx, src, src_idx = self._pending.popleft()
            if dst_idx.numel():
                copy_rows(dst, dst_idx, src, src_idx)
            self.done += 1

    def run_some(self, count: int) -> None:
        self.run_until(self.done + count)

    def synchronize(self) -> None:
        self.run_until(self.issued)

    def close(self) -> None:
        self.synchronize()


class ManualStreams:
    """The factory handed to the coordinator; keeps the streams it built by name."""

    def __init__(self) -> None:
        self.streams: dict[str, ManualTransferStream] = {}

    def __call__(self, name: str, device: torch.device) -> ManualTransferStream:
        stream = ManualTransferStream(name, device)
        self.streams[name] = stream
        return stream
