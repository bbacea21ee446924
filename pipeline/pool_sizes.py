"""The pools' sizes: the rules that bind them together, and sizing them for a device memory budget.

``check_pools`` holds the rules (the pools hold one request of ``max_context_len``) that
``EngineConfig`` checks on the sizes it was given and start-up checks again on the plan's.
``size_pools`` is start-up's sizing (``pipeline.startup``): the sizes given are kept, the others
derived. With a budget in bytes, ``size_for_budget`` solves for the device pool (in slots) and the
request rows, spending the budget on as many requests of ``max_context_len`` as fit and the rest
on slots, at the byte costs ``pipeline.capacity`` gives each pool's unit.

Dynamic residency (``HiSparseConfig.residency="dynamic"``, docs/residency.md) splits the same budget
differently (``dynamic_split``): it keeps the request rows and the seats HiSparse's sizing gives, sizes
the logical pool to the least that holds those seats, and gives every byte left to the device pool,
where a FULL request keeps its whole context. So at high load it seats what HiSparse seats, and at low
load as many requests as the device pool holds run without a hot buffer. The ratio is the knob between
the two: a smaller ``host_to_device_ratio`` seats fewer requests and leaves a larger device pool.

The budget covers the KV memory layer only: the weights and a forward's activations are outside
it (on CUDA, ``device_memory_fraction`` takes a fraction of the memory free once the weights are
loaded).
"""

from __future__ import annotations

import attrs
import structlog

from pipeline.capacity import Costs, ModelDims, arena_bytes, chunk_rows, format_bytes, round_up, unit_costs
from pipeline.errors import ConfigError

log = structlog.get_logger("hispec.config")

# host_to_device_ratio without a budget (HiSparseConfig's None), and the largest a budget chooses
DEFAULT_RATIO, MAX_RATIO = 4, 64


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
        return unit_costs(
            hisparse=self.hisparse, page=self.page, hot=self.hot, max_len=self.max_len, dims=dims
        )

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
        locations = slots * self.ratio if self.hisparse else 0
        return self.costs(dims).total(slots=slots, locations=locations, rows=rows)


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
    # logical (and host) locations per device slot; 1 without HiSparse. With dynamic residency and a
    # budget: the ratio the seats were sized at (the logical pool is ``logical_pool_tokens``)
    host_to_device_ratio: int
    # usable logical (and host) locations: device_pool_tokens * ratio, but with dynamic residency at a
    # budget the seats times one request's locations (``dynamic_split``)
    logical_pool_tokens: int
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
    residency: str = "always",
    log_choices: bool = False,
) -> PoolSizes:
    """The sizes of the pools, the ones given kept, then checked against each other (``check_pools``).

    Without a budget (``budget`` None) the pools, rows and ratio are given; a max_context_len left
    out is the model's ``positions``, lowered to what the pools hold. With one, a max_context_len
    left out is the longest context of which the budget holds one request (at most ``positions``),
    a ratio left out the one that seats the most requests of it (the smallest of equals), and the
    device pool and rows left out what the budget pays for (``size_for_budget``); with
    ``residency="dynamic"`` and the device pool left out, the budget is then split again
    (``dynamic_split``). Each size chosen is logged (``log_choices``).
    """

    def shape(context: int, ratio: int) -> Shape:
        return Shape(hisparse=hisparse, page=page_size, hot=hot, ratio=ratio if hisparse else 1,
                     draft_tokens=draft_tokens, chunk=prefill_chunk(chunked_prefill_tokens, context),
                     context=context)

    context, capacity, ratio = max_context_len, None, host_to_device_ratio if hisparse else 1
    slots, rows = device_pool_tokens, max_running_requests
    dynamic, logical = hisparse and residency == "dynamic", None  # logical None: slots * ratio
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
        given_slots = slots
        slots, rows = size_for_budget(budget, shape(context, ratio), dims, slots=slots, rows=rows)
        if dynamic and given_slots is None:
            slots, logical = dynamic_split(budget, shape(context, ratio), dims, slots=slots, rows=rows)
        if log_choices:
            log.info("config.device_budget", device_memory_bytes=budget, device_pool_tokens=slots,
                     max_running_requests=rows, max_context_len=context,
                     host_to_device_ratio=ratio if hisparse else None,
                     logical_pool_tokens=logical or slots * ratio, residency=residency if hisparse else None)
    logical = slots * ratio if logical is None else logical
    check_pools(hisparse=hisparse, page_size=page_size, hot=hot, draft_tokens=draft_tokens,
                device_pool_tokens=slots, max_context_len=context,
                host_to_device_ratio=ratio if logical == slots * ratio else None,
                chunked_prefill_tokens=chunked_prefill_tokens)
    return PoolSizes(max_context_len=context, device_pool_tokens=slots, max_running_requests=rows,
                     host_to_device_ratio=ratio, logical_pool_tokens=logical, context_capacity=capacity)


def dynamic_split(budget: int, shape: Shape, dims: ModelDims, *, slots: int, rows: int) -> tuple[int, int]:
    """(device_pool_tokens, logical_pool_tokens) of dynamic residency at ``budget``, from HiSparse's
    sizes of ``shape`` (``slots``, ``rows``; the rows are kept).

    The logical pool is the least that holds the requests of max_context_len HiSparse's pools seat,
    and the device pool every whole page the budget has left once the rows and the logical pool are
    paid. The two are one arena on the device (``pipeline/memory/arena.py``): the keys' bytes are
    the logical pool's share of it, which FULL rows use while no HOT row needs them. The arena loses
    a little to whole frames (frame 0 reserved, key pages straddling two frames), and the draft
    layer's pool is indexed by the keys' view, so the device pool is then trimmed, a page at a
    time or more, until the whole layer fits the budget (never below one device buffer).
    """
    need = round_up(shape.max_len, shape.page)
    costs = shape.costs(dims)
    logical = max(1, min(rows, held_requests(shape, slots))) * need
    room = budget - costs.fixed - rows * costs.per_request - logical * costs.per_location
    device = max(slots, room // costs.per_slot // shape.page * shape.page)
    least = round_up(shape.hot + shape.page, shape.page)

    def over(tokens: int) -> int:
        return arena_bytes(page=shape.page, hot=shape.hot, slots=tokens, locations=logical, rows=rows,
                           max_len=shape.max_len, dims=dims) - budget

    trimmed = False
    while device > least and over(device) > 0:
        device = max(least, device - round_up(-(-over(device) // costs.per_slot), shape.page))
        trimmed = True
    while trimmed and over(device + shape.page) <= 0:  # (a step may take more than it had to)
        device += shape.page
    return device, logical


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
