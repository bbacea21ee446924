"""Exact shadow models for the state machines: where every position of every live request must be.

A state machine keeps one ``PositionModel`` per live request and updates it from what each rule did
(a prompt prefilled in these chunks, staging collected, a position decoded into this column, these
verify tokens accepted), by the rules of docs/invariants.md, never by reading the structures it
checks. After every rule ``check_tables`` asserts that the real tables equal the model, entry for
entry and for every request at once (so a stale entry left by a request that ended shows too):

* the token table: position ``p`` of a row has the ``p``-th location of the row's logical pages,
  every other entry 0;
* the host map: a committed position has the ``p``-th slot of the row's host pages, every other
  entry -1;
* the map from logical locations to device slots: a position the model says is mapped maps to
  exactly that slot, and every other location (free ones, a live request's unmapped positions)
  maps to 0;
* with a coordinator (``check_buffers``), the newest column of every layer holds the position the
  model says, the draft zone is empty between rounds, and a row that is not live holds no column.

A draft layer's row of a position is that position's logical location (the draft pool reads the
target's token table), so the token table's check covers the draft rows too. Which positions a long
request's hot columns hold is the replacement policy's choice, not the model's: those columns are
checked by their data, against the all-resident shadow (``shadowed_machine``), and by I4.

The pages a request got are taken from its table (the allocators' own checks say the row owns
them); the slots of a buffer's columns from ``DeviceBuffers.locs`` (checked against the row's pages
by the coordinator's I3); the positions and slots are the model's.
"""

from __future__ import annotations

import attrs
import torch
from hypothesis import settings

from pipeline.chunking import plan_chunks
from pipeline.memory import page_slots


def machine_settings(*, examples: int, steps: int) -> settings:
    """A state machine's settings: ``examples`` runs of up to ``steps`` rules under the ``ci`` profile
    (tests/conftest.py), scaled as the loaded profile scales hypothesis's defaults (100 examples,
    50 steps): ``HYPOTHESIS_PROFILE=thorough`` runs many more, and longer ones."""
    base = settings()  # the loaded profile's
    return settings(
        max_examples=max(1, examples * base.max_examples // 100),
        stateful_step_count=max(1, steps * base.stateful_step_count // 50),
        deadline=None,
    )


@attrs.define
class PositionModel:
    """One live request: its row, committed positions and where its locations must map."""

    row: int
    length: int = 0  # committed positions, each with a host copy recorded
    device: dict[int, int] = attrs.Factory(dict)  # position -> slot it maps to; absent: 0
    newest: int = -1  # the position the newest column holds in every layer (-1: none)


def last_chunk_start(length: int, budget: int | None, chunk: int | None) -> int:
    """The first position of the last chunk a prompt of ``length`` is prefilled in, alone."""
    done = 0
    while True:
        (piece,) = plan_chunks([("x", done, length)], budget, chunk)
        if piece.end >= length:
            return piece.start
        done = piece.end


def _describe(models: dict[str, PositionModel], table: torch.Tensor, loc: int) -> str:
    for rid, model in models.items():
        hits = torch.nonzero(table[model.row] == loc).reshape(-1)
        if hits.numel():
            return f"location {loc} (position {int(hits[0])} of {rid})"
    return f"location {loc} (no live request's)"


def check_tables(models: dict[str, PositionModel], alloc, host_map, *, what: str = "") -> None:
    """The token table, the host map and the logical-to-physical map equal the model."""
    page = alloc.page_size
    table = alloc.req_to_token.table
    want_table = torch.zeros_like(table)
    want_host = torch.full_like(host_map.table, -1)
    mapping = alloc.logical_to_physical
    want_map = torch.zeros_like(mapping)
    want_map[-1] = -1
    for rid, model in models.items():
        row, max_len = model.row, table.shape[1]
        locs = page_slots(alloc.req_to_token.pages(row), page)[:max_len]
        want_table[row, : locs.numel()] = locs
        host = page_slots(host_map.pages(row), page)
        assert host.numel() >= model.length, f"{what}{rid}: {host.numel()} host slots for {model.length}"
        want_host[row, : model.length] = host[: model.length]
        for pos, slot in model.device.items():
            assert pos < locs.numel(), f"{what}{rid}: position {pos} mapped but has no location"
            want_map[locs[pos]] = slot
    bad = torch.nonzero((table != want_table).any(dim=1)).reshape(-1)
    assert bad.numel() == 0, f"{what}token table row {int(bad[0])} differs from the model"
    diff = torch.nonzero(host_map.table != want_host)
    if diff.numel():
        row, pos = diff[0].tolist()
        raise AssertionError(
            f"{what}host map row {row} position {pos}: {int(host_map.table[row, pos])}, "
            f"the model says {int(want_host[row, pos])}"
        )
    diff = torch.nonzero(mapping != want_map).reshape(-1)
    assert diff.numel() == 0, (
        f"{what}{_describe(models, table, int(diff[0]))} maps to slot {int(mapping[diff[0]])}, "
        f"the model says {int(want_map[diff[0]])}"
    )


def check_buffers(models: dict[str, PositionModel], buffers, *, what: str = "") -> None:
    """The newest column and the draft zone of every live row equal the model; other rows hold none."""
    tokens = buffers.tokens.cpu()
    newest = buffers.newest
    live = {model.row for model in models.values()}
    for rid, model in models.items():
        held = tokens[:, model.row, newest]
        assert bool((held == model.newest).all()), (
            f"{what}{rid}: the newest column holds {held.tolist()}, the model says {model.newest}"
        )
        zone = tokens[:, model.row, newest + 1 :]
        assert bool((zone == -1).all()), f"{what}{rid}: the draft zone holds {zone.tolist()} between rounds"
    for row in range(buffers.num_rows):
        if row not in live:
            assert bool((tokens[:, row] == -1).all()), f"{what}row {row} is not live and holds columns"
            assert bool((buffers.locs[row] == -1).all()), f"{what}row {row} is not live and holds slots"


def prefilled(model: PositionModel, length: int, start: int, hot: int, area: torch.Tensor, cols: list[int]):
    """A prompt of ``length`` whose last chunk started at ``start``: that chunk's positions map to
    their identity column below HOT (``cols``: the buffer's column slots), else to the chunk area
    in order; the earlier chunks' positions to nothing (read through swap-in); all recorded."""
    model.length = length
    model.device = {
        pos: (cols[pos] if pos < hot else int(area[pos - max(start, hot)])) for pos in range(start, length)
    }


def decoded(model: PositionModel, hot: int, cols: list[int]) -> None:
    """One decode step: the new position maps to its identity column while below HOT, else to the
    newest column, whose previous position keeps only its host copy."""
    pos = model.length
    if pos < hot:
        model.device[pos] = cols[pos]
    else:
        model.device.pop(model.newest, None)
        model.device[pos] = cols[hot]
        model.newest = pos
    model.length += 1


def verify_columns(length: int, draft_tokens: int, hot: int) -> list[int]:
    """The column of each verify token of a request holding ``length`` positions."""
    return [length + j if length + j < hot else hot + 1 + j for j in range(draft_tokens)]


def finalized(model: PositionModel, count: int, draft_tokens: int, hot: int, cols: list[int]) -> None:
    """Finalize of ``count`` accepted verify tokens (the bonus included): accepted positions below
    HOT keep their hot column, the last accepted one maps to the newest column, every other verify
    location (the rejected ones) and the position the newest column held map to nothing."""
    start = model.length
    if 0 <= model.newest < start:
        model.device.pop(model.newest, None)
    for j in range(draft_tokens):
        pos = start + j
        if j == count - 1:
            model.device[pos] = cols[hot]
        elif j < count and pos < hot:
            model.device[pos] = cols[pos]
        else:
            model.device.pop(pos, None)
    model.newest = start + count - 1
    model.length = start + count
