"""Request rows and the request-to-token table.

Every live request owns one row ``r`` of the tables (``req_to_token``, ``req_to_host``, the device
buffer tables); the row number is also its owner id in every allocator. ``req_to_token[r, pos]`` is
the logical location of position ``pos`` (0 = none; location 0 is never handed out).
"""

from __future__ import annotations

import attrs

from pipeline.memory.paged import OutOfMemory, PagedAllocator, PagedTable


@attrs.define(eq=False)
class RequestRows:
    """Hands out request rows ``0..num_rows-1``; a row is reused only after it is freed."""

    num_rows: int
    _free: list[int] = attrs.field(init=False)
    _used: set[int] = attrs.field(init=False, factory=set)

    def __attrs_post_init__(self) -> None:
        self._free = list(range(self.num_rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        """A free row; raises ``OutOfMemory`` when every row is taken."""
        if not self._free:
            raise OutOfMemory("request rows", 1, 0)
        row = self._free.pop()
        self._used.add(row)
        return row

    def free(self, row: int) -> None:
        if row not in self._used:
            raise ValueError(f"request row {row} is not in use")
        self._used.remove(row)
        self._free.append(row)

    def in_use(self) -> frozenset[int]:
        return frozenset(self._used)

    def check_integrity(self) -> None:
        assert len(set(self._free)) == len(self._free), "request rows: duplicate free row"
        assert not (set(self._free) & self._used), "request rows: a row is both free and used"
        assert len(self._free) + len(self._used) == self.num_rows, "request rows: a row went missing"


def token_table(allocator: PagedAllocator, num_rows: int, max_len: int) -> PagedTable:
    """``req_to_token``: positions get logical locations page by page, recorded as they are covered."""
    return PagedTable("req_to_token", allocator, num_rows, max_len, empty=0, fill_on_cover=True)
