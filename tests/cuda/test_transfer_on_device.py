"""The transfer layer on the device: stream-ordered waits, pinned host memory, the row copies that
address it (equal to the reference, and issued without a CPU wait), and a decode step of the
coordinator that waits on the CPU for no copy (``docs/cuda.md``).

On CUDA the copies run on side streams and ``order_after`` only makes the current stream wait; on
a CPU (``HISPEC_TEST_DEVICE=cpu``) the same bodies run over the worker-thread stream, where it
blocks instead.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kernels import kv_copy
from kernels.kv_copy import copy_rows, copy_rows_reference, load_rows
from pipeline.capacity import MemoryPlan
from pipeline.hisparse.coordinator import HiSparseCoordinator
from pipeline.hisparse.transfer import TransferHandle, TransferStream, make_transfer_stream
from pipeline.memory.host_pool import host_zeros, pins_for, to_device
from pipeline.memory.resident import ResidentMemory
from pipeline.memory.step_inputs import to_device as step_to_device

pytestmark = pytest.mark.cuda

HOT, PAGE = 16, 8
SLEEP_CYCLES = 1 << 31  # device work the copies under test are queued behind


def _cuda_only(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("pinned host memory and stream order are CUDA's")


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
    the rows as they were when the copy was issued. (On CUDA the copy to the pinned host pool is the
    row-copy kernel on the side stream, so only the ordering keeps the overwrite out of it.)"""
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


def _coordinator(device: torch.device, calls: list[tuple[str, str]]) -> HiSparseCoordinator:
    plan = MemoryPlan(
        page_size=PAGE, hot=HOT, buffer_columns=HOT + PAGE, top_k=8, device_tokens=512,
        logical_tokens=512, host_tokens=1024, max_context_len=128, max_running_requests=4,
        draft_tokens=0, hisparse=True, prefill_chunk=128,
    )
    return HiSparseCoordinator(
        plan, num_layers=3, row_dim=64, index_dim=16, device=device, num_draft_layers=1,
        draft_rows_on_host=True, draft_keys_on_host=True,
        transfer=lambda name, dev: RecordedStream(make_transfer_stream(name, dev), name, calls),
    )


def _write(coord: HiSparseCoordinator, slots: torch.Tensor) -> None:
    """What a forward does: fresh rows in every layer."""
    kv = coord.device_kv
    kv[:, slots] = torch.randn(kv.shape[0], slots.numel(), kv.shape[-1], device=kv.device)


def _decoding(coord: HiSparseCoordinator, prompts: tuple[int, ...]) -> list[int]:
    """Rows admitted, prefilled and staged for ``prompts``: ready to decode."""
    rows = []
    for prompt in prompts:
        row = coord.admit(prompt)
        _write(coord, coord.prefill_targets(row, 0, prompt).slots)
        coord.commit_prefill(row, 0, prompt, final=True)
        coord.start_staging(row, prompt)
        rows.append(row)
    coord.wait_staging()
    assert coord.collect_ready() == rows
    return rows


def test_a_decode_step_waits_on_the_cpu_for_no_copy(device):
    calls: list[tuple[str, str]] = []
    coord = _coordinator(device, calls)
    cuda = device.type == "cuda"
    assert coord.host.kv.is_pinned() == cuda
    assert coord.draft is not None
    assert coord.draft.store.kv.is_pinned() == cuda and coord.draft.store.index_k.is_pinned() == cuda
    write = functools.partial(_write, coord)
    rows = _decoding(coord, (5, HOT + 3))
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


def test_a_steps_inputs_reach_the_device_without_a_cpu_wait(device):
    """Issued behind a long device sleep: the small inputs of a step (``step_inputs.to_device``: one
    pinned block, one asynchronous copy), and the whole of the coordinator's ``prepare_decode`` for
    rows past HOT (their newest columns change hands, the slot map's mirror records the step), return
    while the device still sleeps; the values land after it."""
    _cuda_only(device)
    step_to_device(device, [1, 2], [3])  # (the pinned-block cache warmed)
    torch.cuda._sleep(SLEEP_CYCLES)
    rows, positions = step_to_device(device, [3, 1, 2], [40, 41, 42])
    after = torch.cuda.Event()
    after.record()
    assert not after.query(), "the copy of the step's inputs waited for the device"
    after.synchronize()
    assert rows.tolist() == [3, 1, 2] and positions.tolist() == [40, 41, 42]

    coord = _coordinator(device, [])
    decoding = _decoding(coord, (HOT + 3, 2 * HOT + 1))
    for _ in range(2):  # (every kernel and copy of a step made once)
        targets = coord.prepare_decode(decoding)
        _write(coord, targets.slots)
        coord.commit_decode(decoding, targets.slots)
    torch.cuda._sleep(SLEEP_CYCLES)
    targets = coord.prepare_decode(decoding)
    after = torch.cuda.Event()
    after.record()
    assert not after.query(), "prepare_decode waited for the device"
    _write(coord, targets.slots)
    coord.commit_decode(decoding, targets.slots)
    coord.check_integrity()
    for row in decoding:
        coord.release(row)
    coord.close()


def test_an_all_resident_requests_inputs_reach_the_device_without_a_cpu_wait(device):
    """All-resident: a request's admission (its token-table row), its prefill targets and its decode
    step's targets (a new page covered: the token-table row again), each issued behind a long device
    sleep, return while the device still sleeps; the values land after it."""
    _cuda_only(device)
    mem = _resident(device)
    step_to_device(device, [1, 2], [3])  # (the pinned-block cache warmed)

    def issued_behind_a_sleep(what: str, fn):
        torch.cuda._sleep(SLEEP_CYCLES)
        out = fn()
        after = torch.cuda.Event()
        after.record()
        assert not after.query(), f"{what} waited for the device"
        after.synchronize()
        return out

    row = issued_behind_a_sleep("admit", lambda: mem.admit(12))
    targets = issued_behind_a_sleep("prefill_targets", lambda: mem.prefill_targets(row, 0, 12))
    assert targets.locs.device.type == "cuda"
    assert targets.locs.tolist() == mem.store.req_to_token[row, :12].tolist()
    mem.commit_prefill(row, 0, 12, final=True)
    mem.start_staging(row, 12)
    assert mem.collect_ready() == [row]
    step = issued_behind_a_sleep("prepare_decode", lambda: mem.prepare_decode([row]))
    assert step.slots.tolist() == mem.store.req_to_token[row, 12:13].tolist()
    mem.commit_decode([row], step.slots)
    mem.release(row)
    assert mem.free_counts() == _initial_counts(device)


def _resident(device) -> ResidentMemory:
    plan = MemoryPlan(
        page_size=4, hot=0, buffer_columns=0, top_k=4, device_tokens=64, logical_tokens=64,
        host_tokens=0, max_context_len=24, max_running_requests=2, draft_tokens=0, hisparse=False,
        prefill_chunk=24, prefix_cache=False,
    )
    return ResidentMemory(plan=plan, num_layers=1, num_mtp_layers=0, row_dim=2, index_dim=2, device=device)


def _initial_counts(device) -> dict[str, int]:
    return _resident(device).free_counts()


def test_pinned_host_memory_is_addressed_by_the_kernel(device):
    _cuda_only(device)
    assert kv_copy.host_addressable(torch.zeros(4).pin_memory())
    assert not kv_copy.host_addressable(torch.zeros(4))
    assert not kv_copy.host_addressable(torch.zeros(4, device=device))
    assert kv_copy.mapped_copy(torch.zeros(4, 2, device=device), torch.zeros(4, 2).pin_memory())


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("layered", [False, True], ids=["one-layer", "all-layers"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32], ids=str)
def test_copies_with_the_host_pool_equal_the_reference(device, dtype, layered, index_dtype):
    """A backup (device -> host pool) and a load (host pool -> device) as the engine issues them:
    the host pool pinned on CUDA, host slots on the CPU, device slots on the device; the backup on a
    transfer stream, the load on the current stream. Against ``copy_rows_reference`` on the CPU; on
    CUDA the kernel made both (no launch fell back to torch)."""
    g = torch.Generator().manual_seed(7)
    rows, n, dim = 3000, 1000, 656  # (an FP8 V3.2 row's bytes)
    shape = (3, rows, dim) if layered else (rows, dim)

    def random_rows() -> torch.Tensor:
        if dtype == torch.uint8:
            return torch.randint(0, 256, shape, generator=g, dtype=dtype)
        return torch.randn(shape, generator=g).to(dtype)

    host_rows, dev_rows = random_rows(), random_rows()
    h_slots = torch.randperm(rows, generator=g)[:n].to(index_dtype)
    d_slots = torch.randperm(rows, generator=g)[:n].to(index_dtype)
    host = host_zeros(shape, dtype, pinned=pins_for(device))
    host.copy_(host_rows)
    on_device = dev_rows.to(device)

    want_host = host_rows.clone()
    copy_rows_reference(want_host, h_slots, dev_rows, d_slots)
    stream = make_transfer_stream("backup", device)
    stream.copy_rows(host, h_slots, on_device, d_slots.to(device)).wait()
    assert torch.equal(host, want_host)
    stream.close()

    want_device = dev_rows.clone()
    copy_rows_reference(want_device, d_slots, want_host, h_slots)
    load_rows(on_device, d_slots.to(device), host, h_slots, validate=False)
    assert torch.equal(on_device.cpu(), want_device)
    assert kv_copy.host_launch_failure() is None


def test_a_copy_to_the_pinned_pool_does_not_block_the_cpu(device):
    """Issued behind a long device sleep, a backup's ``copy_rows`` returns while its copy cannot
    have run yet (its event is not complete); it lands after the sleep, with the right rows."""
    _cuda_only(device)
    stream = make_transfer_stream("backup", device)
    src = torch.randn(2, 1024, 64, device=device)
    host = host_zeros((2, 1024, 64), torch.float32, pinned=True)
    h_slots, d_slots = torch.randperm(1024), torch.randperm(1024, device=device)
    stream.copy_rows(host, h_slots, src, d_slots).wait()  # the kernel compiled, the blocks cached
    src.mul_(2.0)
    torch.cuda._sleep(SLEEP_CYCLES)
    handle = stream.copy_rows(host, h_slots, src, d_slots)
    assert not handle.query(), "copy_rows waited for the device"
    handle.wait()
    want = torch.zeros(2, 1024, 64)
    want[:, h_slots] = src[:, d_slots].cpu()
    assert torch.equal(host, want)
    assert kv_copy.host_launch_failure() is None
    stream.close()


def test_a_load_from_the_pinned_pool_does_not_block_the_cpu(device):
    """A load from the pinned host pool (a prefix hit's identity load) is device work on the current
    stream: issued behind a long sleep, an event recorded right after it is not complete yet."""
    _cuda_only(device)
    host = torch.randn(1024, 64).pin_memory()
    dst = torch.zeros(1024, 64, device=device)
    h_slots, d_slots = torch.randperm(1024), torch.randperm(1024, device=device)
    load_rows(dst, d_slots, host, h_slots, validate=False)  # compiled, blocks cached
    dst.zero_()
    torch.cuda._sleep(SLEEP_CYCLES)
    copy_rows(dst, d_slots, host, h_slots, validate=False)
    after = torch.cuda.Event()
    after.record()
    assert not after.query(), "the load waited for the device"
    after.synchronize()
    want = torch.zeros(1024, 64)
    want[d_slots.cpu()] = host[h_slots]
    assert torch.equal(dst.cpu(), want)
    assert kv_copy.host_launch_failure() is None
