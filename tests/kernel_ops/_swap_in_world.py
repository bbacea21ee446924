"""Random but consistent swap-in inputs ("worlds") and an exact comparison of three implementations.

hypothesis draws the sizes and a seed; the seed fills the tables. Every world obeys the swap-in
preconditions (unique hot tokens, disjoint physical slots, full capacity whenever a step takes the
long path) and surrounds ``device_kv`` / ``host_kv`` with canary rows: the ops get views that
exclude them, so a stray write or read-modify-write shows up as a changed canary.
"""

from __future__ import annotations

import attrs
import torch
from hypothesis import strategies as st

from kernels.swap_in import SwapInResult

CANARY = 2  # rows on each side of device_kv and host_kv


@attrs.define(eq=False)
class World:
    top_k_pos: torch.Tensor  # [B, S, K] int32
    seq_lens: torch.Tensor  # [B, S] int64
    req_rows: torch.Tensor  # [B] int64
    buffer_tokens: torch.Tensor  # [N, HOT+P] int32
    buffer_locs: torch.Tensor  # [N, HOT+P] int64
    lru: torch.Tensor  # [N, HOT] int32
    req_to_host: torch.Tensor  # [N, max_ctx] int64
    host_full: torch.Tensor  # [host_rows + 2*CANARY, dim]
    device_full: torch.Tensor  # [dev_rows + 2*CANARY, dim]
    hot: int

    def clone(self) -> World:
        return World(**{f.name: (v.clone() if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
                        for f in attrs.fields(World)})

    def args(self) -> tuple:
        return (self.top_k_pos, self.seq_lens, self.req_rows, self.buffer_tokens, self.buffer_locs, self.lru,
                self.req_to_host, self.host_full[CANARY:-CANARY], self.device_full[CANARY:-CANARY], self.hot)


def _choice(g: torch.Generator, n: int, k: int) -> torch.Tensor:
    return torch.randperm(n, generator=g)[:k]


def _request_tables(g, hot, width, max_ctx, cur_len, long_used, slots, p_no_host, host_pool):
    """Tokens, locs, lru and host map of one request (all positions < max_ctx)."""
    cap = width if long_used else int(torch.randint(0, width + 1, (1,), generator=g))
    locs = torch.full((width,), -1, dtype=torch.int64)
    locs[:cap] = slots[:cap]
    tokens = torch.full((width,), -1, dtype=torch.int32)
    if cur_len <= hot and torch.rand(1, generator=g) < 0.7:
        ident = torch.arange(min(cur_len, hot))
        tokens[: ident.numel()] = ident.int()  # the short-sequence identity layout
    else:
        held = int(torch.randint(0, hot + 1, (1,), generator=g))
        pos = _choice(g, max(cur_len, 1), min(held, max(cur_len, 1)))
        cols = _choice(g, hot, pos.numel())
        tokens[cols] = pos.int()
    extra = width - hot
    draft = torch.randint(-1, max(cur_len + 4, 1), (extra,), generator=g).int()
    tokens[hot:] = draft  # newest/draft zone: may repeat hot tokens or each other (first match wins)
    lru = torch.randperm(hot, generator=g).int()
    host = host_pool[:max_ctx].clone()
    host[torch.rand(max_ctx, generator=g) < p_no_host] = -1
    return tokens, locs, lru, host


def _top_k_row(g, k, n, tokens):
    """Entries mixing invalid values, held tokens, fresh positions and duplicates."""
    pool = torch.cat([torch.randint(-2, n + 3, (k,), generator=g),
                      tokens[torch.randint(0, tokens.numel(), (k,), generator=g)].long(),
                      torch.randint(max(n - 4 * k, 0), max(n, 1), (k,), generator=g)])
    row = pool[torch.randint(0, pool.numel(), (k,), generator=g)]
    dup = torch.rand(k, generator=g) < 0.2
    row[dup] = row[torch.randint(0, k, (k,), generator=g)][dup]
    return row.int()


def build_world(seed: int, *, num_reqs: int, num_steps: int, top_k: int, hot: int, extra: int,
                dim: int = 3, p_pad: float = 0.15, p_no_host: float = 0.1) -> World:
    g = torch.Generator().manual_seed(seed)
    width, max_ctx = hot + extra, 3 * hot + 8
    n_rows = num_reqs + 1  # one row no request uses
    dev_rows, host_rows = n_rows * width + 3, n_rows * max_ctx + 3
    dev_slots = torch.randperm(dev_rows, generator=g)[: n_rows * width].view(n_rows, width)
    host_slots = torch.randperm(host_rows, generator=g)[: n_rows * max_ctx].view(n_rows, max_ctx)
    req_rows = torch.randperm(n_rows, generator=g)[:num_reqs]
    seq_lens = torch.zeros(num_reqs, num_steps, dtype=torch.int64)
    buffer_tokens = torch.full((n_rows, width), -1, dtype=torch.int32)
    buffer_locs = torch.full((n_rows, width), -1, dtype=torch.int64)
    lru = torch.stack([torch.randperm(hot, generator=g) for _ in range(n_rows)]).int()
    req_to_host = host_slots.clone()
    top_k_pos = torch.full((num_reqs, num_steps, top_k), -1, dtype=torch.int32)
    for b, row in enumerate(req_rows.tolist()):
        cur_len = int(torch.randint(1, max_ctx - num_steps + 1, (1,), generator=g))
        if torch.rand(1, generator=g) < 0.5:  # concentrate around the hot boundary
            cur_len = max(
                1, min(max_ctx - num_steps, hot - num_steps + int(torch.randint(0, 4, (1,), generator=g)))
            )
        lens = torch.arange(cur_len, cur_len + num_steps)
        lens[torch.rand(num_steps, generator=g) < p_pad] = 0
        seq_lens[b] = lens
        tables = _request_tables(
            g,
            hot,
            width,
            max_ctx,
            cur_len,
            bool((lens > hot).any()),
            dev_slots[row],
            p_no_host,
            host_slots[row],
        )
        buffer_tokens[row], buffer_locs[row], lru[row], req_to_host[row] = tables
        for s in range(num_steps):
            top_k_pos[b, s] = _top_k_row(g, top_k, max(int(lens[s]), cur_len), buffer_tokens[row])
    host_full = torch.arange((host_rows + 2 * CANARY) * dim, dtype=torch.float32).view(-1, dim) + 0.5
    device_full = -torch.arange((dev_rows + 2 * CANARY) * dim, dtype=torch.float32).view(-1, dim) - 0.25
    return World(
        top_k_pos,
        seq_lens,
        req_rows,
        buffer_tokens,
        buffer_locs,
        lru,
        req_to_host,
        host_full,
        device_full,
        hot,
    )


@st.composite
def worlds(draw, *, max_reqs: int = 3, max_steps: int = 4, hots=(4, 5, 8, 16)) -> World:
    hot = draw(st.sampled_from(hots))
    return build_world(
        draw(st.integers(0, 2**31 - 1)),
        num_reqs=draw(st.integers(1, max_reqs)),
        num_steps=draw(st.integers(1, max_steps)),
        top_k=draw(st.one_of(st.just(hot), st.integers(1, hot))),  # top_k == hot stops often
        hot=hot,
        extra=draw(st.integers(1, 4)),
        p_pad=draw(st.sampled_from([0.0, 0.2])),
        p_no_host=draw(st.sampled_from([0.0, 0.1, 0.4])),
    )


def assert_same(world_a: World, res_a: SwapInResult, world_b: World, res_b: SwapInResult, label: str) -> None:
    """Exact agreement of results and of every mutated table (canaries included)."""
    for name in ("slots", "steps_done", "hits", "misses", "unrecoverable", "bytes_copied"):
        a, b = getattr(res_a, name), getattr(res_b, name)
        assert torch.equal(a.cpu(), b.cpu()), f"{label}: {name} differs\n{a}\n{b}"
    for name in ("buffer_tokens", "lru", "device_full", "host_full"):
        a, b = getattr(world_a, name), getattr(world_b, name)
        assert torch.equal(a.cpu(), b.cpu()), f"{label}: {name} differs\n{a}\n{b}"
    steps = world_a.seq_lens.shape[1]
    for res in (res_a, res_b):  # a result that says whether every step was handled says it right
        if res.complete is not None:
            assert res.complete == bool((res.steps_done == steps).all()), f"{label}: complete is wrong"
        if world_a.hot >= steps * world_a.top_k_pos.shape[-1]:  # what a decode step counts on unread
            assert bool((res.steps_done == steps).all()), f"{label}: hot >= S * top_k, yet a step stopped"


def assert_canaries(before: World, after: World) -> None:
    for name in ("device_full", "host_full"):
        a, b = getattr(before, name), getattr(after, name)
        assert torch.equal(a[:CANARY], b[:CANARY]) and torch.equal(a[-CANARY:], b[-CANARY:]), f"{name} canary"
    assert torch.equal(before.host_full, after.host_full), "host_kv must not change"
    assert torch.equal(before.buffer_locs, after.buffer_locs), "buffer_locs must not change"
    assert torch.equal(before.req_to_host, after.req_to_host), "req_to_host must not change"
