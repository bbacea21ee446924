"""Asynchronous KV transfers behind one small interface.

``stream.copy_rows(dst, dst_idx, src, src_idx)`` issues ``dst[:, dst_idx] = src[:, src_idx]`` (all
layers) and returns a handle at once; ``handle.query()`` never blocks, ``handle.wait()`` does.
Copies issued on one stream complete in issue order.

Two ways to wait for a copy, for two kinds of reader:

* ``wait()`` blocks the CPU: for a decision the CPU makes on the copy's completion (its slots freed
  and handed to another request, its error read);
* ``order_after()`` orders the work queued next on the current stream after the copy: for a reader
  (or an overwriter) that is device work. On CUDA it does not block the CPU (the current stream
  waits for the copy's event); where the device cannot order it (the CPU worker thread) it blocks as
  ``wait`` does. A failure it cannot see yet shows at a later ``query`` or ``wait`` of the same
  handle, so it still reaches the request the copy was for.

* On CUDA, a side stream: the copy waits for the work already queued on the current stream, runs on
  the side stream, and records an event that ``query`` polls. Between a device pool and pinned host
  memory the copy is the row-copy kernel addressing the host rows directly (``kernels.kv_copy``), so
  ``copy_rows`` returns before the copy has run, and the host rows it writes are there only once
  its event has completed: a CPU reader of them waits first (``wait``), a device reader is ordered
  after it (``order_after``). With pageable host memory, or once such a launch has failed, torch
  makes the copy and the CPU waits for it inside ``copy_rows``.
* On CPU, one worker thread runs the copies in order; ``query`` asks the future.

``docs/cuda.md`` lists every point of the decode path that still waits on the CPU, and why.

The index tensors come from the allocators and are checked by the coordinator's integrity checks, so
the copies skip the kernel wrapper's per-call index validation; on CPU its shape and dtype checks
too (the coordinator builds every argument; at batch 1 the checks cost as much as the copy).

Ordering rules the coordinator relies on: a request leaves staging only after its copy is known to
be done (``query``); before the newest column of a request is overwritten, the overwrite is ordered
after the backup that reads it (``order_after``); before a request's slots are freed, every copy
touching them is waited for (``wait``).

A failed copy is reported by its own handle only (``query`` and ``wait`` raise its error), never by
the stream: ``synchronize`` waits and raises nothing, so one failure never surfaces again in a
later request's wait. A copy that cannot even be issued raises from ``copy_rows``; the coordinator
turns that into a ``FailedHandle``, so both ways reach the request the copy was for.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Protocol

import torch

from kernels.kv_copy import copy_rows, copy_rows_unchecked


class TransferHandle(Protocol):
    def query(self) -> bool:
        """True once the copy has completed; never blocks."""
        ...

    def wait(self) -> None:
        """Block until the copy has completed; re-raises its error, if any."""
        ...

    def order_after(self) -> None:
        """Order the work queued next on the current stream after the copy, blocking the CPU only
        where the device cannot (see the module docstring); raises the copy's error when it is
        known already (a copy that failed as it was issued, or a CPU copy)."""
        ...


class TransferStream(Protocol):
    def copy_rows(
        self, dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
    ) -> TransferHandle: ...

    def synchronize(self) -> None:
        """Block until every copy issued has completed, failed ones included; raises nothing (each
        copy's handle reports its own failure)."""
        ...

    def close(self) -> None: ...


class DoneHandle:
    """A transfer that had nothing to do."""

    def query(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def order_after(self) -> None:
        return None


class FailedHandle:
    """A copy that failed as it was issued: reports ``error`` to whoever asks."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def query(self) -> bool:
        raise self.error

    def wait(self) -> None:
        raise self.error

    def order_after(self) -> None:
        raise self.error


class _FutureHandle:
    def __init__(self, future: cf.Future) -> None:
        self._future = future

    def query(self) -> bool:
        if not self._future.done():
            return False
        self._future.result()  # re-raise a failed copy here rather than losing it
        return True

    def wait(self) -> None:
        self._future.result()

    def order_after(self) -> None:
        self._future.result()  # the "device" is this process: nothing to order but by waiting


class ThreadTransferStream:
    """CPU transfers: one worker thread, copies in issue order.

    A copy of at most ``inline_bytes`` issued while nothing is in flight runs at once in the caller:
    handing rows to the worker costs more than copying them up to about a megabyte (one thread,
    float32 rows: 80 KB in 9 us and 800 KB in 53 us inline, against about 100 us for a round trip
    through the worker, which then also contends for the interpreter lock). A decode step's backup
    is a few KB; a page of every FULL row of a batch (dynamic residency), tens of KB. Issue order
    still holds, since nothing earlier is pending.
    """

    def __init__(self, name: str, inline_bytes: int = 1 << 20) -> None:
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hispec-{name}")
        self._last: cf.Future | None = None
        self.inline_bytes = inline_bytes

    def copy_rows(
        self, dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
    ) -> TransferHandle:
        if src_idx.numel() == 0:
            return DoneHandle()
        layers = src.shape[0] if src.dim() == 3 else 1
        nbytes = src_idx.numel() * layers * src.shape[-1] * src.element_size()
        if nbytes <= self.inline_bytes and (self._last is None or self._last.done()):
            copy_rows_unchecked(dst, dst_idx, src, src_idx)
            return DoneHandle()
        # the index tensors are private copies: the caller may reuse its own at once
        src_idx, dst_idx = src_idx.clone(), dst_idx.clone()
        self._last = self._pool.submit(copy_rows_unchecked, dst, dst_idx, src, src_idx)
        return _FutureHandle(self._last)

    def synchronize(self) -> None:
        last = self._last
        if last is not None:
            cf.wait([last])  # (its error, if any, is its handle's to report)
            self._last = None  # every copy issued has run: the next small one may run inline

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _EventHandle:  # pragma: no cover - needs a GPU
    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self._event = event
        self._device = device

    def query(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        self._event.synchronize()

    def order_after(self) -> None:
        # queued on the device: the CPU goes on at once (a failed copy shows at ``query``/``wait``)
        torch.cuda.current_stream(self._device).wait_event(self._event)


class CudaTransferStream:  # pragma: no cover - needs a GPU
    """GPU transfers on a side stream, ordered after the work queued when they were issued. A copy
    to or from the pinned host pool is device work on the side stream: nothing in ``copy_rows``
    waits for the device (the host slots go to the device through a pinned block of their own)."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self._stream = torch.cuda.Stream(device=device)

    def copy_rows(
        self, dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
    ) -> TransferHandle:
        if src_idx.numel() == 0:
            return DoneHandle()
        device = src.device if src.is_cuda else dst.device
        current = torch.cuda.current_stream(device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            copy_rows(dst, dst_idx, src, src_idx, validate=False)
            done = torch.cuda.Event()
            done.record(self._stream)
        for t in (src_idx, dst_idx):
            if t.is_cuda:
                t.record_stream(self._stream)
        return _EventHandle(done, device)

    def synchronize(self) -> None:
        self._stream.synchronize()

    def close(self) -> None:
        self.synchronize()


def make_transfer_stream(name: str, device: torch.device) -> TransferStream:
    """A side stream on CUDA, a worker thread on CPU."""
    if device.type == "cuda":
        return CudaTransferStream(name, device)
    return ThreadTransferStream(name)
