"""Speculative verify on HiSparse memory: binding the verify tokens, and finalizing the accepted ones.

Verify binding (docs/invariants.md, "Verify binding and finalize"): verify token j of a request with ``n`` committed positions sits at
position ``n + j``; its column is the position itself while ``n + j < HOT`` (the identity hot column),
else ``HOT + 1 + j`` in the draft zone, so drafts never pollute or evict hot rows. The target writes
its KV there and the token's logical location maps to that slot.

Finalize, per request, in this order:

1. read the slots of the accepted verify tokens, then clear the map of **every** verify location
   (rejected ones included) before anything else moves;
2. accepted positions below HOT map to their hot column; those at or past HOT keep no hot slot;
3. every accepted token's KV is backed up to host (one batched copy for the whole step);
4. the last accepted token's KV is copied into the newest column;
5. the draft zone is emptied.

If the host pool cannot take the accepted tokens, finalize changes nothing for that request and
raises ``FinalizeError``: no committed token is ever left without a host copy.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kernels.kv_copy import copy_rows_unchecked
from pipeline.memory import OutOfMemory
from pipeline.memory.targets import VerifyLayout, WriteTargets


class FinalizeError(RuntimeError):
    """Finalize could not back up a request's accepted tokens; its state was rolled back."""

    def __init__(self, row: int, reason: str) -> None:
        self.row = row
        self.reason = reason
        super().__init__(f"request row {row}: finalize rolled back: {reason}")


class VerifyTables(Protocol):
    """What verify binding and finalize use of the coordinator (its tables and streams)."""

    hot: int
    buffers: Any  # DeviceBuffers
    alloc: Any  # HiSparseAllocator
    host: Any  # HostPool
    counters: Any  # LayerCounters
    device_kv: torch.Tensor
    device: torch.device
    _mem: dict[int, Any]  # row -> RowMemory
    _backup_stream: Any  # TransferStream

    @property
    def req_to_token(self) -> torch.Tensor: ...

    def ensure_capacity(self, row: int, *, new_tokens: int, speculative: bool) -> None: ...

    def _forget_newest(self, row: int) -> None: ...


class VerifyBuffers:
    """Verify binding and finalize over one ``HiSparseCoordinator``'s tables (it delegates its
    ``prepare_verify`` / ``finalize_verify`` / ``take_failure`` verbs here)."""

    def __init__(self, coord: VerifyTables) -> None:
        self.coord = coord
        self._failures: dict[int, FinalizeError] = {}  # rolled-back finalizes, by row

    def prepare(self, rows: list[int], draft_tokens: int) -> VerifyLayout:
        """Bind the D verify tokens of each row to columns; raises ``OutOfMemory`` (nothing changed
        for the rows not yet handled)."""
        hot, buffers = self.coord.hot, self.coord.buffers
        locs, slots = [], []
        for row in rows:
            self.coord.ensure_capacity(row, new_tokens=draft_tokens, speculative=True)
            mem = self.coord._mem[row]
            mem.backup.wait()  # last round's backup reads the draft zone this round overwrites
            n = mem.length
            positions = torch.arange(n, n + draft_tokens)
            cols = torch.where(positions < hot, positions, hot + 1 + torch.arange(draft_tokens))
            buffers.tokens[:, row, hot + 1 :] = -1
            buffers.tokens[:, row, cols.to(buffers.device)] = positions.to(torch.int32).to(buffers.device)
            row_locs = self.coord.req_to_token[row, n : n + draft_tokens]
            row_slots = buffers.locs[row, cols.to(buffers.device)]
            self.coord.alloc.bind(row_locs, row_slots.cpu())
            locs.append(row_locs)
            slots.append(row_slots)
        targets = WriteTargets(torch.cat(locs).to(self.coord.device), torch.cat(slots).to(self.coord.device))
        return VerifyLayout(targets, draft_tokens, tuple(rows))

    def finalize(self, rows: list[int], accepted: list[int], layout: VerifyLayout) -> list[int]:
        """Commit ``accepted[i]`` verify tokens of ``rows[i]`` (the bonus included, >= 1).

        Returns the rows that failed (their state rolled back, ``FinalizeError`` logged by the caller
        via ``failed``); the others are committed and backed up.
        """
        d, hot, buffers = layout.draft_tokens, self.coord.hot, self.coord.buffers
        slots = layout.targets.slots.cpu().reshape(len(rows), d)
        host_slots, dev_slots, failed = [], [], []
        for i, (row, count) in enumerate(zip(rows, accepted)):
            mem = self.coord._mem[row]
            n = mem.length
            verify_locs = self.coord.req_to_token[row, n : n + d]
            try:  # (it changes nothing when the host pool is short: nothing happened to this row)
                self.coord.host.reserve(row, n + count)
            except OutOfMemory as exc:
                failed.append(row)
                self._failures[row] = FinalizeError(row, str(exc))
                continue
            self.coord.alloc.clear(verify_locs)  # 1. every verify mapping, before anything moves
            positions = torch.arange(n, n + count)
            short = positions < hot  # 2. accepted positions below HOT keep their hot column
            self.coord.alloc.bind(
                verify_locs[:count][short], buffers.locs[row, positions[short].to(buffers.device)].cpu()
            )
            host_slots.append(self.coord.host.record(row, positions))  # 3. every accepted token
            dev_slots.append(slots[i, :count])
            self._move_to_newest(row, n + count - 1, slots[i, count - 1])  # 4.
            buffers.tokens[:, row, hot + 1 :] = -1  # 5.
            mem.length = n + count
        if host_slots:
            handle = self.coord._backup_stream.copy_rows(
                self.coord.host.kv, torch.cat(host_slots), self.coord.device_kv, torch.cat(dev_slots).to(self.coord.device)
            )
            self.coord.counters.add_backup(sum(len(h) for h in host_slots) * self.coord.host.row_bytes)
            for row in rows:
                if row not in failed:
                    self.coord._mem[row].backup = handle
        return failed

    def _move_to_newest(self, row: int, position: int, slot: torch.Tensor) -> None:
        """The last committed token's KV goes to the newest column, after the backup reading it."""
        buffers = self.coord.buffers
        newest = buffers.locs[row, buffers.newest]
        self.coord._mem[row].backup.wait()
        self.coord._forget_newest(row)
        if int(slot) != int(newest):
            # (one row of the coordinator's own pool to another of its rows: no argument to check)
            copy_rows_unchecked(self.coord.device_kv, newest.reshape(1), self.coord.device_kv,
                                slot.reshape(1).to(self.coord.device))
        buffers.tokens[:, row, buffers.newest] = position
        self.coord.alloc.bind(self.coord.req_to_token[row, position].reshape(1), newest.reshape(1).cpu())

    def take_failure(self, row: int) -> FinalizeError | None:
        return self._failures.pop(row, None)
