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
sizes them with ``size_pools`` and checks them with ``check_pools``).
``device_structures`` lists them for a ``MemoryPlan`` and a model's dimensions; ``size_for_budget``
solves the other way round: from a budget in bytes, the device pool (in slots) and the request
rows, spending the budget on as many requests of ``max_context_len`` as fit and the rest on
slots. ``seats`` is how many requests of a context the pools hold at once, and which pool stops it.

The budget covers the KV memory layer only: the weights and a forward's activations are outside
it (on CUDA, ``device_memory_fraction`` takes a fraction of the memory free once the weights are
loaded).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import attrs
import structlog

from kernels.swap_in_policy import DEFAULT_POLICY
from pipeline.errors import ConfigError

log = structlog.get_logger("hispec.config")

INT64, INT32 = 8, 4
# host_to_device_ratio without a budget (HiSparseConfig's None), and the largest a budget chooses
DEFAULT_RATIO, MAX_RATIO = 4, 64
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
SLOT, LOCATION, REQUEST, FIXED = "device slot", "logical location", "request", "fixed"


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def chunk_rows(*, hot: int, page_size: int, chunk: int, num_tokens: int) -> int:
    """HiSparse: device rows a prompt of ``num_tokens`` holds besides its buffer while it is
    prefilled in chunks of ``chunk`` (whole pages). A chunk's positions past HOT go first to the
    buffer's newest column and draft zone (one page), then to these rows."""
    beyond = min(chunk or num_tokens, num_tokens - hot)
    return max(0, round_up(beyond, page_size) - page_size) if beyond > 0 else 0



def prefill_chunk(chunk: int | None, max_context_len: int | None) -> int:
    """Tokens of one request one prefill forward computes at most (0 while the context is unknown)."""
    if max_context_len is None:
        return chunk or 0
    return max_context_len if chunk is None else min(chunk, max_context_len)


def check_pools(
    *,
    hisparse: bool,
    page_size: int,
    hot: int,
    draft_tokens: int,
    device_pool_tokens: int | None,
    max_context_len: int | None,
    host_to_device_ratio: int | None,
    chunked_prefill_tokens: int | None,
) -> None:
    """The pools hold one request of max_context_len: the rules that bind the sizes together.

    ``EngineConfig`` checks them on the sizes it was given (a None is a size a budget or the model
    decides, checked once start-up knows it); start-up checks them again on the plan's sizes.
    ``hot``: HOT, or the least it can become. Raises ``ConfigError`` naming the field.
    """
    page = page_size
    if not hisparse:
        if max_context_len is not None and device_pool_tokens is not None:
            need = round_up(max_context_len + draft_tokens, page)
            if device_pool_tokens < need:
                raise ConfigError(
                    "device_pool_tokens", device_pool_tokens,
                    f"without HiSparse every token is resident: must hold one request of max_context_len "
                    f"plus the draft tokens ({need})",
                )
        return
    if device_pool_tokens is None:
        return
    buffer_columns = hot + page
    if device_pool_tokens < buffer_columns:
        raise ConfigError("device_pool_tokens", device_pool_tokens,
                          f"must hold one device buffer (device_buffer_size + page_size = {buffer_columns})")
    if max_context_len is None:
        return
    chunk = max_context_len if chunked_prefill_tokens is None else chunked_prefill_tokens
    beyond = min(chunk, max_context_len - hot)  # a chunk's rows past HOT: newest, draft zone, more
    prefill = max(buffer_columns, hot + round_up(beyond, page))
    what = (
        "a prompt of max_context_len is prefilled whole"
        if chunked_prefill_tokens is None or chunk >= max_context_len
        else f"a prompt is prefilled in chunks of chunked_prefill_tokens ({chunk})"
    )
    if device_pool_tokens < prefill:
        raise ConfigError(
            "device_pool_tokens", device_pool_tokens,
            f"{what}: the device pool must hold one request's hot region and the chunk's rows past "
            f"it ({prefill}); lower chunked_prefill_tokens or raise device_pool_tokens",
        )
    if host_to_device_ratio is None:
        return
    logical = device_pool_tokens * host_to_device_ratio
    need = round_up(max_context_len + draft_tokens, page)
    if logical < need:
        raise ConfigError(
            "hisparse.host_to_device_ratio", host_to_device_ratio,
            f"the logical and host pools (device_pool_tokens * ratio = {logical}) must hold one request "
            f"of max_context_len plus the draft tokens ({need})",
        )


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
    """What the memory layer's sizes need of a model (and the run's dtype and speculation)."""

    num_layers: int  # target layers
    row_dim: int  # one MLA row: latent + rope key
    index_dim: int  # one indexer key
    element_bytes: int  # of the run dtype (KV rows and indexer keys are stored in it)
    mtp_layers: int = 0  # MTP layers whose KV is kept (0 without speculation)
    draft_rows_on_host: bool = False  # HiSparse: the draft layer's KV rows are host memory
    draft_keys_on_host: bool = False  # and its indexer keys too

    @classmethod
    def of(cls, model_cfg: Any, dtype: str, *, speculative: bool, draft_rows_on_host: bool = False,
           draft_keys_on_host: bool = False) -> ModelDims:
        """From a ``ModelConfig``; ``speculative``: the run drafts with the MTP layer."""
        return cls(
            num_layers=model_cfg.num_hidden_layers,
            row_dim=model_cfg.kv_row_dim,
            index_dim=model_cfg.index_head_dim,
            element_bytes=ELEMENT_BYTES[dtype],
            mtp_layers=model_cfg.num_nextn_predict_layers if speculative else 0,
            draft_rows_on_host=draft_rows_on_host and speculative,
            draft_keys_on_host=draft_keys_on_host and speculative,
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
    *, hisparse: bool, page: int, hot: int, slots: int, locations: int, rows: int, max_len: int, dims: ModelDims
) -> tuple[Structure, ...]:
    e, layers, row, idx = dims.element_bytes, dims.num_layers, dims.row_dim, dims.index_dim
    table = max_len * INT64
    out: list[Structure] = []

    def add(name: str, unit: str, unit_bytes: int, units: int) -> None:
        out.append(Structure(name, unit_bytes * units, unit, unit_bytes))

    if not hisparse:
        all_layers = layers + dims.mtp_layers
        add("KV rows (target and draft layers)", SLOT, all_layers * row * e, slots + page)
        add("indexer keys", SLOT, all_layers * idx * e, slots + page)
        add("token table", REQUEST, table, rows)
        return tuple(out)
    cols = hot + page
    add("device KV rows", SLOT, layers * row * e, slots + page)
    add("indexer keys (every logical location)", LOCATION, layers * idx * e, locations + page)
    add("device buffer slots", REQUEST, cols * INT64, rows)
    add("device buffer positions", REQUEST, layers * cols * INT32, rows)
    add("device buffer LRU", REQUEST, layers * hot * INT32, rows)
    add("token table", REQUEST, table, rows)
    add("host map", REQUEST, table, rows)
    if dims.mtp_layers:  # one all-resident pool for the draft layer, by logical location (the token table's)
        if not dims.draft_rows_on_host:
            add("draft layer KV rows", LOCATION, row * e, locations + page)
        if not dims.draft_keys_on_host:
            add("draft layer indexer keys", LOCATION, idx * e, locations + page)
    return tuple(out)


def _costs(structures: tuple[Structure, ...], page: int) -> Costs:
    per = {unit: sum(s.unit_bytes for s in structures if s.unit == unit) for unit in (SLOT, LOCATION, REQUEST)}
    fixed = page * (per[SLOT] + per[LOCATION])  # page 0 of each pool
    return Costs(per[SLOT], per[LOCATION], per[REQUEST], fixed)


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


# --- sizing from a budget ----------------------------------------------------------------------


@attrs.frozen
class Shape:
    """What sizing needs of a config besides the model: the pools' shape, not their size."""

    hisparse: bool
    page: int
    hot: int  # 0 without HiSparse
    ratio: int  # logical (and host) locations per device slot; 1 without HiSparse
    draft_tokens: int  # D
    chunk: int  # tokens one prefill forward computes of one request (the whole context if unchunked)
    context: int  # max_context_len

    @property
    def max_len(self) -> int:
        return self.context + self.draft_tokens

    def costs(self, dims: ModelDims) -> Costs:
        probe = _structures(
            hisparse=self.hisparse, page=self.page, hot=self.hot, slots=0, locations=0, rows=0,
            max_len=self.max_len, dims=dims,
        )
        return _costs(probe, self.page)

    def slots_for(self, rows: int) -> int:
        """Device slots ``rows`` requests of max_context_len need at once (0 rows: none)."""
        if rows == 0:
            return 0
        need = round_up(self.max_len, self.page)
        if not self.hisparse:
            return rows * need
        chunk = chunk_rows(hot=self.hot, page_size=self.page, chunk=self.chunk, num_tokens=self.context)
        buffers = rows * (self.hot + self.page) + chunk
        return round_up(max(buffers, -(-rows * need // self.ratio)), self.page)

    def bytes_for(self, dims: ModelDims, *, slots: int, rows: int) -> int:
        return self.costs(dims).total(slots=slots, locations=slots * self.ratio if self.hisparse else 0, rows=rows)


def size_for_budget(
    budget: int, shape: Shape, dims: ModelDims, *, slots: int | None = None, rows: int | None = None
) -> tuple[int, int]:
    """(device_pool_tokens, max_running_requests) that spend ``budget`` bytes of device memory.

    ``slots`` / ``rows`` given are kept (token-count overrides); a missing one is solved for: rows
    as the requests of max_context_len the pools hold at once (and the budget pays for), slots as
    what the budget has left once the rows are paid (whole pages). Raises ``ConfigError`` naming
    ``device_memory_bytes`` when the budget holds no request of max_context_len, saying how much
    one needs.
    """
    one = shape.bytes_for(dims, slots=shape.slots_for(1), rows=1)
    if budget < one:
        raise ConfigError(
            "device_memory_bytes",
            budget,
            f"holds no request of max_context_len ({shape.context}): one needs {one} bytes "
            f"({format_bytes(one)}) of device memory in this configuration; raise the budget or lower "
            "max_context_len",
        )
    costs = shape.costs(dims)
    per_slot = costs.per_slot + (shape.ratio * costs.per_location if shape.hisparse else 0)

    def leftover_slots(n: int) -> int:
        room = budget - costs.fixed - n * costs.per_request
        return max(0, room // per_slot // shape.page * shape.page)

    if slots is not None and rows is not None:
        total = shape.bytes_for(dims, slots=slots, rows=rows)
        if total > budget:
            raise ConfigError(
                "device_memory_bytes",
                budget,
                f"device_pool_tokens={slots} and max_running_requests={rows} need {total} bytes "
                f"({format_bytes(total)}) of device memory",
            )
        return slots, rows
    if rows is not None:
        found = leftover_slots(rows)
        if found < shape.slots_for(1):
            need = shape.bytes_for(dims, slots=shape.slots_for(1), rows=rows)
            raise ConfigError(
                "device_memory_bytes",
                budget,
                f"max_running_requests={rows} rows leave no room for one request of max_context_len "
                f"({shape.context}): that needs {need} bytes ({format_bytes(need)})",
            )
        return found, rows
    if slots is not None:
        held = held_requests(shape, slots)
        paid = (budget - shape.bytes_for(dims, slots=slots, rows=0)) // costs.per_request
        found_rows = min(held, paid)
        if found_rows < 1:
            need = shape.bytes_for(dims, slots=max(slots, shape.slots_for(1)), rows=1)
            raise ConfigError(
                "device_memory_bytes",
                budget,
                f"with device_pool_tokens={slots} it holds no request of max_context_len ({shape.context}): "
                f"that needs {need} bytes ({format_bytes(need)})",
            )
        return slots, found_rows
    lo, hi = 1, max(1, budget // max(1, costs.per_request))  # cost(lo) fits; find the last n that does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if shape.bytes_for(dims, slots=shape.slots_for(mid), rows=mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return leftover_slots(lo), lo


def held_requests(shape: Shape, slots: int) -> int:
    """Requests of max_context_len that pools of ``slots`` device slots hold at once."""
    need = round_up(shape.max_len, shape.page)
    if not shape.hisparse:
        return slots // need
    chunk = chunk_rows(hot=shape.hot, page_size=shape.page, chunk=shape.chunk, num_tokens=shape.context)
    return min(max(0, slots - chunk) // (shape.hot + shape.page), slots * shape.ratio // need)


def longest_context(budget: int, shape: Shape, dims: ModelDims, upper: int) -> int:
    """The longest max_context_len (at most ``upper``) of which ``budget`` holds one request; 0 if none."""

    def fits(context: int) -> bool:
        s = attrs.evolve(shape, context=context, chunk=min(shape.chunk, context) if shape.chunk else context)
        return s.bytes_for(dims, slots=s.slots_for(1), rows=1) <= budget

    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


@attrs.frozen
class PoolSizes:
    """The context limit and the pools that hold it, as start-up sizes them (``size_pools``)."""

    max_context_len: int  # tokens one request holds at most, prompt and output
    device_pool_tokens: int  # usable device slots (the sink page is extra)
    max_running_requests: int  # request rows
    host_to_device_ratio: int  # logical (and host) locations per device slot; 1 without HiSparse
    # the longest context the pools (without a budget) or the budget hold, where max_context_len was
    # left to them (None: it was given)
    context_capacity: int | None


def size_pools(
    *,
    hisparse: bool,
    page_size: int,
    hot: int,
    draft_tokens: int,
    chunked_prefill_tokens: int | None,
    positions: int,
    budget: int | None,
    dims: ModelDims,
    max_context_len: int | None,
    device_pool_tokens: int | None,
    max_running_requests: int | None,
    host_to_device_ratio: int | None,
    log_choices: bool = False,
) -> PoolSizes:
    """The sizes of the pools, the ones given kept, then checked against each other (``check_pools``).

    Without a budget (``budget`` None) the pools, rows and ratio are given; a max_context_len left
    out is the model's ``positions``, lowered to what the pools hold. With one, a max_context_len
    left out is the longest context of which the budget holds one request (at most ``positions``),
    a ratio left out the one that seats the most requests of it (the smallest of equals), and the
    device pool and rows left out what the budget pays for (``size_for_budget``). Each size
    chosen is logged (``log_choices``).
    """

    def shape(context: int, ratio: int) -> Shape:
        return Shape(hisparse=hisparse, page=page_size, hot=hot, ratio=ratio if hisparse else 1,
                     draft_tokens=draft_tokens, chunk=prefill_chunk(chunked_prefill_tokens, context),
                     context=context)

    context, capacity, ratio = max_context_len, None, host_to_device_ratio if hisparse else 1
    slots, rows = device_pool_tokens, max_running_requests
    if budget is None:
        assert slots is not None and rows is not None and ratio is not None  # given without a budget
        if context is None:  # the rules of ``check_pools``, solved for the context
            if not hisparse:
                capacity = slots - draft_tokens
            elif chunked_prefill_tokens is None:  # a whole prompt is prefilled in device rows
                capacity = min(slots, slots * ratio - draft_tokens)
            else:
                capacity = slots * ratio - draft_tokens
            context = min(positions, capacity)
            if log_choices:
                log.info("config.max_context_len", max_context_len=context, max_position_embeddings=positions,
                         pool_capacity=capacity, lowered_to_fit_the_pools=context < positions)
    else:
        if context is None:
            capacity = longest_context(budget, shape(positions, ratio or MAX_RATIO), dims, positions)
            context = capacity or positions
            if log_choices:
                log.info("config.max_context_len", max_context_len=context, max_position_embeddings=positions,
                         lowered_to_fit_the_budget=context < positions)
        if ratio is None:
            ratio = best_ratio(budget, [shape(context, r) for r in range(1, MAX_RATIO + 1)], dims,
                               slots=slots, rows=rows)
        slots, rows = size_for_budget(budget, shape(context, ratio), dims, slots=slots, rows=rows)
        if log_choices:
            log.info("config.device_budget", device_memory_bytes=budget, device_pool_tokens=slots,
                     max_running_requests=rows, max_context_len=context,
                     host_to_device_ratio=ratio if hisparse else None)
    check_pools(hisparse=hisparse, page_size=page_size, hot=hot, draft_tokens=draft_tokens,
                device_pool_tokens=slots, max_context_len=context, host_to_device_ratio=ratio,
                chunked_prefill_tokens=chunked_prefill_tokens)
    return PoolSizes(context, slots, rows, ratio, capacity)


def best_ratio(
    budget: int, shapes: list[Shape], dims: ModelDims, *, slots: int | None, rows: int | None
) -> int:
    """The ratio of the shape whose pools seat the most requests of its context in ``budget``, the
    first of equals (``DEFAULT_RATIO`` when the budget holds none)."""
    best, most = DEFAULT_RATIO, -1
    for shape in shapes:
        try:
            found_slots, found_rows = size_for_budget(budget, shape, dims, slots=slots, rows=rows)
        except ConfigError:
            continue
        seated = min(found_rows, held_requests(shape, found_slots))
        if seated > most:
            best, most = shape.ratio, seated
    return best


def device_budget(bytes_: int | None, fraction: float | None, device: str) -> int | None:
    """The budget in bytes: ``device_memory_bytes``, or ``device_memory_fraction`` of the CUDA
    device's free memory now (None: no budget, the pools are sized in tokens)."""
    if bytes_ is not None:
        return bytes_
    if fraction is None:
        return None
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free * fraction)


def check_allocations(structures: tuple[Structure, ...], tensors: dict[str, Any]) -> None:
    """Start-up check: the memory layer allocated exactly the device tensors the plan lists."""
    planned = {s.name: s.num_bytes for s in structures}
    allocated = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    if planned != allocated:
        raise AssertionError(f"device allocations differ from the memory plan: planned {planned}, allocated {allocated}")


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
            raise AssertionError(f"the memory plan takes {self.total_bytes} bytes, over the budget {self.budget}")

    def seats(self, context: int) -> Seats:
        return seats(self.plan, context)

    def request_bytes(self, context: int) -> dict[str, int]:
        """Device bytes one request of ``context`` tokens holds in each structure (once decoding)."""
        plan = self.plan
        locations = round_up(context + plan.draft_tokens, plan.page_size)
        slots = plan.buffer_columns if plan.hisparse else locations
        units = {SLOT: slots, LOCATION: locations, REQUEST: 1}
        return {s.name: s.unit_bytes * units[s.unit] for s in self.structures}

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
        }


UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    """``123``, ``64MB``, ``1.5GiB`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 512MB, 2GiB, 1000000)")
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])
