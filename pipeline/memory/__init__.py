"""The memory layer: request rows, paged allocators, the HiSparse two-level map, the host pool."""

from pipeline.memory.hisparse_allocator import HiSparseAllocator, HiSparseSnapshot, PrefillAllocation
from pipeline.memory.host_pool import HostPool
from pipeline.memory.paged import (
    FREE,
    RESERVED,
    OutOfMemory,
    OwnershipError,
    PagedAllocator,
    PagedTable,
    PoolError,
    page_slot,
    page_slots,
    round_up,
)
from pipeline.memory.req_to_token import RequestRows, token_table

__all__ = [
    "FREE",
    "RESERVED",
    "HiSparseAllocator",
    "HiSparseSnapshot",
    "HostPool",
    "OutOfMemory",
    "OwnershipError",
    "PagedAllocator",
    "PagedTable",
    "PoolError",
    "PrefillAllocation",
    "RequestRows",
    "page_slot",
    "page_slots",
    "round_up",
    "token_table",
]
