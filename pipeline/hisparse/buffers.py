"""Per-request device buffers: which physical slots a request owns and what each column holds.

One request's buffer (HOT = ``hot``, P = ``page_size``)::

    columns  0 ........................ HOT-1 | HOT    | HOT+1 ... HOT+P-1
             hot region (LRU managed)          | newest | draft zone (verify tokens)

* ``locs[r, col]``: physical slot of the column, -1 beyond the request's capacity. Slots are the same
  for every layer (each layer has its own device pool tensor), so one table serves all layers.
* ``tokens[layer, r, col]``: the position the column holds in that layer, -1 when empty.
* ``lru[layer, r]``: the hot columns, least recently used first (a permutation of ``0..HOT-1``).

While a request is no longer than HOT, column c holds position c (identity) and nothing moves.
Capacity grows lazily by whole pages: ``min(roundup(len, P), HOT)``, then ``HOT + P`` once the request
reaches HOT (and at once in speculative mode, whose verify tokens need the draft zone).
"""

from __future__ import annotations

import attrs
import torch

from pipeline.memory import page_slot, page_slots, round_up


@attrs.define(eq=False)
class DeviceBuffers:
    num_layers: int
    num_rows: int
    hot: int
    page_size: int
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    locs: torch.Tensor = attrs.field(init=False)  # [N, HOT+P] int64, -1 beyond capacity
    tokens: torch.Tensor = attrs.field(init=False)  # [L, N, HOT+P] int32, -1 = empty
    lru: torch.Tensor = attrs.field(init=False)  # [L, N, HOT] int32, least recent first
    _pages: list[list[int]] = attrs.field(init=False)  # physical pages per row, column order
    # per row, the position its newest column holds in every layer (-1: none): a host copy of
    # ``tokens[:, r, newest]``, which only the coordinator writes (``record_newest``), so that it is
    # never read back from the device
    _newest: list[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        cols = self.columns
        self.locs = torch.full((self.num_rows, cols), -1, dtype=torch.int64, device=self.device)
        self.tokens = torch.full(
            (self.num_layers, self.num_rows, cols), -1, dtype=torch.int32, device=self.device
        )
        self.lru = torch.arange(self.hot, dtype=torch.int32, device=self.device).repeat(
            self.num_layers, self.num_rows, 1
        )
        self._pages = [[] for _ in range(self.num_rows)]
        self._newest = [-1] * self.num_rows

    @property
    def columns(self) -> int:
        return self.hot + self.page_size

    @property
    def newest(self) -> int:
        """The column of the newest committed token once the request is longer than HOT."""
        return self.hot

    def capacity(self, row: int) -> int:
        return len(self._pages[row]) * self.page_size

    def pages(self, row: int) -> list[int]:
        return list(self._pages[row])

    def capacity_for(self, length: int, *, speculative: bool) -> int:
        """Columns a request of ``length`` positions needs (whole pages)."""
        if speculative or length > self.hot:
            return self.columns
        return min(round_up(length, self.page_size), self.hot)

    def newest_of(self, rows: list[int]) -> list[int]:
        """The position each row's newest column holds (-1: none), from the host copy."""
        return [self._newest[row] for row in rows]

    def record_newest(self, rows: list[int], positions: list[int]) -> None:
        """The newest columns of ``rows`` now hold ``positions`` in every layer: the caller wrote
        ``tokens`` (or writes it before the device reads it); this keeps the host copy."""
        for row, pos in zip(rows, positions):
            self._newest[row] = pos

    def slot_of(self, row: int, col: int) -> int:
        """``locs[row, col]`` found on the host, from the row's pages (no read of the device table)."""
        return page_slot(self._pages[row], self.page_size, col)

    def column_of(self, position: int) -> int:
        """Where a decode step writes ``position``: its identity column, or the newest column."""
        return position if position < self.hot else self.newest

    def assign(self, row: int, pages: list[int]) -> None:
        """Give an empty row its first pages: identity hot columns, empty newest/draft columns."""
        if self._pages[row]:
            raise ValueError(f"device buffer row {row} is already assigned")
        self._pages[row] = []
        self.lru[:, row] = torch.arange(self.hot, dtype=torch.int32, device=self.device)
        self.tokens[:, row, : self.hot] = torch.arange(self.hot, dtype=torch.int32, device=self.device)
        self.tokens[:, row, self.hot :] = -1
        self._newest[row] = -1
        self.grow(row, pages)

    def grow(self, row: int, pages: list[int]) -> None:
        """Append pages; new hot columns keep the identity, new newest/draft columns stay empty."""
        start = self.capacity(row)
        self._pages[row].extend(pages)
        end = self.capacity(row)
        if end > self.columns:
            raise ValueError(f"device buffer row {row} would exceed {self.columns} columns")
        if pages:
            self.locs[row, start:end] = page_slots(pages, self.page_size).to(self.device)

    def reset(self, row: int) -> list[int]:
        """Forget the row; returns its pages for the caller to free."""
        pages, self._pages[row] = self._pages[row], []
        self.locs[row] = -1
        self.tokens[:, row] = -1
        self._newest[row] = -1
        self.lru[:, row] = torch.arange(self.hot, dtype=torch.int32, device=self.device)
        return pages

    def check_integrity(self, row: int, seq_len: int) -> None:
        """Invariants I3-I5 (docs/invariants.md) for one live row holding ``seq_len`` committed positions."""
        cap = self.capacity(row)
        expect = page_slots(self._pages[row], self.page_size).to(self.device)
        assert torch.equal(self.locs[row, :cap], expect), f"row {row}: buffer slots disagree with its pages"
        assert bool((self.locs[row, cap:] == -1).all()), f"row {row}: slots recorded beyond capacity {cap}"
        assert cap in {0, self.columns} or (cap % self.page_size == 0 and cap <= self.hot), f"capacity {cap}"
        hot_ids = torch.arange(self.hot, dtype=torch.int32, device=self.device)
        if cap == self.columns:  # the host copy of the newest column says what every layer holds
            in_layers = self.tokens[:, row, self.newest].tolist()
            assert in_layers == [self._newest[row]] * self.num_layers, (
                f"row {row}: newest column holds {in_layers}, its host copy says {self._newest[row]}"
            )
        for layer in range(self.num_layers):
            order = self.lru[layer, row]
            assert torch.equal(torch.sort(order).values, hot_ids), (
                f"row {row} layer {layer}: lru not a permutation"
            )
            held = self.tokens[layer, row, : self.hot]
            valid = held[held >= 0]
            assert valid.unique().numel() == valid.numel(), f"row {row} layer {layer}: a position held twice"
            if seq_len <= self.hot:
                assert torch.equal(held, hot_ids), f"row {row} layer {layer}: short request lost its identity"
