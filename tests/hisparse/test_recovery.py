"""A committed token is never lost: decoded while the request was short (in its identity column),
evicted from the hot region by long decoding, its KV is still recovered from host in every layer,
checked against the KV an all-resident run computed for the same position."""

from __future__ import annotations

import torch

from pipeline.config import EngineConfig, HiSparseConfig
from pipeline.driver import prefill_whole
from pipeline.executor import Executor, NewSequence
from pipeline.sampling import SamplingParams

HOT = 8
GREEDY = SamplingParams(max_new_tokens=10_000, ignore_eos=True)


def test_tokens_decoded_while_short_survive_eviction(tiny_model):
    config = EngineConfig(
        dtype="float64",
        page_size=4,
        max_context_len=256,
        max_running_requests=2,
        device_pool_tokens=256,
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2),
        speculative=None,
    )
    shadow_config = EngineConfig(
        dtype="float64",
        page_size=4,
        max_context_len=256,
        max_running_requests=2,
        device_pool_tokens=512,
        hisparse=None,
        speculative=None,
    )
    hs, res = Executor(config, model=tiny_model), Executor(shadow_config, model=tiny_model)
    prompt = (3, 1, 4)
    for ex in (hs, res):
        prefill_whole(ex, [NewSequence("r", prompt, GREEDY)])
        ex.wait_staging()
        assert ex.collect_ready() == ["r"]
    for _ in range(90):
        assert hs.decode(["r"]).tokens == res.decode(["r"]).tokens
    coord, truth = hs.memory, res.memory
    row, shadow_row = hs.seqs["r"].row, res.seqs["r"].row
    length = coord.length(row)
    early = torch.arange(len(prompt), HOT)  # decoded in the short phase, in identity columns then
    coord.wait_backups()
    for layer in range(coord.num_layers):  # every layer keeps its own hot region and LRU
        resident = set(coord.buffers.tokens[layer, row, : HOT + 1].tolist())
        evicted = [p for p in early.tolist() if p not in resident]
        assert evicted, f"layer {layer}: 90 decode steps should have evicted an early token from 8 columns"
        # ask for the evicted positions as a decode step of length `length` would
        top = torch.full((1, 1, tiny_model.cfg.index_topk), -1, dtype=torch.int32)
        top[0, 0, : len(evicted)] = torch.tensor(evicted, dtype=torch.int32)
        before = coord.counters.misses[layer]
        result = coord.swap_in(layer, top, torch.tensor([[length]]), torch.tensor([row]))
        assert coord.counters.misses[layer] - before == len(evicted), f"layer {layer}"
        slots = result.slots[0, 0, : len(evicted)].long()
        assert bool((slots > 0).all()), f"layer {layer}: an evicted committed token was not recovered"
        true_kv = truth.store.kv[layer, truth.req_to_token[shadow_row, torch.tensor(evicted)]]
        assert torch.equal(coord.device_kv[layer, slots], true_kv), f"layer {layer}: recovered KV differs"
    hs.check_integrity()
    for ex in (hs, res):
        ex.close()
