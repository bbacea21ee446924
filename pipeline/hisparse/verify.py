"""Speculative verify on HiSparse memory: binding the verify tokens, and finalizing the accepted ones.

Verify binding (docs/invariants.md, "Verify binding and finalize"): verify token j of a request with ``n``
committed positions sits at position ``n + j``; its column is the position itself while ``n + j < HOT`` (the
identity hot column), else ``HOT + 1 + j`` in the draft zone, so drafts never pollute or evict hot rows. The
target writes its KV there and the token's logical location maps to that slot.

Finalize, per request, in this order:

1. read the slots of the accepted verify tokens, then clear the map of **every** verify location
   (rejected ones included) before anything else moves;
2. accepted positions below HOT map to their hot column; those at or past HOT keep no hot slot;
3. every accepted token's KV is backed up to host (one batched copy for the whole step);
4. the last accepted token's KV is copied into the newest column;
5. the draft zone is emptied.

A FULL row (dynamic residency) binds each verify token to its position's own slot; finalize unmaps
the rejected ones and keeps the accepted ones there, backed up as its pages fill (``commit_runs``).

If the host pool cannot take the accepted tokens (or taking them fails), finalize changes nothing
for that request and reports a ``FinalizeError``: no committed token is ever left without a host
copy. A request whose backup failed (this round's, redone alone and failed again, or an earlier
one) is reported the same way, and released by the caller: its KV lacks host copies.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kernels.kv_copy import copy_rows_unchecked
from pipeline.hisparse.residency import full_slots
from pipeline.memory.interface import Layout
from pipeline.memory.step_inputs import to_device
from pipeline.memory.targets import VerifyLayout, WriteTargets


class FinalizeError(RuntimeError):
    """Finalize could not back up a request's accepted tokens: its state was rolled back (or, when
    the copy itself failed, the tokens are committed without host copies)."""

    def __init__(self, row: int, reason: str, *, rolled_back: bool = True) -> None:
        self.row = row
        self.reason = reason
        super().__init__(
            f"request row {row}: finalize {'rolled back' if rolled_back else 'failed'}: {reason}"
        )


class VerifyTables(Protocol):
    """What verify binding and finalize use of the coordinator (its tables and streams)."""

    hot: int
    plan: Any  # MemoryPlan
    buffers: Any  # DeviceBuffers
    alloc: Any  # HiSparseAllocator
    host: Any  # HostPool
    counters: Any  # LayerCounters
    device_kv: torch.Tensor
    device: torch.device
    _mem: dict[int, Any]  # row -> RowMemory

    @property
    def req_to_token(self) -> torch.Tensor: ...

    def ensure_capacity(self, row: int, *, new_tokens: int, speculative: bool) -> None: ...

    def back_up(
        self, rows: list[int], counts: list[int], host_slots: torch.Tensor, dev_slots: torch.Tensor
    ) -> None: ...

    def commit_runs(self, rows: list[int], counts: list[int], slots: torch.Tensor) -> None: ...

    @property
    def layouts(self) -> Any: ...  # DynamicResidency

    def order_backups(self, upto: int) -> None: ...

    def take_backup_failures(self, rows: list[int]) -> dict[int, str]: ...


class VerifyBuffers:
    """Verify binding and finalize over one ``HiSparseCoordinator``'s tables (it delegates its
    ``prepare_verify`` / ``finalize_verify`` / ``take_failure`` verbs here)."""

    def __init__(self, coord: VerifyTables) -> None:
        self.coord = coord
        self._failures: dict[int, FinalizeError] = {}  # rolled-back finalizes, by row

    def prepare(self, rows: list[int], draft_tokens: int) -> VerifyLayout:
        """Bind the D verify tokens of each row to columns; raises ``OutOfMemory`` (nothing changed
        for the rows not yet handled). The rows' room is taken one by one; their columns, tokens
        and bindings are then written for all of them at once (the rows are distinct)."""
        coord, d = self.coord, draft_tokens
        for row in rows:  # (all first: a row's room may demote another row of the batch)
            coord.ensure_capacity(row, new_tokens=d, speculative=True)
        full = [i for i, row in enumerate(rows) if coord._mem[row].layout is Layout.FULL]
        if not full:
            locs, slots = self._bind_hot(rows, d)
            targets = WriteTargets(*to_device(coord.device, locs, slots))
            return VerifyLayout(targets, d, tuple(rows), tuple(slots.tolist()))
        hot = [i for i in range(len(rows)) if i not in set(full)]
        locs = torch.empty(len(rows), d, dtype=torch.int64)
        slots = torch.empty(len(rows), d, dtype=torch.int64)
        if hot:
            part_locs, part_slots = self._bind_hot([rows[i] for i in hot], d)
            locs[hot], slots[hot] = part_locs.reshape(-1, d), part_slots.reshape(-1, d)
        page = coord.plan.page_size
        for i in full:  # each verify token at its position's own slot
            mem = coord._mem[rows[i]]
            locs[i] = coord.req_to_token[rows[i], mem.length : mem.length + d]
            slots[i] = full_slots(mem.full_pages, page, mem.length, mem.length + d)
        coord.alloc.bind(locs[full].reshape(-1), slots[full].reshape(-1))
        targets = WriteTargets(*to_device(coord.device, locs.reshape(-1), slots.reshape(-1)))
        return VerifyLayout(targets, d, tuple(rows), tuple(slots.reshape(-1).tolist()))

    def _bind_hot(self, rows: list[int], d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bind the verify tokens of HOT rows (their room taken) to their columns; returns their
        locations and slots (``[B * D]`` each, host tensors: the slots are found from the rows'
        pages, ``DeviceBuffers.slot_of``, so nothing is read back from the device)."""
        coord = self.coord
        hot, buffers = coord.hot, coord.buffers
        lengths = []
        for row in rows:
            mem = coord._mem[row]
            coord.order_backups(mem.backup)  # last round's backup reads the draft zone this round overwrites
            lengths.append(mem.length)
        row_t = torch.tensor(rows, dtype=torch.int64)
        step = torch.arange(d)
        positions = torch.tensor(lengths, dtype=torch.int64)[:, None] + step  # [B, D]
        host_cols = torch.where(positions < hot, positions, hot + 1 + step)
        # (one asynchronous copy on CUDA: ``pipeline/memory/step_inputs.py``)
        row_d, cols, new = to_device(buffers.device, row_t, host_cols.reshape(-1), positions.reshape(-1))
        row_d = row_d[:, None]
        buffers.tokens[:, row_d, hot + 1 :] = -1
        buffers.tokens[:, row_d, cols.view(host_cols.shape)] = new.view(positions.shape).to(torch.int32)
        locs = coord.req_to_token[row_t[:, None], positions].reshape(-1)
        pairs = zip(rows, host_cols.tolist())
        slots = torch.tensor([buffers.slot_of(row, c) for row, cs in pairs for c in cs], dtype=torch.int64)
        coord.alloc.bind(locs, slots)
        return locs, slots

    def finalize(self, rows: list[int], accepted: list[int], layout: VerifyLayout) -> list[int]:
        """Commit ``accepted[i]`` verify tokens of ``rows[i]`` (the bonus included, >= 1).

        Returns the rows that failed (``take_failure`` says why; the caller releases them): rolled back, or
        committed with a backup that failed; the others are committed and backed up. Each row's host pages are
        taken one by one (a row the pool cannot take changes nothing); the module docstring's steps then run
        for all the committed rows at once, in its order (their rows, columns and locations are distinct, so
        no step of one row touches another's).
        """
        d = layout.draft_tokens
        if rows:
            self.coord.layouts.step()  # a decode step (the promotion's hysteresis counts them)
        if layout.host_slots is not None:  # (found on the host by ``prepare``: no read-back)
            flat = layout.host_slots
            verify_slots = [list(flat[i * d : (i + 1) * d]) for i in range(len(rows))]
        else:
            verify_slots = layout.targets.slots.cpu().reshape(len(rows), d).tolist()
        lost = self.coord.take_backup_failures(list(rows))  # an earlier backup failed: it cannot go on
        full = [i for i, row in enumerate(rows) if self.coord._mem[row].layout is Layout.FULL]
        if not full:
            return self._finalize_hot(rows, accepted, verify_slots, d, lost)
        hot = [i for i in range(len(rows)) if i not in set(full)]
        failed = self._finalize_full(
            [rows[i] for i in full], [accepted[i] for i in full], [verify_slots[i] for i in full], d, lost
        )
        if hot:
            failed += self._finalize_hot(
                [rows[i] for i in hot], [accepted[i] for i in hot], [verify_slots[i] for i in hot], d, lost
            )
        return failed

    def _reserve(self, row: int, count: int, lost: dict[int, str]) -> bool:
        """Host pages for ``count`` accepted tokens of ``row``; False (the row's finalize rolled back,
        nothing changed) when the row cannot go on or the host pool cannot take them."""
        if row in lost:
            self._failures[row] = FinalizeError(row, lost[row])
            return False
        try:  # (it changes nothing when the host pool is short: nothing happened to this row)
            self.coord.host.reserve(row, self.coord._mem[row].length + count)
        except Exception as exc:  # this row's finalize alone rolls back
            self._failures[row] = FinalizeError(row, f"{type(exc).__name__}: {exc}")
            return False
        return True

    def _finalize_full(
        self,
        rows: list[int],
        accepted: list[int],
        verify_slots: list[list[int]],
        d: int,
        lost: dict[int, str],
    ) -> list[int]:
        """Finalize of FULL rows: the accepted tokens stay at their own slots and are backed up as
        their pages fill (``commit_runs``), the rejected ones' locations are unmapped (their slots are
        written again by the next round)."""
        coord = self.coord
        committed, starts, counts, failed = [], [], [], []
        for row, count in zip(rows, accepted):
            if not self._reserve(row, count, lost):
                failed.append(row)
                continue
            committed.append(row)
            starts.append(coord._mem[row].length)
            counts.append(count)
        if not committed:
            return failed
        rejected = [
            coord.req_to_token[row, start + count : start + d]
            for row, start, count in zip(committed, starts, counts)
        ]
        coord.alloc.clear(torch.cat(rejected))
        by_row = dict(zip(rows, verify_slots))
        accepted_slots = [s for row, count in zip(committed, counts) for s in by_row[row][:count]]
        (written,) = to_device(coord.device, accepted_slots)
        coord.commit_runs(committed, counts, written)  # (backed up as a FULL row's pages fill)
        for row, why in coord.take_backup_failures(committed).items():
            failed.append(row)
            self._failures[row] = FinalizeError(row, why, rolled_back=False)
        return failed

    def _finalize_hot(
        self,
        rows: list[int],
        accepted: list[int],
        verify_slots: list[list[int]],
        d: int,
        lost: dict[int, str],
    ) -> list[int]:
        """Finalize of HOT rows (the module docstring's steps)."""
        coord = self.coord
        hot, buffers = coord.hot, coord.buffers
        committed, starts, counts, slots, failed = [], [], [], [], []
        for row, count, row_slots in zip(rows, accepted, verify_slots):
            mem = coord._mem[row]
            if not self._reserve(row, count, lost):
                failed.append(row)
                continue
            coord.order_backups(mem.backup)  # the newest column's last backup, before step 4 overwrites it
            committed.append(row)
            starts.append(mem.length)
            counts.append(count)
            slots.append(row_slots)
        if not committed:
            return failed
        # what the steps read, gathered for all rows: each newest column's token and every verify
        # location, then the slots of each row's newest column and of the hot columns of the
        # accepted positions below HOT (none read from the device: the buffers' host copies)
        newest = buffers.newest
        held = buffers.newest_of(committed)
        pos_rows = [row for row in committed for _ in range(d)]
        pos = [start + j for start in starts for j in range(d)]
        locs = coord.req_to_token[torch.tensor(pos_rows), torch.tensor(pos)].tolist()
        short = [
            (row, start + j)
            for row, start, count in zip(committed, starts, counts)
            for j in range(count - 1)
            if start + j < hot
        ]
        col_rows = committed + [row for row, _ in short]
        cols = [newest] * len(committed) + [p for _, p in short]
        found = [buffers.slot_of(row, col) for row, col in zip(col_rows, cols)]
        newest_slots, hot_slots = found[: len(committed)], iter(found[len(committed) :])
        # 1., 2. and 4.'s mappings as one write (the locations are distinct): every verify location
        # cleared, the accepted ones below HOT at their hot column, the last accepted one at the
        # newest column, and the token the newest column held keeps only its host copy
        values, moves, last_positions = [], [], []
        for i, (start, count) in enumerate(zip(starts, counts)):
            for j in range(d):
                if j == count - 1:
                    values.append(newest_slots[i])
                elif j < count and start + j < hot:
                    values.append(next(hot_slots))
                else:
                    values.append(0)
            last_slot = slots[i][count - 1]
            if last_slot != newest_slots[i]:
                moves.append((newest_slots[i], last_slot))
            last_positions.append(start + count - 1)
        # a held token is a committed one (below the row's start), so its location is none of the
        # verify locations this one write also sets
        held_at = [(row, h) for row, h, start in zip(committed, held, starts) if 0 <= h < start]
        held_locs = coord.req_to_token[
            torch.tensor([row for row, _ in held_at], dtype=torch.int64),
            torch.tensor([h for _, h in held_at], dtype=torch.int64),
        ].tolist()
        coord.alloc.bind(
            torch.tensor(locs + held_locs, dtype=torch.int64),
            torch.tensor(values + [0] * len(held_locs), dtype=coord.alloc.logical_to_physical.dtype),
        )
        host_slots = coord.host.record_runs(committed, starts, counts)  # 3. every accepted token
        if moves:  # 4. the last accepted token's row into the newest column
            # (rows of the coordinator's own pool to others of its rows: no argument to check)
            dst, src = zip(*moves)
            dst_d, src_d = to_device(coord.device, dst, src)
            copy_rows_unchecked(coord.device_kv, dst_d, coord.device_kv, src_d)
        # 4.'s newest column and 5.'s empty draft zone (which follows it), as one write
        zone = torch.full((len(committed), buffers.tokens.shape[-1] - newest), -1, dtype=buffers.tokens.dtype)
        zone[:, 0] = torch.tensor(last_positions, dtype=zone.dtype)
        row_d, zone_d = to_device(buffers.device, committed, zone.reshape(-1))
        buffers.tokens[:, row_d, newest:] = zone_d.view(zone.shape).to(zone.dtype)
        buffers.record_newest(committed, last_positions)
        for row, start, count in zip(committed, starts, counts):
            coord._mem[row].length = coord._mem[row].backed = start + count
        accepted_slots = [s for row_slots, count in zip(slots, counts) for s in row_slots[:count]]
        (backed,) = to_device(coord.device, accepted_slots)
        coord.back_up(committed, counts, host_slots, backed)
        for row, why in coord.take_backup_failures(committed).items():
            failed.append(row)
            self._failures[row] = FinalizeError(row, why, rolled_back=False)
        return failed

    def take_failure(self, row: int) -> FinalizeError | None:
        return self._failures.pop(row, None)
