"""Verify binding and finalize take a whole batch in one pass of tensor operations: a round over
several requests must leave the HiSparse memory exactly as the same round does one request at a
time (the tables, the mappings, the device rows and the host copies), whatever the requests'
lengths (below, across and past the hot region), the accepted counts, and a request whose host
pages run out in finalize."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.executor import Executor
from pipeline.memory import HostPool, OutOfMemory

LAYERS, ROW_DIM, PAGE, HOT, MAX_CTX = 2, 6, 8, 16, 72


def _memory(draft_tokens: int):
    """An executor's HiSparse coordinator, built from the config as serving builds it, over a stub
    of what the executor reads of a model (nothing is run)."""
    cfg = SimpleNamespace(
        index_topk=HOT // 2, num_nextn_predict_layers=1, max_position_embeddings=None,
        num_hidden_layers=LAYERS, kv_row_dim=ROW_DIM, kv_lora_rank=ROW_DIM - 2, qk_rope_head_dim=2,
        index_head_dim=2, index_n_heads=2,
        num_attention_heads=2, eos_token_id=None, vocab_size=257, indexer_types=(),
    )
    config = EngineConfig(
        page_size=PAGE, max_context_len=MAX_CTX, max_running_requests=3, device_pool_tokens=PAGE * 24,
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2),
        speculative=SpeculativeConfig(num_steps=draft_tokens - 1, max_batch_size=8),
    )
    return Executor(config, model=SimpleNamespace(cfg=cfg, dtype=torch.float32))


def _stamp(row: int, position: int, round_: int) -> torch.Tensor:
    """The KV a forward writes for ``position`` of ``row`` in round ``round_`` (every layer)."""
    base = 1000.0 * row + 10.0 * position + round_
    return base + torch.arange(LAYERS * ROW_DIM, dtype=torch.float32).view(LAYERS, ROW_DIM) / 64


def _admit(memory, prompts: list[int]) -> list[int]:
    rows = []
    for prompt in prompts:
        row = memory.admit(prompt)
        targets = memory.prefill_targets(row, 0, prompt)
        stamps = torch.stack([_stamp(row, p, -1) for p in range(prompt)], dim=1)
        memory.device_kv[:, targets.slots.long()] = stamps
        memory.commit_prefill(row, 0, prompt, final=True)
        memory.start_staging(row, prompt)
        rows.append(row)
    memory.wait_staging()
    assert sorted(memory.collect_ready(speculative=True)) == sorted(rows)
    return rows


def _round(memory, rows: list[int], accepted: list[int], d: int, round_: int, short: int | None) -> list[int]:
    """One verify round over ``rows`` together: bind, the forward's writes, finalize (the host pool
    refusing row ``short`` more pages there)."""
    lengths = [memory.length(r) for r in rows]
    layout = memory.prepare_verify(rows, d)
    stamps = [_stamp(r, n + j, round_) for r, n in zip(rows, lengths) for j in range(d)]
    memory.device_kv[:, layout.targets.slots.long()] = torch.stack(stamps, dim=1)
    real = HostPool.reserve

    def reserve(self, row, length):
        if row == short:
            raise OutOfMemory("host", 1, 0)
        return real(self, row, length)

    before = _row_state(memory, short) if short in rows else None
    HostPool.reserve = reserve
    try:
        failed = memory.finalize_verify(rows, accepted, layout)
    finally:
        HostPool.reserve = real
    if before is not None:  # the row finalize could not take is left as it was
        assert failed.count(short) == 1
        after = _row_state(memory, short)
        for key in before:
            assert torch.equal(before[key], after[key]), f"a failed finalize changed its row's {key}"
    return failed


def _row_state(memory, row: int) -> dict[str, torch.Tensor]:
    """What finalize may change of one row: its columns, mappings, KV, host copies and length."""
    memory.wait_backups()
    locs = memory.req_to_token[row]
    return {
        "tokens": memory.buffers.tokens[:, row].clone(),
        "locs": memory.buffers.locs[row].clone(),
        "mapping": memory.alloc.lookup(locs.clamp(min=0)).clone(),
        "device_kv": memory.device_kv[:, memory.buffers.locs[row].clamp(min=0)].clone(),
        "req_to_host": memory.host.req_to_host[row].clone(),
        "length": torch.tensor(memory.length(row)),
    }


def _check_finalized(memory, row: int, start: int, count: int, d: int, round_: int, held: int) -> None:
    """The five steps of finalize (``pipeline/hisparse/verify.py``), as seen after it, for one
    committed row; ``held``: the position its newest column held before the round (-1: none)."""
    buffers, hot = memory.buffers, memory.hot
    memory.wait_backups()
    if held >= 0:  # 4. the token the newest column held keeps only its host copy
        assert int(memory.alloc.lookup(memory.req_to_token[row, held].reshape(1))) == 0
    locs = memory.req_to_token[row, start : start + d]
    mapping = memory.alloc.lookup(locs)
    last = start + count - 1
    newest = buffers.locs[row, buffers.newest]
    for j in range(d):
        position = start + j
        if position == last:  # 4. the last accepted token sits in the newest column
            assert int(mapping[j]) == int(newest)
            assert torch.equal(memory.device_kv[:, newest], _stamp(row, position, round_))
        elif j < count and position < hot:  # 2. other accepted positions below HOT keep their hot column
            assert int(mapping[j]) == int(buffers.locs[row, position])
        else:  # 1. rejected, or accepted past HOT: no device copy
            assert int(mapping[j]) == 0
    assert int(buffers.tokens[0, row, buffers.newest]) == last
    assert bool((buffers.tokens[:, row, hot + 1 :] == -1).all())  # 5. the draft zone emptied
    host = memory.host.req_to_host[row, start : start + count]  # 3. every accepted token backed up
    want = torch.stack([_stamp(row, start + j, round_) for j in range(count)], dim=1)
    assert torch.equal(memory.host.kv[:, host], want)


def _state(memory, rows: list[int]) -> dict[str, torch.Tensor]:
    memory.wait_backups()
    return {
        "tokens": memory.buffers.tokens.clone(),
        "locs": memory.buffers.locs.clone(),
        "mapping": memory.alloc.logical_to_physical.clone(),
        "device_kv": memory.device_kv.clone(),
        "host_kv": memory.host.kv.clone(),
        "req_to_host": memory.host.req_to_host.clone(),
        "lengths": torch.tensor([memory.length(r) for r in rows]),
    }


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_batched_verify_round_equals_its_requests_one_at_a_time(data):
    d = data.draw(st.integers(2, 4), label="D")
    # below the hot region, reaching across it within a few rounds, and past it
    prompts = data.draw(st.lists(st.sampled_from([1, 3, HOT - 5, HOT - 2, HOT - 1, HOT, HOT + 3, 30]),
                                 min_size=2, max_size=3), label="prompts")
    rounds = data.draw(st.integers(1, 6), label="rounds")
    accepts = [[data.draw(st.integers(1, d)) for _ in prompts] for _ in range(rounds)]
    short_at = data.draw(st.none() | st.tuples(st.integers(0, rounds - 1), st.integers(0, len(prompts) - 1)),
                         label="host pool short for (round, request)")
    together, alone = _memory(d), _memory(d)
    try:
        memories = {"together": together.memory, "alone": alone.memory}
        rows = {name: _admit(m, prompts) for name, m in memories.items()}
        assert rows["together"] == rows["alone"]
        order = rows["together"]
        live = list(order)
        for round_, accepted in enumerate(accepts):
            live = [r for r in live if memories["together"].length(r) + d <= MAX_CTX]
            if not live:
                break
            live_accepts = [accepted[order.index(r)] for r in live]
            victim = order[short_at[1]] if short_at and short_at[0] == round_ else None
            starts = [memories["together"].length(r) for r in live]
            newest = memories["together"].buffers.newest
            held = [int(memories["together"].buffers.tokens[0, r, newest]) for r in live]
            together_failed = _round(memories["together"], live, live_accepts, d, round_, victim)
            alone_failed = [
                f
                for r, a in zip(live, live_accepts)
                for f in _round(memories["alone"], [r], [a], d, round_, victim)
            ]
            failed = {"together": together_failed, "alone": alone_failed}
            assert failed["together"] == failed["alone"] == ([victim] if victim in live else [])
            for name, memory in memories.items():
                for row in failed[name]:  # the executor releases a request finalize failed
                    memory.release(row)
                memory.check_integrity(data=True)
            for row, start, count, last_held in zip(live, starts, live_accepts, held):
                if row not in failed["together"]:
                    _check_finalized(memories["together"], row, start, count, d, round_, last_held)
            live = [r for r in live if r not in failed["together"]]
            one, other = _state(memories["together"], live), _state(memories["alone"], live)
            for key in one:
                assert torch.equal(one[key], other[key]), f"round {round_}: {key} differs"
    finally:
        together.close()
        alone.close()
