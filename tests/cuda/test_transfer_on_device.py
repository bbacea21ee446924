"""The transfer layer on the device: stream-ordered waits, pinned host memory, and a decode step of
the coordinator that waits on the CPU for no copy (``docs/cuda.md``).

On CUDA the copies run on side streams and ``order_after`` only makes the current stream wait; on
a CPU (``HISPEC_TEST_DEVICE=cpu``) the same bodies run over the worker-thread stream, where it
blocks instead.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.capacity import MemoryPlan
from pipeline.hisparse.coordinator import HiSparseCoordinator
from pipeline.hisparse.transfer import TransferHandle, TransferStream, make_transfer_stream
from pipeline.memory.host_pool import host_zeros, pins_for, to_device

pytestmark = pytest.mark.cuda

HOT, PAGE = 16, 8


class Recorded:
    """A real handle whose waits are recorded: ``(stream, verb)``."""

    def __init__(self, inner: TransferHandle, name: str, calls: list[tuple[str, str]]) -> None:
        self.inner, self.name, self.calls = inner, name, calls

    def query(self) -> bool:
        return self.inner.query()

    def wait(self) -> None:
        self.calls.append((self.name, "wait"))
        self.inner.wait()

    def order_after(self) -> None:
        self.calls.append((self.name, "order_after"))
        self.inner.order_after()


class RecordedStream:
    def __init__(self, inner: TransferStream, name: str, calls: list[tuple[str, str]]) -> None:
        self.inner, self.name, self.calls = inner, name, calls

    def copy_rows(self, dst, dst_idx, src, src_idx) -> Recorded:
        return Recorded(self.inner.copy_rows(dst, dst_idx, src, src_idx), self.name, self.calls)

    def synchronize(self) -> None:
        self.calls.append((self.name, "synchronize"))
        self.inner.synchronize()

    def close(self) -> None:
        self.inner.close()


def test_an_overwrite_ordered_after_a_copy_does_not_reach_it(device):
    """The source is overwritten on the current stream right after ``order_after``: the host holds
    the rows as they were when the copy was issued. (While the device-to-host copy is torch's
    blocking one, docs/cuda.md item 6, it has landed before ``copy_rows`` returns, so this checks the
    result, not yet the ordering; it will once the copy runs on the side stream.)"""
    stream = make_transfer_stream("t", device)
    src = torch.randn(2, 4096, 64, device=device)
    before = src.to("cpu", copy=True)
    host = host_zeros((2, 4096, 64), torch.float32, pinned=pins_for(device))
    index = torch.arange(4096)
    handle = stream.copy_rows(host, index, src, index.to(device))
    handle.order_after()
    src.fill_(-1.0)  # queued after the copy
    handle.wait()
    assert torch.equal(host, before)
    stream.close()


def test_rows_gathered_for_the_device_are_the_host_rows(device):
    host = host_zeros((64, 8), torch.float32, pinned=pins_for(device))
    assert host.is_pinned() == (device.type == "cuda")
    host.copy_(torch.randn(64, 8))
    index = torch.tensor([5, 63, 0, 5])
    rows = to_device(host, index, device)
    assert rows.device.type == device.type and torch.equal(rows.cpu(), host[index])


def test_a_decode_step_waits_on_the_cpu_for_no_copy(device):
    calls: list[tuple[str, str]] = []
    plan = MemoryPlan(
        page_size=PAGE, hot=HOT, buffer_columns=HOT + PAGE, top_k=8, device_tokens=512,
        logical_tokens=512, host_tokens=1024, max_context_len=128, max_running_requests=4,
        draft_tokens=0, hisparse=True, prefill_chunk=128,
    )
    coord = HiSparseCoordinator(
        plan, num_layers=3, row_dim=64, index_dim=16, device=device, num_draft_layers=1,
        draft_rows_on_host=True, draft_keys_on_host=True,
        transfer=lambda name, dev: RecordedStream(make_transfer_stream(name, dev), name, calls),
    )
    cuda = device.type == "cuda"
    assert coord.host.kv.is_pinned() == cuda
    assert coord.draft is not None
    assert coord.draft.store.kv.is_pinned() == cuda and coord.draft.store.index_k.is_pinned() == cuda

    def write(slots: torch.Tensor) -> None:  # what a forward does: fresh rows in every layer
        kv = coord.device_kv
        kv[:, slots] = torch.randn(kv.shape[0], slots.numel(), kv.shape[-1], device=device)

    rows = []
    for prompt in (5, HOT + 3):
        row = coord.admit(prompt)
        write(coord.prefill_targets(row, 0, prompt).slots)
        coord.commit_prefill(row, 0, prompt, final=True)
        coord.start_staging(row, prompt)
        rows.append(row)
    coord.wait_staging()
    assert coord.collect_ready() == rows
    calls.clear()
    for _ in range(2 * HOT):
        targets = coord.prepare_decode(rows)
        write(targets.slots)
        coord.commit_decode(rows, targets.slots)
    assert [c for c in calls if c[1] != "order_after"] == []
    assert ("backup", "order_after") in calls
    coord.check_integrity()  # every committed row's host copy equals its device row
    assert coord.take_backup_failures(rows) == {}
    for row in rows:
        coord.release(row)
    coord.close()
