"""Which waits of the coordinator block the CPU, and which only order the device's next work.

A fake CUDA-like transfer stream records every wait: ``order_after`` (the current stream waits for
the copy's event; the CPU goes on) and ``wait`` / ``synchronize`` (the CPU blocks). Its copies move
their data when issued, so the pools stay right, but report themselves in flight until the test
lands them, as a side stream's copies would while the CPU runs ahead.

* a decode step with no release waits on the CPU for nothing, however many backups are in flight;
* a staging collect only polls (``query``), and takes a row only once its copy has landed;
* a release waits on the CPU for every copy that touches the row's slots;
* a backup found failed after device work was ordered after it loses its row (its source may be
  overwritten); one known failed when it is ordered is redone first.

Then the interface itself (the CPU stream's ``order_after`` blocks as ``wait`` does) and the
pinning decision of every host tensor a CUDA copy reads or writes (on a device:
``tests/cuda/test_transfer_on_device.py``).
"""

from __future__ import annotations

import threading

import pytest
import torch

from kernels.kv_copy import copy_rows_unchecked
from pipeline.capacity import MemoryPlan
from pipeline.hisparse.coordinator import HiSparseCoordinator
from pipeline.hisparse.transfer import DoneHandle, FailedHandle, ThreadTransferStream
from pipeline.memory import host_pool
from pipeline.memory.host_pool import HostPool, pins_for
from pipeline.memory.interface import Residency
from pipeline.speculative import draft_pool
from pipeline.speculative.draft_pool import DraftPool

HOT, PAGE = 8, 4
CPU_WAITS = {"wait", "synchronize"}


class Log:
    """Every wait and poll of the fake streams, in order: ``(stream, verb)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.streams: list[FakeSideStream] = []

    def factory(self, name: str, device: torch.device) -> FakeSideStream:
        stream = FakeSideStream(name, self)
        self.streams.append(stream)
        return stream

    def verbs(self) -> list[str]:
        return [verb for _, verb in self.calls]

    def cpu_waits(self) -> list[tuple[str, str]]:
        return [call for call in self.calls if call[1] in CPU_WAITS]

    def land_all(self) -> None:
        for stream in self.streams:
            for handle in stream.handles:
                handle.landed = True


class FakeEvent:
    """A side stream's copy: in flight until landed (by the test, or by a CPU wait)."""

    def __init__(self, stream: FakeSideStream, error: BaseException | None) -> None:
        self.stream, self.error, self.landed = stream, error, False

    def _log(self, verb: str) -> None:
        self.stream.log.calls.append((self.stream.name, verb))

    def query(self) -> bool:
        self._log("query")
        if self.landed and self.error is not None:
            raise self.error
        return self.landed

    def wait(self) -> None:
        self._log("wait")
        self.landed = True
        if self.error is not None:
            raise self.error

    def order_after(self) -> None:
        self._log("order_after")  # the device orders it; the CPU knows nothing yet


class FakeSideStream:
    def __init__(self, name: str, log: Log) -> None:
        self.name, self.log = name, log
        self.handles: list[FakeEvent] = []
        self.fail_next: BaseException | None = None  # the next copy fails (found when it lands)

    def copy_rows(self, dst, dst_idx, src, src_idx) -> FakeEvent | DoneHandle:
        if src_idx.numel() == 0:
            return DoneHandle()
        error, self.fail_next = self.fail_next, None
        if error is None:
            copy_rows_unchecked(dst, dst_idx, src, src_idx)
        handle = FakeEvent(self, error)
        self.handles.append(handle)
        return handle

    def synchronize(self) -> None:
        self.log.calls.append((self.name, "synchronize"))
        for handle in self.handles:
            handle.landed = True

    def close(self) -> None:
        self.synchronize()


def plan() -> MemoryPlan:
    return MemoryPlan(
        page_size=PAGE,
        hot=HOT,
        buffer_columns=HOT + PAGE,
        top_k=4,
        device_tokens=128,
        logical_tokens=128,
        host_tokens=256,
        max_context_len=64,
        max_running_requests=4,
        draft_tokens=0,
        hisparse=True,
        prefill_chunk=64,
    )


def coordinator(log: Log) -> HiSparseCoordinator:
    return HiSparseCoordinator(plan(), num_layers=2, row_dim=4, index_dim=4, transfer=log.factory)


def write(coord: HiSparseCoordinator, slots: torch.Tensor) -> None:
    """What a forward does: fresh KV rows at ``slots`` in every layer."""
    kv = coord.device_kv
    kv[:, slots] = torch.randn(coord.num_layers, slots.numel(), coord.row_dim, device=kv.device)


def decoding_row(coord: HiSparseCoordinator, log: Log, prompt: int = 5) -> int:
    """A row admitted, prefilled, staged and collected (its staging copy landed)."""
    row = coord.admit(prompt)
    targets = coord.prefill_targets(row, 0, prompt)
    write(coord, targets.slots)
    coord.commit_prefill(row, 0, prompt, final=True)
    coord.start_staging(row, prompt)
    log.land_all()
    assert coord.collect_ready() == [row]
    return row


def decode(coord: HiSparseCoordinator, rows: list[int]) -> None:
    targets = coord.prepare_decode(rows)
    write(coord, targets.slots)
    coord.commit_decode(rows, targets.slots)


def test_a_decode_step_with_no_release_waits_on_the_cpu_for_nothing():
    log = Log()
    coord = coordinator(log)
    rows = [decoding_row(coord, log), decoding_row(coord, log, prompt=2)]
    log.calls.clear()
    for _ in range(3 * HOT):  # well past HOT: each step overwrites a newest column a backup reads
        decode(coord, rows)
    assert log.cpu_waits() == [], log.cpu_waits()
    assert "order_after" in log.verbs()  # the overwrites were ordered after the backups, on the device
    assert all(coord.length(row) > HOT for row in rows)
    # nothing landed meanwhile: every backup is still in flight, and the KV is all the same right
    assert all(not h.landed for s in log.streams if s.name == "backup" for h in s.handles)
    coord.check_integrity()  # (waits for the backups: it compares host copies)
    assert coord.take_backup_failures(rows) == {}
    coord.close()


def test_each_backup_is_ordered_once_before_its_source_is_overwritten():
    log = Log()
    coord = coordinator(log)
    row = decoding_row(coord, log, prompt=HOT)  # long from its first decode step
    log.calls.clear()
    steps = 6
    for _ in range(steps):
        decode(coord, [row])
    backups = [h for s in log.streams if s.name == "backup" for h in s.handles]
    assert len(backups) == steps
    # every backup but the last (whose source the next step would overwrite) ordered exactly once
    assert log.verbs().count("order_after") == steps - 1
    coord.close()


def test_a_staging_collect_only_polls():
    log = Log()
    coord = coordinator(log)
    row = coord.admit(6)
    write(coord, coord.prefill_targets(row, 0, 6).slots)
    coord.commit_prefill(row, 0, 6, final=True)
    coord.start_staging(row, 6)
    log.calls.clear()
    assert coord.collect_ready() == []  # in flight: polled, not waited for
    assert coord.residency(row) is Residency.STAGING
    log.land_all()
    assert coord.collect_ready() == [row]
    assert set(log.verbs()) == {"query"}
    coord.close()


def test_a_release_waits_on_the_cpu_for_the_copies_touching_its_slots():
    log = Log()
    coord = coordinator(log)
    row, other = decoding_row(coord, log, prompt=HOT), decoding_row(coord, log)
    for _ in range(4):
        decode(coord, [row, other])
    log.calls.clear()
    coord.release(row)
    assert log.cpu_waits() and {stream for stream, _ in log.cpu_waits()} == {"backup"}
    backups = [h for s in log.streams if s.name == "backup" for h in s.handles]
    assert all(h.landed for h in backups)  # every one up to the row's newest: each one carries it
    coord.check_integrity()
    coord.close()


def test_a_release_during_staging_waits_for_the_staging_copy():
    log = Log()
    coord = coordinator(log)
    row = coord.admit(6)
    write(coord, coord.prefill_targets(row, 0, 6).slots)
    coord.commit_prefill(row, 0, 6, final=True)
    coord.start_staging(row, 6)
    log.calls.clear()
    coord.release(row)
    assert ("staging", "wait") in log.calls
    assert coord.free_counts()["physical_pages"] == coord.alloc.physical.capacity_pages
    coord.close()


def test_a_backup_found_failed_after_it_was_ordered_loses_its_row():
    """Its source may have been overwritten by the work ordered after it: it is not redone."""
    log = Log()
    coord = coordinator(log)
    row, other = decoding_row(coord, log, prompt=HOT), decoding_row(coord, log, prompt=HOT)
    decode(coord, [row])
    backup_stream = next(s for s in log.streams if s.name == "backup")
    backup_stream.fail_next = RuntimeError("copy failed on the device")
    decode(coord, [row])  # its backup fails (not known yet)
    decode(coord, [row])  # ordered after that backup, then issues another: polls it (still in flight)
    issued = len(backup_stream.handles)
    log.land_all()
    decode(coord, [other])  # a later backup polls the head of the queue: the failure shows
    assert len(backup_stream.handles) == issued + 1  # nothing redone
    failures = coord.take_backup_failures([row, other])
    assert list(failures) == [row] and "copy failed on the device" in failures[row]
    coord.release(row)
    coord.close()


def test_a_backup_known_failed_when_ordered_is_redone_first():
    """A copy that failed as it was issued is known at once: redone row by row, nobody lost."""
    log = Log()
    coord = coordinator(log)
    row = decoding_row(coord, log, prompt=HOT)
    backup_stream = next(s for s in log.streams if s.name == "backup")
    real = backup_stream.copy_rows
    calls = {"n": 0}

    def first_fails(*args):
        calls["n"] += 1
        return FailedHandle(OSError("not issued")) if calls["n"] == 1 else real(*args)

    backup_stream.copy_rows = first_fails
    decode(coord, [row])
    decode(coord, [row])  # orders after the failed one: it raises, and is redone (a CPU wait)
    assert ("backup", "wait") in log.calls
    assert coord.take_backup_failures([row]) == {}
    coord.check_integrity()
    coord.close()


# --- the interface ------------------------------------------------------------------------------


def test_the_cpu_streams_order_after_blocks_as_wait_does():
    stream = ThreadTransferStream("t", inline_bytes=0)
    gate = threading.Event()
    stream._pool.submit(gate.wait)  # occupy the worker
    dst = torch.zeros(1, 2, 2)
    handle = stream.copy_rows(dst, torch.tensor([0]), torch.ones(1, 2, 2), torch.tensor([1]))
    assert not handle.query()
    gate.set()
    handle.order_after()  # returns once the copy has run
    assert handle.query() and bool((dst[:, 0] == 1).all())
    bad = stream.copy_rows(dst, torch.tensor([0]), torch.ones(1, 2, 2), torch.tensor([9]))
    with pytest.raises((IndexError, RuntimeError)):
        bad.order_after()
    stream.close()


def test_done_and_failed_handles_order_after():
    DoneHandle().order_after()
    with pytest.raises(OSError, match="lost"):
        FailedHandle(OSError("lost")).order_after()


# --- pinned host memory ---------------------------------------------------------------------------


def test_host_tensors_are_pinned_exactly_for_cuda():
    assert pins_for(torch.device("cuda")) is True
    assert pins_for(torch.device("cuda", 1)) is True
    assert pins_for(torch.device("cpu")) is False


@pytest.fixture
def pin_requests(monkeypatch):
    """The ``pinned`` flag of every host allocation, in order (allocated unpinned: no GPU here)."""
    asked: list[bool] = []

    def zeros(shape, dtype, *, pinned):
        asked.append(pinned)
        return torch.zeros(shape, dtype=dtype)

    monkeypatch.setattr(host_pool, "host_zeros", zeros)
    monkeypatch.setattr(draft_pool, "host_zeros", zeros)
    return asked


def test_the_host_pool_asks_for_pinned_memory_on_cuda(pin_requests):
    for device, expect in ((torch.device("cuda"), True), (torch.device("cpu"), False)):
        pin_requests.clear()
        HostPool(
            num_layers=2,
            host_tokens=16,
            row_dim=4,
            page_size=4,
            num_rows=2,
            max_len=8,
            pin_memory=pins_for(device),
        )
        assert pin_requests == [expect]


def test_the_draft_pools_host_rows_and_keys_ask_for_pinned_memory_on_cuda(pin_requests):
    table = torch.full((2, 8), -1, dtype=torch.int64)
    DraftPool(16, 4, 4, 2, lambda: table, device=torch.device("cuda"), rows_on_host=True, keys_on_host=True)
    assert pin_requests == [True, True]
    pin_requests.clear()
    DraftPool(16, 4, 4, 2, lambda: table, rows_on_host=True, keys_on_host=True)
    assert pin_requests == [False, False]


def test_rows_gathered_for_cuda_go_through_a_pinned_block(monkeypatch):
    asked: list[bool] = []

    class Stop(Exception):
        pass

    def empty(shape, dtype, *, pinned):
        asked.append(pinned)
        raise Stop  # (a pinned block needs a GPU: the flag asked for is what is checked)

    monkeypatch.setattr(host_pool, "host_empty", empty)
    host = torch.arange(12.0).reshape(6, 2)
    with pytest.raises(Stop):
        host_pool.to_device(host, torch.tensor([4, 1]), torch.device("cuda"))
    assert asked == [True]
    rows = host_pool.to_device(host, torch.tensor([4, 1]), torch.device("cpu"))  # no block on a CPU
    assert asked == [True] and torch.equal(rows, host[[4, 1]])
