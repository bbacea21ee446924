"""Unit checks of the allocators' error paths and the host pool."""

from __future__ import annotations

import pytest
import torch

from pipeline.memory import HiSparseAllocator, HostPool, OutOfMemory, OwnershipError, PagedAllocator


def test_pages_are_handed_out_in_order_and_page_zero_stays_reserved():
    alloc = PagedAllocator("pool", num_pages=4, page_size=2, reserve_first_page=True)
    assert alloc.capacity_pages == 3
    assert alloc.allocate(3, owner=0) == [1, 2, 3]
    with pytest.raises(OutOfMemory, match="pool: asked for 1 pages, 0 free"):
        alloc.allocate(1, owner=1)
    alloc.check_integrity()


@pytest.mark.parametrize(
    ("pages", "message"),
    [
        ([2], "request 0 cannot free page 2: it is owned by request 1"),
        ([3], "cannot free page 3: it is already free"),
        ([0], "cannot free page 0: it is reserved"),
        ([9], "cannot free page 9: it is reserved"),
        ([1, 1], "cannot free page 1: it is already free"),
    ],
)
def test_bad_free_raises_and_changes_nothing(pages, message):
    alloc = PagedAllocator("pool", num_pages=4, page_size=2, reserve_first_page=True)
    alloc.allocate(1, owner=0)  # page 1
    alloc.allocate(1, owner=1)  # page 2
    before = alloc.snapshot()
    with pytest.raises(OwnershipError, match=message):
        alloc.free(pages, owner=0)
    assert alloc.snapshot() == before
    alloc.check_integrity()


def test_double_free_is_caught_after_a_good_free():
    alloc = PagedAllocator("pool", num_pages=3, page_size=4)
    pages = alloc.allocate(2, owner=7)
    alloc.free(pages, owner=7)
    with pytest.raises(OwnershipError, match="already free"):
        alloc.free(pages, owner=7)
    alloc.check_integrity()
    assert alloc.num_free_pages == 3


def test_integrity_check_sees_a_planted_duplicate():
    alloc = PagedAllocator("pool", num_pages=3, page_size=4)
    alloc._free.append(alloc._free[-1])
    with pytest.raises(AssertionError, match="duplicate pages in the free list"):
        alloc.check_integrity()


def test_prefill_binds_both_levels_and_device_buffer_reuses_its_slots():
    alloc = HiSparseAllocator(page_size=4, logical_tokens=64, device_tokens=32, num_rows=2, max_len=32)
    got = alloc.alloc_prefill(0, 10)  # 3 pages
    assert torch.equal(alloc.lookup(got.locs), got.slots)
    assert torch.equal(alloc.req_to_token.table[0, :10], got.locs)
    pages = alloc.alloc_device_buffer(0, got.physical_pages, got.locs, need_tokens=8)
    assert pages == got.physical_pages[:2]  # column c still holds position c
    assert alloc.physical.pages_of(0) == frozenset(pages)  # the surplus page went back
    assert int(alloc.lookup(got.locs).abs().sum()) == 0  # decode reads through the buffer now
    grown = alloc.alloc_device_buffer(1, [], torch.empty(0, dtype=torch.int64), need_tokens=8)
    assert len(grown) == 2
    alloc.check_integrity()


def test_integrity_check_sees_a_mapping_into_another_requests_slot():
    alloc = HiSparseAllocator(page_size=4, logical_tokens=64, device_tokens=32, num_rows=2, max_len=32)
    a = alloc.alloc_prefill(0, 4)
    b = alloc.alloc_prefill(1, 4)
    alloc.bind(a.locs[:1], b.slots[:1])
    with pytest.raises(AssertionError, match="maps to slot"):
        alloc.check_integrity()


def test_mapping_of_minus_one_is_minus_one_and_free_locations_map_to_zero():
    alloc = HiSparseAllocator(page_size=4, logical_tokens=16, device_tokens=16, num_rows=1, max_len=16)
    got = alloc.alloc_prefill(0, 5)
    assert int(alloc.lookup(torch.tensor([-1]))) == -1
    alloc.free_physical(0, got.physical_pages)
    with pytest.raises(AssertionError):
        alloc.check_integrity()  # the prompt still maps into freed slots
    alloc.release_locations(0)
    alloc.check_integrity()
    assert int(alloc.logical_to_physical[:-1].abs().sum()) == 0


def test_prefill_refused_when_the_device_pool_is_short():
    alloc = HiSparseAllocator(page_size=4, logical_tokens=64, device_tokens=8, num_rows=2, max_len=32)
    before = alloc.snapshot()
    with pytest.raises(OutOfMemory, match="physical"):
        alloc.alloc_prefill(0, 12)
    after = alloc.snapshot()
    assert before.logical == after.logical and before.physical == after.physical
    assert not alloc.can_alloc_prefill(0, 12)


def test_host_pool_records_only_copied_positions():
    host = HostPool(num_layers=2, host_tokens=16, row_dim=3, page_size=4, num_rows=2, max_len=16)
    host.reserve(0, 6)
    assert bool((host.req_to_host[0] == -1).all())
    slots = host.record(0, torch.arange(5))
    assert torch.equal(host.req_to_host[0, :5], slots)
    assert int(host.req_to_host[0, 5]) == -1
    assert host.row_bytes == 3 * 4
    host.check_integrity()
    host.release(0)
    assert host.allocator.num_free_pages == 4
    host.check_integrity()


def test_a_tables_slot_of_one_position_is_its_table_entry():
    from pipeline.memory.req_to_token import token_table

    alloc = PagedAllocator("pool", num_pages=8, page_size=4, reserve_first_page=True)
    alloc.allocate(2, owner=5)  # (so that row 0's pages are not the first ones)
    table = token_table(alloc, num_rows=2, max_len=20)
    table.cover(0, 13)
    for pos in range(13):
        assert table.slot(0, pos) == int(table.table[0, pos])


@pytest.mark.parametrize(("start", "end"), [(0, 0), (0, 16), (3, 9), (4, 8), (8, 12), (11, 16), (15, 16)])
def test_a_full_rows_slots_of_a_range_are_that_slice_of_all_its_slots(start, end):
    from pipeline.hisparse.residency import full_slots
    from pipeline.memory.paged import page_slots

    pages = [7, 2, 9, 4]  # (out of order, as a pool hands them back)
    got = full_slots(pages, 4, start, end)
    assert got.dtype == torch.int64
    assert torch.equal(got, page_slots(pages, 4)[start:end])
