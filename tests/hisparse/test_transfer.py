"""The CPU transfer stream: copies complete in issue order, query never blocks, errors surface."""

from __future__ import annotations

import threading

import pytest
import torch

from pipeline.hisparse.transfer import DoneHandle, FailedHandle, ThreadTransferStream


def test_copies_land_in_order_and_report_done():
    stream = ThreadTransferStream("t", inline_bytes=0)
    src = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)
    dst = torch.zeros(2, 4, 3)
    first = stream.copy_rows(dst, torch.tensor([0, 1]), src, torch.tensor([4, 5]))
    second = stream.copy_rows(dst, torch.tensor([1]), src, torch.tensor([2]))  # overwrites row 1 after
    second.wait()
    assert first.query() and second.query()
    assert torch.equal(dst[:, 0], src[:, 4]) and torch.equal(dst[:, 1], src[:, 2])
    stream.close()


def test_query_does_not_block_while_a_copy_is_in_flight():
    stream = ThreadTransferStream("t", inline_bytes=0)
    gate = threading.Event()
    stream._pool.submit(gate.wait)  # occupy the worker
    handle = stream.copy_rows(torch.zeros(1, 2, 2), torch.tensor([0]), torch.ones(1, 2, 2), torch.tensor([1]))
    assert handle.query() is False  # returns at once
    gate.set()
    handle.wait()
    assert handle.query() is True
    stream.close()


@pytest.mark.parametrize("inline_bytes", [0, 1 << 16])
def test_a_failed_copy_is_reported_not_lost(inline_bytes):
    """Raised when the copy is issued (inline) or when it is waited for (on the worker)."""
    stream = ThreadTransferStream("t", inline_bytes=inline_bytes)
    with pytest.raises((IndexError, ValueError, RuntimeError)):
        stream.copy_rows(
            torch.zeros(1, 2, 2), torch.tensor([0]), torch.ones(1, 2, 2), torch.tensor([7])
        ).wait()
    stream.close()


def test_an_empty_copy_is_done_at_once():
    stream = ThreadTransferStream("t")
    handle = stream.copy_rows(
        torch.zeros(1, 2, 2),
        torch.tensor([], dtype=torch.int64),
        torch.ones(1, 2, 2),
        torch.tensor([], dtype=torch.int64),
    )
    assert isinstance(handle, DoneHandle) and handle.query()
    stream.close()


def test_small_copies_run_inline_only_when_nothing_is_in_flight():
    stream = ThreadTransferStream("t")
    gate = threading.Event()
    big_src = torch.ones(1, 4096, 8)
    stream._last = stream._pool.submit(gate.wait)  # something in flight
    dst = torch.zeros(1, 2, 8)
    handle = stream.copy_rows(dst, torch.tensor([0]), big_src, torch.tensor([1]))
    assert not isinstance(handle, DoneHandle) and not handle.query()  # queued behind, in order
    gate.set()
    handle.wait()
    again = stream.copy_rows(dst, torch.tensor([1]), big_src, torch.tensor([2]))
    assert isinstance(again, DoneHandle) and bool((dst == 1).all())  # idle stream: copied at once
    stream.close()


def test_a_failed_copy_is_its_handles_alone():
    """A copy that failed on the worker is reported by its own handle, every time it is asked, and
    never by the stream: ``synchronize`` after it raises nothing, and the copies after it (small
    ones run inline) land as ever."""
    stream = ThreadTransferStream("t", inline_bytes=0)
    dst = torch.zeros(1, 4, 2)
    bad = stream.copy_rows(dst, torch.tensor([0]), torch.ones(1, 8, 2), torch.tensor([99]))  # on the worker
    with pytest.raises((IndexError, RuntimeError)):
        bad.wait()
    stream.synchronize()  # the failure is not the stream's
    stream.inline_bytes = 1 << 16
    good = stream.copy_rows(dst, torch.tensor([1]), torch.full((1, 2, 2), 7.0), torch.tensor([1]))
    stream.synchronize()
    assert good.query() and bool((dst[:, 1] == 7).all())
    with pytest.raises((IndexError, RuntimeError)):
        bad.query()
    stream.close()


def test_a_copy_that_cannot_be_issued_is_reported_by_its_handle():
    """The coordinator turns a copy that raised as it was issued into a ``FailedHandle``."""
    handle = FailedHandle(OSError("no transfer"))
    with pytest.raises(OSError, match="no transfer"):
        handle.query()
    with pytest.raises(OSError, match="no transfer"):
        handle.wait()
