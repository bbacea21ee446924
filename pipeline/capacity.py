"""What a device holds: every device structure of the memory layer in bytes, and the seats they give.

The memory layer allocates a handful of device tensors; each one grows with one thing:

* a **device slot** (a physical KV row): the target's MLA rows, and with all-resident KV the
  indexer keys and the draft layer's rows too (a slot is a location there);
* a **logical location** (HiSparse only): the indexer keys of every target layer, which stay on the
  device for every token of every request, and the draft layer's indexer keys and rows (its KV is
  all resident; ``hisparse.draft_rows_on_host`` moves its rows to the host);
* a **request row**: the device copies of the token tables (``[rows, max_context_len + D]`` int64)
  and the HiSparse device buffers' bookkeeping (slots, held positions, LRU order).

Page 0 of each pool is reserved (the sink), so a pool of ``n`` usable slots allocates ``n + page``.
A ``MemoryPlan`` holds the pools' sizes in tokens, made once at start-up (``pipeline.startup``, which
sizes them with ``pipeline.pool_sizes``). ``device_structures`` lists the tensors for a
``MemoryPlan`` and a model's dimensions, and ``unit_costs`` prices a unit of each pool (what sizing
for a budget solves with); ``seats`` is how many requests of a context the pools hold at once, and
which pool stops it. ``DevicePlan`` is a plan's device side in bytes: ``hispec plan`` reports it,
and start-up checks the allocations against it.
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, Any

import attrs
import torch

from kernels import kv_fp8
from kernels.kv_fp8 import KVCacheFormat
from kernels.swap_in_policy import DEFAULT_POLICY
from pipeline.memory.arena import arena_layout, key_pages_in

if TYPE_CHECKING:
    from pipeline.model.config import ModelConfig

INT64, INT32 = 8, 4
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
SLOT, LOCATION, REQUEST, FIXED = "device slot", "logical location", "request", "fixed"
ARENA = "device arena (KV rows and indexer keys)"  # dynamic residency's one tensor for both


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def chunk_rows(*, hot: int, page_size: int, chunk: int, num_tokens: int) -> int:
    """HiSparse: device rows a prompt of ``num_tokens`` holds besides its buffer while it is
    prefilled in chunks of ``chunk`` (whole pages). A chunk's positions past HOT go first to the
    buffer's newest column and draft zone (one page), then to these rows."""
    beyond = min(chunk or num_tokens, num_tokens - hot)
    return max(0, round_up(beyond, page_size) - page_size) if beyond > 0 else 0


@attrs.frozen
class MemoryPlan:
    """The memory layer's sizes in tokens, derived once at start-up (``pipeline.startup``).

    Device buffer of one request (HOT = ``hot``, P = ``page_size``)::

        columns  0 ............ HOT-1 | HOT    | HOT+1 ... HOT+P-1
                 hot region (LRU)      | newest | draft zone (verify tokens)
    """

    page_size: int  # tokens per page, in every pool
    hot: int  # hot columns per request; 0 when HiSparse is off
    buffer_columns: int  # hot + page_size (the newest column and the draft zone); 0 when HiSparse is off
    top_k: int  # positions the model's indexer selects per step
    device_tokens: int  # usable physical slots (page 0, the sink, is extra)
    logical_tokens: int  # usable logical locations (page 0 extra)
    host_tokens: int  # host pool slots
    max_context_len: int  # tokens one request holds at most (prompt and output)
    max_running_requests: int  # request rows
    draft_tokens: int  # D, 0 without speculation
    hisparse: bool  # a device buffer per request over a host copy of every token (else all resident)
    # tokens of one request one prefill forward computes at most (chunked prefill; max_context_len
    # when prompts are prefilled whole)
    prefill_chunk: int = 0
    prefix_cache: bool = False  # finished requests' pages stay, found again by their tokens
    policy: str = DEFAULT_POLICY  # the hot region's replacement policy
    near_margin: int | None = None  # HiSparseConfig.near_margin (None: resolved per forward)
    # HiSparseConfig.residency: "always" (every decoding row HOT) or "dynamic" (a row FULL while the
    # device pool holds its whole context); "always" without HiSparse
    residency: str = "always"

    def chunk_area(self, num_tokens: int) -> int:
        """HiSparse: device rows a prompt of ``num_tokens`` holds besides its buffer while it is
        prefilled (whole pages). A chunk's positions past HOT go first to the buffer's newest column
        and draft zone (idle until decode), then to these rows."""
        return chunk_rows(hot=self.hot, page_size=self.page_size, chunk=self.prefill_chunk,
                          num_tokens=num_tokens)

    @property
    def logical_pages(self) -> int:
        return self.logical_tokens // self.page_size

    @property
    def host_pages(self) -> int:
        return self.host_tokens // self.page_size

    @property
    def max_request_len(self) -> int:
        """Locations one request may hold: its context plus the speculative over-allocation."""
        return self.max_context_len + self.draft_tokens

@attrs.frozen
class ModelDims:
    """What the memory layer's sizes need of a model (and the run's dtype, KV cache dtype and
    speculation)."""

    num_layers: int  # target layers
    row_dim: int  # one MLA row: latent + rope key (values)
    index_dim: int  # one indexer key (values)
    element_bytes: int  # of the run dtype
    mtp_layers: int = 0  # MTP layers whose KV is kept (0 without speculation)
    draft_rows_on_host: bool = False  # HiSparse: the draft layer's KV rows are host memory
    draft_keys_on_host: bool = False  # and its indexer keys too
    # bytes of one stored MLA row and one stored indexer key (None: the values in the run dtype;
    # an FP8 cache stores fewer, ``kernels.kv_fp8``)
    stored_row_bytes: int | None = None
    stored_key_bytes: int | None = None
    kv_cache_dtype: str = "auto"

    @property
    def row_bytes(self) -> int:
        """Bytes of one MLA row of one layer, as stored."""
        stored = self.stored_row_bytes
        return stored if stored is not None else self.row_dim * self.element_bytes

    @property
    def key_bytes(self) -> int:
        """Bytes of one indexer key of one layer, as stored."""
        stored = self.stored_key_bytes
        return stored if stored is not None else self.index_dim * self.element_bytes

    @classmethod
    def of(cls, model_cfg: ModelConfig, dtype: str, *, speculative: bool, draft_rows_on_host: bool = False,
           draft_keys_on_host: bool = False, kv_cache_dtype: str = "auto") -> ModelDims:
        """From a ``ModelConfig``; ``speculative``: the run drafts with the MTP layer."""
        quantized = kv_cache_dtype != "auto"
        return cls(
            num_layers=model_cfg.num_hidden_layers,
            row_dim=model_cfg.kv_row_dim,
            index_dim=model_cfg.index_head_dim,
            element_bytes=ELEMENT_BYTES[dtype],
            mtp_layers=model_cfg.num_nextn_predict_layers if speculative else 0,
            draft_rows_on_host=draft_rows_on_host and speculative,
            draft_keys_on_host=draft_keys_on_host and speculative,
            stored_row_bytes=(
                kv_fp8.row_bytes(model_cfg.kv_lora_rank, model_cfg.qk_rope_head_dim) if quantized else None
            ),
            stored_key_bytes=kv_fp8.key_bytes(model_cfg.index_head_dim) if quantized else None,
            kv_cache_dtype=kv_cache_dtype,
        )


def kv_format(model_cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KVCacheFormat:
    """How a model's MLA rows and indexer keys are stored in a run of ``dtype``."""
    return KVCacheFormat(
        latent=model_cfg.kv_lora_rank,
        rope=model_cfg.qk_rope_head_dim,
        index_dim=model_cfg.index_head_dim,
        dtype=dtype,
        kind=kv_cache_dtype,
    )


@attrs.frozen
class Structure:
    """One device tensor: its bytes, and what it grows with (``unit_bytes`` per ``unit``)."""

    name: str
    num_bytes: int
    unit: str  # SLOT, LOCATION or REQUEST
    unit_bytes: int  # bytes per unit (page 0 of a pool is counted in num_bytes)


@attrs.frozen
class Costs:
    """Device bytes per slot, per logical location and per request row, and the fixed part."""

    per_slot: int
    per_location: int
    per_request: int
    fixed: int

    def total(self, *, slots: int, locations: int, rows: int) -> int:
        return self.fixed + slots * self.per_slot + locations * self.per_location + rows * self.per_request


def _structures(
    *,
    hisparse: bool,
    page: int,
    hot: int,
    slots: int,
    locations: int,
    rows: int,
    max_len: int,
    dims: ModelDims,
    arena: bool = False,
) -> tuple[Structure, ...]:
    layers, row, idx = dims.num_layers, dims.row_bytes, dims.key_bytes
    table = max_len * INT64
    out: list[Structure] = []

    def add(name: str, unit: str, unit_bytes: int, units: int) -> None:
        out.append(Structure(name, unit_bytes * units, unit, unit_bytes))

    if not hisparse:
        all_layers = layers + dims.mtp_layers
        add("KV rows (target and draft layers)", SLOT, all_layers * row, slots + page)
        add("indexer keys", SLOT, all_layers * idx, slots + page)
        add("token table", REQUEST, table, rows)
        return tuple(out)
    cols = hot + page
    located = locations + page  # logical rows, page 0 included
    if arena:  # dynamic residency: the keys are a view of the rows' memory (pipeline/memory/arena.py)
        c, frames, view = arena_layout(row, idx, slots // page + 1, locations // page)
        add(ARENA, SLOT, layers * row, frames * c * page)
        located = view * page  # (a few key pages straddle two frames: never used)
    else:
        add("device KV rows", SLOT, layers * row, slots + page)
        add("indexer keys (every logical location)", LOCATION, layers * idx, locations + page)
    add("device buffer slots", REQUEST, cols * INT64, rows)
    add("device buffer positions", REQUEST, layers * cols * INT32, rows)
    add("device buffer LRU", REQUEST, layers * hot * INT32, rows)
    add("token table", REQUEST, table, rows)
    add("host map", REQUEST, table, rows)
    if dims.mtp_layers:  # one all-resident pool for the draft layer, by logical location (the token table's)
        if not dims.draft_rows_on_host:
            add("draft layer KV rows", LOCATION, row, located)
        if not dims.draft_keys_on_host:
            add("draft layer indexer keys", LOCATION, idx, located)
    return tuple(out)


def _costs(structures: tuple[Structure, ...], page: int) -> Costs:
    per = {
        unit: sum(s.unit_bytes for s in structures if s.unit == unit) for unit in (SLOT, LOCATION, REQUEST)
    }
    fixed = page * (per[SLOT] + per[LOCATION])  # page 0 of each pool
    return Costs(per[SLOT], per[LOCATION], per[REQUEST], fixed)


def unit_costs(*, hisparse: bool, page: int, hot: int, max_len: int, dims: ModelDims) -> Costs:
    """What the pools of this shape cost per unit (``max_len``: locations one request may hold),
    whatever their sizes."""
    probe = _structures(
        hisparse=hisparse, page=page, hot=hot, slots=0, locations=0, rows=0, max_len=max_len, dims=dims
    )
    return _costs(probe, page)


def arena_bytes(
    *, page: int, hot: int, slots: int, locations: int, rows: int, max_len: int, dims: ModelDims
) -> int:
    """Device bytes of a dynamic-residency memory layer (one arena for the rows and the keys) with
    these pools: what ``pipeline.pool_sizes.dynamic_split`` fits to a budget."""
    found = _structures(hisparse=True, page=page, hot=hot, slots=slots, locations=locations, rows=rows,
                        max_len=max_len, dims=dims, arena=True)
    return sum(s.num_bytes for s in found)


def device_structures(plan: MemoryPlan, dims: ModelDims) -> tuple[Structure, ...]:
    """Every device tensor the memory layer allocates for ``plan``."""
    return _structures(
        hisparse=plan.hisparse,
        page=plan.page_size,
        hot=plan.hot,
        slots=plan.device_tokens,
        locations=plan.logical_tokens,
        rows=plan.max_running_requests,
        max_len=plan.max_request_len,
        dims=dims,
        arena=plan.hisparse and plan.residency == "dynamic",
    )


@attrs.frozen
class Seats:
    """How many requests of ``context`` tokens the pools hold at once, and what stops one more."""

    context: int
    seats: int  # min over the pools (request rows not counted)
    by_pool: dict[str, int]  # pool -> requests it holds
    limit: str  # the pool that caps ``seats``
    rows: int  # request rows the engine has (max_running_requests)

    @property
    def running(self) -> int:
        """Requests that can run at once: the seats, capped by the request rows."""
        return min(self.seats, self.rows)


def seats(plan: MemoryPlan, context: int) -> Seats:
    """Requests of ``context`` tokens (prompt and output) the pools of ``plan`` hold at once.

    All-resident: every position of every request has a device slot. HiSparse: every position has
    a logical location (its indexer keys) and a host slot; on the device a request holds its
    buffer (HOT + page columns), and one prompt at a time holds the rows of a prefill chunk.
    """
    page = plan.page_size
    need = round_up(context + plan.draft_tokens, page)
    if not plan.hisparse:
        by_pool = {"device slots": plan.device_tokens // need}
    else:
        chunk = chunk_rows(hot=plan.hot, page_size=page, chunk=plan.prefill_chunk, num_tokens=context)
        by_pool = {
            "device slots (buffers)": max(0, plan.device_tokens - chunk) // plan.buffer_columns,
            "logical locations": plan.logical_tokens // need,
            "host slots": plan.host_tokens // need,
        }
    limit = min(by_pool, key=by_pool.__getitem__)
    return Seats(context, by_pool[limit], by_pool, limit, plan.max_running_requests)


@attrs.frozen
class LoadStep:
    """A dynamic engine holding ``requests`` requests of one context at once: how many are FULL."""

    requests: int
    full: int  # FULL rows: every position in a device slot (no hot buffer)
    hot: int  # HOT rows: the hot buffer over the host copy
    device_slots: int  # KV rows the requests hold in the arena (FULL contexts, HOT buffers)


@attrs.frozen
class ArenaSpace:
    """The device arena of a dynamic plan in whole frames (``pipeline.memory.arena``): what the
    indexer keys of ``requests`` requests leave to KV rows. Frame 0 is reserved; the keys take the
    lowest frames (a frame holds ``c * R / K`` key pages, less any that straddle two frames), the
    rows whole frames of ``c`` pages from the rest."""

    pages_per_frame: int  # c
    num_frames: int  # frame 0 included
    # key frames[n]: the fewest frames from frame 1 whose key pages number n or more
    key_frames: tuple[int, ...]

    @classmethod
    def of(cls, plan: MemoryPlan, row_bytes: int, key_bytes: int) -> ArenaSpace:
        page = plan.page_size
        c, frames, _view = arena_layout(row_bytes, key_bytes, plan.device_tokens // page + 1,
                                        plan.logical_tokens // page)
        key_frames, held = [0], 0
        for frame in range(1, frames):
            pages = key_pages_in(frame, c, row_bytes, key_bytes, 1 << 62)
            key_frames += [frame] * len(pages)  # the key pages held + 1 .. + len(pages) need ``frame`` frames
            held += len(pages)
            if held >= plan.logical_pages:
                break
        return cls(c, frames, tuple(key_frames))

    def row_pages(self, key_pages: int) -> int:
        """Physical pages left to KV rows once ``key_pages`` key pages are held."""
        key_frames = self.key_frames[min(key_pages, len(self.key_frames) - 1)]
        return (self.num_frames - 1 - key_frames) * self.pages_per_frame


def full_rows(plan: MemoryPlan, context: int, requests: int, *, row_bytes: int, key_bytes: int) -> int:
    """FULL rows among ``requests`` requests of ``context`` tokens held at once (dynamic residency):
    the most the device arena holds beside every request's indexer keys, the others' hot buffers
    and, while any request is HOT, one prefill chunk's rows (as ``seats`` counts them). Per layer a
    FULL request of ``need`` positions holds ``need * (R + K)`` bytes of the arena, a HOT one
    ``need * K + buffer_columns * R`` (``R``, ``K``: ``row_bytes``, ``key_bytes``), in whole frames
    (``ArenaSpace``). 0 in ``residency="always"``."""
    if not plan.hisparse or plan.residency != "dynamic":
        return 0
    return _full_rows(plan, context, requests, ArenaSpace.of(plan, row_bytes, key_bytes))


def _full_rows(plan: MemoryPlan, context: int, requests: int, arena: ArenaSpace) -> int:
    page = plan.page_size
    need = round_up(context + plan.draft_tokens, page)
    rows = arena.row_pages(requests * need // page) * page  # KV rows the requests' keys leave
    if requests * need <= rows:
        return requests
    chunk = chunk_rows(hot=plan.hot, page_size=page, chunk=plan.prefill_chunk, num_tokens=context)
    extra = need - plan.buffer_columns  # what a FULL row holds beyond a HOT one
    if extra <= 0:  # a FULL row holds no more than a HOT one: as many FULL as the rows hold
        return rows // need
    room = rows - chunk - requests * plan.buffer_columns
    return max(0, min(requests - 1, room // extra))


def load_steps(plan: MemoryPlan, context: int, *, row_bytes: int, key_bytes: int) -> list[LoadStep]:
    """How a dynamic engine moves from all-FULL to all-HOT as requests of ``context`` tokens arrive,
    from one request to the seats: one request, the most that are all FULL and one more, each load
    where the FULL count falls, the first that is all HOT, and the seats (``full_rows``)."""
    page = plan.page_size
    need = round_up(context + plan.draft_tokens, page)
    last = seats(plan, context).running
    arena = ArenaSpace.of(plan, row_bytes, key_bytes)
    full = {k: _full_rows(plan, context, k, arena) for k in range(last + 1)}
    all_full = max(k for k in full if full[k] == k)
    all_hot = min((k for k in full if k and full[k] == 0), default=last)
    drops = {k for k in range(1, last + 1) if full[k] < full[k - 1]}
    shown = sorted(k for k in {1, all_full, all_full + 1, all_hot, last} | drops if 1 <= k <= last)
    return [LoadStep(k, full[k], k - full[k], full[k] * need + (k - full[k]) * plan.buffer_columns)
            for k in shown]


def check_allocations(structures: tuple[Structure, ...], tensors: dict[str, Any]) -> None:
    """Start-up check: the memory layer allocated exactly the device tensors the plan lists."""
    planned = {s.name: s.num_bytes for s in structures}
    allocated = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    if planned != allocated:
        raise AssertionError(
            f"device allocations differ from the memory plan: planned {planned}, allocated {allocated}"
        )


def format_bytes(n: int) -> str:
    value, unit = float(n), "B"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if value < 1000 or unit == "PB":
            break
        value /= 1000
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


@attrs.frozen
class DevicePlan:
    """The device side of a ``MemoryPlan``: its structures in bytes, the budget, and the seats."""

    plan: MemoryPlan
    dims: ModelDims
    structures: tuple[Structure, ...]  # every device tensor the memory layer allocates for ``plan``
    budget: int | None  # the device memory budget in bytes (None: the pools were sized in tokens)

    @classmethod
    def of(cls, plan: MemoryPlan, dims: ModelDims, budget: int | None) -> DevicePlan:
        return cls(plan, dims, device_structures(plan, dims), budget)

    @property
    def total_bytes(self) -> int:
        return sum(s.num_bytes for s in self.structures)

    def check(self, tensors: dict[str, Any]) -> None:
        """Start-up: the memory layer's device tensors are the plan's, and within the budget."""
        check_allocations(self.structures, tensors)
        if self.budget is not None and self.total_bytes > self.budget:
            raise AssertionError(
                f"the memory plan takes {self.total_bytes} bytes, over the budget {self.budget}"
            )

    def seats(self, context: int) -> Seats:
        return seats(self.plan, context)

    def kv_cache(self) -> dict[str, object]:
        """How KV is stored and what it takes: the stored bytes of one MLA row and one indexer key
        of one layer, the device bytes of the memory layer, and the host pool's (HiSparse)."""
        dims, plan = self.dims, self.plan
        return {
            "dtype": dims.kv_cache_dtype,
            "row_bytes": dims.row_bytes,
            "key_bytes": dims.key_bytes,
            "device_bytes": self.total_bytes,
            "host_bytes": dims.num_layers * plan.host_tokens * dims.row_bytes,
        }

    def _held(self, *, slots: int, locations: int, rows: int) -> dict[str, int]:
        """Device bytes of each structure that ``rows`` requests holding ``slots`` KV rows and
        ``locations`` logical locations take (the arena holds the locations' indexer keys too)."""
        units = {SLOT: slots, LOCATION: locations, REQUEST: rows}
        keys = self.dims.num_layers * self.dims.key_bytes * locations
        return {s.name: s.unit_bytes * units[s.unit] + (keys if s.name == ARENA else 0)
                for s in self.structures}

    def request_bytes(self, context: int) -> dict[str, int]:
        """Device bytes one request of ``context`` tokens holds in each structure (once decoding; a
        HiSparse request HOT)."""
        plan = self.plan
        locations = round_up(context + plan.draft_tokens, plan.page_size)
        slots = plan.buffer_columns if plan.hisparse else locations
        return self._held(slots=slots, locations=locations, rows=1)

    def load_steps(self, context: int) -> list[LoadStep]:
        """Dynamic residency: ``load_steps`` of this plan's arena."""
        return load_steps(self.plan, context, row_bytes=self.dims.row_bytes, key_bytes=self.dims.key_bytes)

    def full_seats(self, context: int) -> int:
        """Dynamic residency: the most requests of ``context`` tokens that are all FULL at once
        (within the seats; 0 in ``residency="always"``)."""
        if not self.plan.hisparse or self.plan.residency != "dynamic":
            return 0
        arena = ArenaSpace.of(self.plan, self.dims.row_bytes, self.dims.key_bytes)
        running = self.seats(context).running
        return max(k for k in range(running + 1) if _full_rows(self.plan, context, k, arena) == k)

    def load_table(self, context: int) -> list[dict[str, int]]:
        """Dynamic residency: ``load_steps`` with the device bytes the requests hold at each load (the
        arena's FULL rows, HOT buffers and every location's indexer keys, and the rows' bookkeeping)."""
        plan = self.plan
        locations = round_up(context + plan.draft_tokens, plan.page_size)
        return [
            {**attrs.asdict(step),
             "device_bytes": sum(self._held(slots=step.device_slots, locations=step.requests * locations,
                                            rows=step.requests).values())}
            for step in self.load_steps(context)
        ]

    def largest(self, context: int) -> tuple[str, float]:
        """The structure that takes most of a request's device bytes, and its share."""
        held = self.request_bytes(context)
        name = max(held, key=held.__getitem__)
        return name, held[name] / max(1, sum(held.values()))

    def as_dict(self, context: int) -> dict[str, object]:
        s = self.seats(context)
        name, share = self.largest(context)
        return {
            "budget_bytes": self.budget,
            "total_bytes": self.total_bytes,
            "device_pool_tokens": self.plan.device_tokens,
            "logical_tokens": self.plan.logical_tokens,
            "max_running_requests": self.plan.max_running_requests,
            "structures": [attrs.asdict(x) for x in self.structures],
            "request_bytes": self.request_bytes(context),
            "seats": s.seats,
            "running": s.running,
            "seats_by_pool": s.by_pool,
            "seat_limit": s.limit,
            "largest_structure": name,
            "largest_share": share,
            "residency": self.plan.residency,
            **({"load_steps": self.load_table(context)} if self.plan.residency == "dynamic" else {}),
        }


UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    """``123``, ``64MB``, ``1.5GiB`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 512MB, 2GiB, 1000000)")
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])
