"""The DSA attention backend over HiSparse memory.

Per layer it stores the new tokens' rows, runs the indexer over each token's visible positions, and
attends over the selected rows:

* **prefill** (one chunk of each prompt, ``chunk_starts``): a position of the chunk itself is found
  through ``logical_to_physical`` (its rows were just written); an earlier position, when the chunk
  does not start the prompt, goes through the request's hot region as in decode (in place when the
  buffer holds it, else loaded from host), the chunk's queries in groups whose selections fit the
  hot region together (``prefill_swap.py``);
* **decode / verify**: the tokens are request-major, ``steps`` per request (1 for decode, D for a
  verify); their top-k sets go through the coordinator's swap-in, which returns device slots,
  loading misses from host. A verify whose steps do not all fit the hot region in one call is
  resolved in rounds: attention runs for the steps resolved so far before the next round may evict
  their columns.

Dynamic residency: a FULL row's positions all have device slots (``full_page_table``, its pages in
position order), so its tokens, prefill chunks included, attend through them without swap-in; a
batch of both layouts runs the HOT rows' swap-in and then one ``sparse_mla`` over every token. On a
CPU a decode or verify layer runs compiled: HOT rows through ``hisparse_attend_numba.attend_views``,
FULL rows through ``attend_paged`` (the resident memory's single call, through the page table), and
a batch of both through ``attend_mixed``, the two in one call (every token's work is its own, so
the result is the step-by-step path's, bit for bit).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, Protocol

import attrs
import torch

from kernels import hisparse_attend_numba
from kernels.indexer_topk import MATMUL_MIN_QUERIES, indexer_topk
from kernels.kv_fp8 import KVCacheFormat, store_keys, store_rows
from kernels.sparse_mla import sparse_mla
from kernels.swap_in import SwapInResult
from kernels.swap_in_policy import policy_code
from pipeline.hisparse.buffers import DeviceBuffers
from pipeline.hisparse.counters import LayerCounters
from pipeline.hisparse.prefill_swap import prefill_swap_rounds
from pipeline.hisparse.trace import TopKTrace
from pipeline.memory.hisparse_allocator import HiSparseAllocator
from pipeline.memory.host_pool import HostPool
from pipeline.model.attention_api import AttentionInputs


class SwapInMemory(Protocol):
    """What the backend reads of the coordinator: the pools, the token table, the map, swap-in."""

    device_kv: torch.Tensor  # [L, physical rows, row_dim]
    index_k: torch.Tensor  # [L, logical rows, index_dim]
    kv_format: KVCacheFormat | None  # how they are stored (None: unquantized)
    alloc: HiSparseAllocator  # ``lookup``: logical location -> physical slot
    # a prefill chunk's grouped swap-in (``prefill_swap.py``) reads these too
    buffers: DeviceBuffers
    host: HostPool
    counters: LayerCounters

    @property
    def hot(self) -> int: ...

    @property
    def policy(self) -> str: ...  # the replacement policy

    def spare_chunk_rows(self, row: int, start: int, end: int) -> torch.Tensor: ...

    @property
    def req_to_token(self) -> torch.Tensor: ...

    @property
    def req_to_token_device(self) -> torch.Tensor: ...  # the same table, where the kernels run

    def swap_in(
        self, layer: int, top_k_pos: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor,
        *, near: torch.Tensor | None = None,
    ) -> SwapInResult: ...

    def record_swap_in(
        self,
        layer: int,
        result: SwapInResult,
        top_k_pos: torch.Tensor,
        seq_lens: torch.Tensor,
        rows: torch.Tensor,
    ) -> None: ...

    def compiled_pools(self) -> hisparse_attend_numba.Pools | None: ...

    # dynamic residency: a FULL row's positions all have device slots, through its pages

    @property
    def plan(self) -> Any: ...  # MemoryPlan (its page size)

    def full_flags(self, rows: torch.Tensor) -> list[bool]: ...

    def full_page_table(self) -> torch.Tensor: ...

    # shared indexer layers (GLM-5): their swap-ins issued as soon as the top-k they reuse exists

    def shared_after(self, layer: int) -> tuple[int, ...]: ...

    def prefetch_swap_in(
        self, layer: int, top_k_pos: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor,
        near: torch.Tensor | None,
    ) -> PrefetchedSwapIn: ...


@attrs.frozen
class PrefetchedSwapIn:
    """A swap-in issued ahead of the layer that reads it (``SwapInMemory.prefetch_swap_in``)."""

    result: SwapInResult
    done: Any = None  # the CUDA event of the load stream it ran on (None: it ran in order)

    def take(self) -> SwapInResult:
        """The result, for work queued next on the current stream: that stream waits for the load
        (no CPU wait), and the result's tensors are kept until it has read them."""
        if self.done is not None:
            current = torch.cuda.current_stream(self.done.device)
            current.wait_event(self.done)
            for tensor in (self.result.slots, self.result.counts):
                tensor.record_stream(current)
        return self.result


@attrs.define(eq=False)
class HiSparseBackend:
    """``AttentionBackend`` for one forward of the target model over HiSparse memory."""

    coord: SwapInMemory
    req_rows: torch.Tensor  # [T] int64 request row of each token
    positions: torch.Tensor  # [T] int64
    write_locs: torch.Tensor  # [T] int64 logical location (indexer key)
    write_slots: torch.Tensor  # [T] int64 device slot (MLA row)
    steps: int = 0  # 0 = prefill; else tokens per request, request-major
    # prefill: [T] int64 the first position of each token's chunk (None: every chunk starts at 0);
    # the tokens of one request are contiguous
    chunk_starts: torch.Tensor | None = None
    trace: TopKTrace | None = None
    labels: dict[int, str] | None = None  # request id of each request row, for the trace
    # [T, K] int32 the last full layer's top-k of this forward; a shared layer (``reuse_topk``)
    # swaps these positions into its own buffer instead of running an indexer pass
    last_topk: torch.Tensor | None = None
    # positions the indexer ranks just past the top-k, per token (the near-policies' hint; the
    # trace records them): ``near_margin`` of them, ``last_near [T, margin]`` int32, -1 padded
    near_margin: int = 0
    last_near: torch.Tensor | None = None
    # the indexer scores up to this many positions, a size fixed at capture (``pipeline/graphs.py``);
    # None: the batch's longest context, which the Triton indexer reads back
    max_seq_len: int | None = None
    # the caller knows every row of the batch is HOT (the fixed-size inputs): no FULL rows to look
    # for, even while other rows of the memory are FULL (which ``_full`` would read from the host)
    all_hot: bool = False
    # the caller knows every row of the batch is FULL (dynamic residency, the fixed-size inputs): no
    # mask to build, no swap-in, every token through ``page_table``
    all_full: bool = False
    # ``[rows, pages]`` the FULL rows' pages in a buffer of fixed size the caller fills
    # (``pipeline/graphs.py``); None: the coordinator's ``full_page_table``
    page_table: torch.Tensor | None = None
    # prefill: per request of the batch, (first token, end token, chunk start, spare chunk rows);
    # the same for every layer of the forward, so found once
    _chunks: list[tuple[int, int, int, torch.Tensor | None]] | None = attrs.field(default=None, init=False)
    # decode / verify: the coordinator's pools for the compiled attention, False where it cannot serve
    # (decided at the first layer), None before
    _pools: Any = attrs.field(default=None, init=False)
    # the compiled attention's per-forward tables (``hisparse_attend_numba.ForwardViews``) and the
    # policy's code, taken at its first layer
    _views: Any = attrs.field(default=None, init=False)
    _policy: int = attrs.field(default=0, init=False)
    # [T] bool: the token's request row is FULL (dynamic residency), None when no row is; found at
    # the first layer (``_full``)
    _full_mask: Any = attrs.field(default=False, init=False)
    _pages: torch.Tensor | None = attrs.field(default=None, init=False)  # FULL rows' pages (once a forward)
    _paged: Any = attrs.field(default=None, init=False)  # the compiled call's page table (FULL rows)
    # a batch of both layouts on the compiled path: (FULL tokens' indices, HOT tokens' indices), and
    # the tables the call reads of each part, taken at its first layer
    _split: tuple[torch.Tensor, torch.Tensor] | None = attrs.field(default=None, init=False)
    _part_views: Any = attrs.field(default=None, init=False)
    # the first swap-in of a shared layer, issued when the full layer before it found its top-k
    _prefetched: dict[int, PrefetchedSwapIn] = attrs.field(factory=dict, init=False)

    def attend(self, inputs: AttentionInputs) -> torch.Tensor:
        layer = inputs.layer
        if self.steps and not inputs.reuse_topk and self._compiled_fits(inputs):
            out = self._attend_compiled(inputs, layer)
            self._prefetch(layer)
            return out
        kv = self.coord.device_kv[layer]  # [rows, C + R]
        keys = self.coord.index_k[layer]  # [logical rows, Di]
        fmt = self.coord.kv_format
        store_rows(fmt, kv, self.write_slots, inputs.kv_rows)
        if inputs.reuse_topk:
            if self.last_topk is None:
                raise RuntimeError(f"layer {layer} reuses a top-k, but no full layer ran before it")
            return self._attend_selected(inputs, layer, kv, self.last_topk)
        index_q, index_w, index_k = inputs.indexer_inputs()
        store_keys(fmt, keys, self.write_locs, index_k)
        top = indexer_topk(
            index_q,
            index_w,
            keys,
            self.coord.req_to_token_device,
            self.req_rows,
            self.positions + 1,
            inputs.top_k + self.near_margin,
            inputs.index_scale,
            max_seq_len=self.max_seq_len,
            check=False,
        )  # [T, K + margin] int32 positions; the first K are the selection (contract order)
        if self.near_margin:
            top, self.last_near = top[:, : inputs.top_k].contiguous(), top[:, inputs.top_k :].contiguous()
        self.last_topk = top
        self._prefetch(layer)  # the shared layers' swap-ins, beside this layer's attention and MLP
        return self._attend_selected(inputs, layer, kv, top)

    def _prefetch(self, layer: int) -> None:
        """Issue now the first swap-in call of each layer right after ``layer`` that will reuse its
        top-k (``coord.shared_after``: on CUDA on a load stream, so that it runs beside this layer's
        attention and MLP; elsewhere in order). Decode and verify of HOT rows only: the same call the
        shared layer would make, on its own buffer and LRU, which nothing before it touches."""
        later = self.coord.shared_after(layer) if self.steps else ()
        if not later or self.last_topk is None or self._full() is not None:
            return
        top3, seq_lens, rows, near3 = self._swap_inputs(self.last_topk, slice(None))
        for shared in later:
            self._prefetched[shared] = self.coord.prefetch_swap_in(shared, top3, seq_lens, rows, near3)

    def _compiled_fits(self, inputs: AttentionInputs) -> bool:
        """A decode or verify layer goes to ``kernels.hisparse_attend_numba`` (one compiled call for
        the writes, the selection, the swap-in and the attention, the same loops as the steps
        below): on a CPU whose pools the coordinator can hand over, nothing traced, no near
        positions wanted, at most ``MATMUL_MIN_QUERIES`` steps (the indexer's compiled loop takes
        every query then), and shapes both loops take. Decided at the first layer, for the forward."""
        if self._pools is None:
            pools = None
            quiet = self.trace is None and self.near_margin == 0 and not torch.is_grad_enabled()
            if quiet and self.steps <= MATMUL_MIN_QUERIES:
                pools = self.coord.compiled_pools()
            if pools is not None and not hisparse_attend_numba.fits(
                inputs.q_latent,
                self.coord.device_kv,
                self.coord.index_k,
                inputs.indexer_inputs()[0],
                self.coord.host.kv,
                inputs.top_k,
            ):
                pools = None
            full = self._full()
            if pools is not None and full is not None:  # FULL rows through their pages
                self._paged = self._page_table().numpy()
                if not self.all_full:  # a mix: each layout's tokens in its own call
                    on = full.to(self.req_rows.device)
                    self._split = (torch.nonzero(on).reshape(-1), torch.nonzero(~on).reshape(-1))
            self._pools = pools if pools is not None else False
        return self._pools is not False

    def _full(self) -> torch.Tensor | None:
        """``[T]`` bool: the tokens whose request row is FULL; None when none is (once per forward,
        which also sets ``all_full`` when every one is)."""
        if self._full_mask is False:
            mask = None
            if not self.all_full and not self.all_hot:
                flags = self.coord.full_flags(self.req_rows)
                if any(flags):
                    self.all_full = all(flags)
                    mask = None if self.all_full else torch.tensor(flags, dtype=torch.bool)
            if self.all_full:
                mask = torch.ones(self.req_rows.shape[0], dtype=torch.bool)
            self._full_mask = mask
        return self._full_mask

    def _paged_slots(self, top: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, K]`` int64 device slots of the top-k positions ``top [n, K]`` of FULL rows' tokens
        (``tokens``: their indices in the batch; None: every token), -1 for padding."""
        rows = self.req_rows if tokens is None else self.req_rows[tokens]
        page = self.coord.plan.page_size
        pos = top.long().clamp(min=0)
        table = self._page_table()
        slots = table[rows[:, None].to(table.device), (pos // page).clamp(max=table.shape[1] - 1)]
        return torch.where(top >= 0, slots * page + pos % page, -1)

    def _page_table(self) -> torch.Tensor:
        """``[rows, pages]`` the FULL rows' device pages (``full_page_table``), once per forward."""
        if self._pages is None:
            self._pages = self.page_table if self.page_table is not None else self.coord.full_page_table()
        return self._pages

    def _attend_compiled(self, inputs: AttentionInputs, layer: int) -> torch.Tensor:
        coord, steps, views = self.coord, self.steps, self._views
        if views is None:  # the forward's tables, once for all its layers
            views = self._views = hisparse_attend_numba.ForwardViews(
                self.write_slots, self.write_locs, self.req_rows, self.positions + 1, steps
            )
            self._policy = policy_code(coord.policy)
        if self._split is not None:
            return self._attend_split(inputs, layer)
        index_q, index_w, index_k = inputs.indexer_inputs()
        if self._paged is not None:  # every row FULL: no swap-in
            paged, self.last_topk = hisparse_attend_numba.attend_paged(
                self._pools, views, layer, inputs.kv_rows, index_k, index_q, index_w, inputs.index_scale,
                inputs.top_k, self._paged, coord.plan.page_size, inputs.q_latent, inputs.q_rope,
                inputs.attn_scale,
            )
            return paged
        out, top, result = hisparse_attend_numba.attend_views(
            self._pools,
            views,
            layer,
            inputs.kv_rows,
            index_k,
            index_q,
            index_w,
            inputs.index_scale,
            inputs.top_k,
            coord.hot,
            self._policy,
            inputs.q_latent,
            inputs.q_rope,
            inputs.attn_scale,
        )
        self.last_topk = top
        batch = top.shape[0] // steps
        coord.record_swap_in(
            layer,
            result,
            top.view(batch, steps, -1),
            views.seq_lens.view(batch, steps),
            self.req_rows[::steps],
        )
        if out is not None:
            return out
        return self._attend_swapped(inputs, layer, coord.device_kv[layer], top, first=result)

    def _attend_split(self, inputs: AttentionInputs, layer: int) -> torch.Tensor:
        """A compiled layer of a batch of both layouts (``attend_mixed``): the HOT rows' tokens through
        the swap-in, the FULL rows' through their pages, one call. A verify whose HOT steps do not
        all fit the hot region goes on step by step from the swap-in made (``_attend_hot``; the FULL
        rows' tokens attended again there, to the same values)."""
        assert self._split is not None
        coord, steps = self.coord, self.steps
        full, hot = self._split
        if self._part_views is None:  # the forward's tables, once for all its layers
            self._views = hisparse_attend_numba.ForwardViews(
                self.write_slots, self.write_locs, self.req_rows, self.positions + 1, steps
            )
            self._policy = policy_code(coord.policy)
            batch = hot.numel() // steps
            self._part_views = (
                full.numpy(),
                hot.numpy(),
                self._views.seq_lens[hot].view(batch, steps),
                self.req_rows[hot][::steps],
            )
        full_np, hot_np, hot_lens, hot_rows = self._part_views
        index_q, index_w, index_k = inputs.indexer_inputs()
        out, top, hot_top, result = hisparse_attend_numba.attend_mixed(
            self._pools, self._views, layer, inputs.kv_rows, index_k, index_q, index_w, inputs.index_scale,
            inputs.top_k, coord.hot, self._policy, self._paged, coord.plan.page_size, hot_np, full_np,
            inputs.q_latent, inputs.q_rope, inputs.attn_scale,
        )
        self.last_topk = top
        coord.record_swap_in(layer, result, hot_top, hot_lens, hot_rows)
        if out is not None:
            return out
        kv = coord.device_kv[layer]
        return self._attend_hot(inputs, layer, kv, top, (hot, self._paged_slots(top)), result)

    def _attend_selected(
        self, inputs: AttentionInputs, layer: int, kv: torch.Tensor, top: torch.Tensor
    ) -> torch.Tensor:
        if self.trace is not None:
            phase = "prefill" if self.steps == 0 else "decode" if self.steps == 1 else "verify"
            self.trace.record(layer, phase, self._trace_labels(), self.positions, top, near=self.last_near)
        if self.steps == 0:
            return self._attend_prefill(inputs, layer, kv, top)
        ahead = self._prefetched.pop(layer, None)
        return self._attend_swapped(inputs, layer, kv, top, None if ahead is None else ahead.take())

    def _attend_prefill(
        self, inputs: AttentionInputs, layer: int, kv: torch.Tensor, top: torch.Tensor
    ) -> torch.Tensor:
        full = self._full()
        if full is not None and bool(full.all()):  # every row FULL: each position through its pages
            slots = self._paged_slots(top)  # (a chunk's own positions too: their slots were bound so)
            return sparse_mla(inputs.q_latent, inputs.q_rope, kv, slots, inputs.attn_scale, check=False)
        locs = self.coord.req_to_token_device[self.req_rows[:, None], top.long().clamp(min=0)]
        dense = torch.where(top >= 0, self.coord.alloc.lookup(locs.cpu()).to(locs.device), -1)
        starts = self.chunk_starts
        if starts is None or not bool((starts > 0).any()):  # every chunk starts its prompt
            return sparse_mla(inputs.q_latent, inputs.q_rope, kv, dense, inputs.attn_scale, check=False)
        out = torch.empty_like(inputs.q_latent)
        own = (top < 0) | (top.long() >= starts[:, None])  # -1 padding or a position of the chunk
        for a, b, start, scratch in self._prefill_chunks(starts):
            if full is not None and bool(full[a]):  # every position has its slot
                slots = self._paged_slots(top[a:b], torch.arange(a, b, device=top.device))
                out[a:b] = sparse_mla(
                    inputs.q_latent[a:b], inputs.q_rope[a:b], kv, slots, inputs.attn_scale, check=False
                )
                continue
            if start == 0:
                out[a:b] = sparse_mla(
                    inputs.q_latent[a:b], inputs.q_rope[a:b], kv, dense[a:b], inputs.attn_scale, check=False
                )
                continue
            past = torch.where(own[a:b], -1, top[a:b])  # [S, K] the earlier positions
            row = int(self.req_rows[a])
            for lo, hi, slots in prefill_swap_rounds(self.coord, layer, row, past, start, scratch):
                tok = slice(a + lo, a + hi)
                chosen = torch.where(own[tok], dense[tok], slots)
                out[tok] = sparse_mla(
                    inputs.q_latent[tok], inputs.q_rope[tok], kv, chosen, inputs.attn_scale, check=False
                )
        return out

    def _prefill_chunks(self, starts: torch.Tensor) -> list[tuple[int, int, int, torch.Tensor | None]]:
        """The batch's chunks: token range, start, and the chunk rows the chunk leaves unused."""
        if self._chunks is None:
            self._chunks = []
            full = self._full()
            for a, b in _groups(self.req_rows):
                start = int(starts[a])
                row = int(self.req_rows[a])
                lends = start and (full is None or not bool(full[a]))  # (a FULL row swaps nothing in)
                spare = self.coord.spare_chunk_rows(row, start, start + (b - a)) if lends else None
                self._chunks.append((a, b, start, spare))
        return self._chunks

    def _attend_swapped(
        self,
        inputs: AttentionInputs,
        layer: int,
        kv: torch.Tensor,
        top: torch.Tensor,
        first: SwapInResult | None = None,
    ) -> torch.Tensor:
        if self.all_full:  # (nothing read back: the batch's layout is known)
            return sparse_mla(inputs.q_latent, inputs.q_rope, kv, self._paged_slots(top), inputs.attn_scale,
                              check=False)
        full = self._full()
        if full is None:
            return self._attend_hot(inputs, layer, kv, top, None, first)
        paged = self._paged_slots(top)  # [T, K] (what FULL rows read; HOT rows' are replaced)
        hot = torch.nonzero(~full.to(top.device)).reshape(-1)
        if hot.numel() == 0:
            return sparse_mla(inputs.q_latent, inputs.q_rope, kv, paged, inputs.attn_scale, check=False)
        return self._attend_hot(inputs, layer, kv, top, (hot, paged), first)

    def _attend_hot(
        self,
        inputs: AttentionInputs,
        layer: int,
        kv: torch.Tensor,
        top: torch.Tensor,
        mixed: tuple[torch.Tensor, torch.Tensor] | None,
        first: SwapInResult | None = None,
    ) -> torch.Tensor:
        """Attention of the HOT rows' tokens through swap-in; ``mixed``: (the HOT tokens' indices, every
        token's slots, FULL rows' already found) when the batch also holds FULL rows, which then
        attend in the same call as the HOT rows when one swap-in call resolves them all."""
        sub = slice(None) if mixed is None else mixed[0]
        hot_top = top[sub]
        top3, seq_lens, rows, near3 = self._swap_inputs(top, sub)
        out: torch.Tensor | None = None
        for idx, slots in self._swap_rounds(layer, top3, seq_lens, rows, near3, first):
            if out is None and idx.numel() == hot_top.shape[0]:  # the common case: one call resolved all
                if mixed is not None:
                    slots = mixed[1].index_copy(0, mixed[0], slots.to(mixed[1].dtype))
                return sparse_mla(inputs.q_latent, inputs.q_rope, kv, slots, inputs.attn_scale, check=False)
            if out is None:
                out = self._attend_full_part(inputs, kv, mixed)
            at = idx if mixed is None else mixed[0][idx]
            out[at] = sparse_mla(
                inputs.q_latent[at], inputs.q_rope[at], kv, slots, inputs.attn_scale, check=False
            )
        assert out is not None
        return out

    def _swap_inputs(
        self, top: torch.Tensor, sub: slice | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The swap-in's arguments for the tokens ``sub`` (whole requests, ``steps`` tokens each) of
        a decode or verify: ``top [B, S, K]``, ``seq_lens [B, S]``, request rows ``[B]``, near
        positions ``[B, S, M]`` or None."""
        steps = self.steps
        hot_top = top[sub]
        batch = hot_top.shape[0] // steps
        rows = self.req_rows[sub].reshape(batch, steps)[:, 0].contiguous()
        top3 = hot_top.reshape(batch, steps, -1)
        seq_lens = (self.positions[sub] + 1).reshape(batch, steps)
        near3 = None if self.last_near is None else self.last_near[sub].reshape(batch, steps, -1)
        return top3, seq_lens, rows, near3

    def _attend_full_part(
        self, inputs: AttentionInputs, kv: torch.Tensor, mixed: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """``[T, H, C]``: the FULL rows' tokens attended (zeros elsewhere, for the HOT rounds)."""
        out = torch.zeros_like(inputs.q_latent)
        if mixed is None:
            return out
        full = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
        full[mixed[0]] = False
        at = torch.nonzero(full).reshape(-1)
        out[at] = sparse_mla(
            inputs.q_latent[at], inputs.q_rope[at], kv, mixed[1][at], inputs.attn_scale, check=False
        )
        return out

    def _swap_rounds(
        self,
        layer: int,
        top3: torch.Tensor,
        seq_lens: torch.Tensor,
        rows: torch.Tensor,
        near3: torch.Tensor | None = None,
        first: SwapInResult | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Swap-in of ``top3 [B, S, K]``, in as many calls as the hot region needs: yields (flat
        indices of the steps resolved by one call, their slots ``[n, K]``). The caller attends over
        them before resuming, because the next call may evict their columns. ``first``: the first
        call's result, when it was made already (the compiled attention's)."""
        batch, steps = top3.shape[:2]
        result = first if first is not None else self.coord.swap_in(layer, top3, seq_lens, rows, near=near3)
        flat = result.slots.reshape(batch * steps, -1)
        # ``hot >= S * top_k``: one call resolves every step (``kernels.swap_in``), known without a
        # read of its step counts (a plain decode step's case: no CPU wait on the device)
        if self.coord.hot >= steps * top3.shape[-1] or result.all_steps_done(steps):
            yield torch.arange(batch * steps, device=top3.device), flat
            return
        pending = torch.ones(batch, steps, dtype=torch.bool, device=top3.device)
        step_ids = torch.arange(steps, device=top3.device)[None, :]
        while True:
            done_now = pending & (step_ids < result.steps_done[:, None])
            idx = torch.nonzero(done_now.reshape(-1)).reshape(-1)
            yield idx, result.slots.reshape(batch * steps, -1)[idx]
            pending &= ~done_now
            if not bool(pending.any()):
                return
            result = self.coord.swap_in(layer, top3, torch.where(pending, seq_lens, 0), rows, near=near3)

    def _trace_labels(self) -> list[str]:
        labels = self.labels or {}
        return [labels.get(row, str(row)) for row in self.req_rows.tolist()]


def _groups(req_rows: torch.Tensor) -> list[tuple[int, int]]:
    """``[a, b)`` token ranges of the requests of a flat prefill batch (their tokens are contiguous)."""
    key = req_rows.cpu()
    change = torch.nonzero(key[1:] != key[:-1]).reshape(-1) + 1
    bounds = [0, *change.tolist(), key.numel()]
    return list(itertools.pairwise(bounds))
