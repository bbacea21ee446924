"""Top-k trace recording: one record per request, layer and token, in contract order."""

from __future__ import annotations

import torch

from pipeline.config import EngineConfig, HiSparseConfig
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.hisparse.trace import read_trace
from pipeline.sampling import SamplingParams


def test_trace_records_every_selection(tiny_model, tmp_path):
    path = tmp_path / "topk.jsonl"
    config = EngineConfig(
        dtype="float64",
        page_size=4,
        max_context_len=128,
        max_running_requests=2,
        device_pool_tokens=128,
        hisparse=HiSparseConfig(device_buffer_size=16, host_to_device_ratio=2),
        speculative=None,
    )
    executor = Executor(config, model=tiny_model, trace_path=str(path))
    driver = SyncDriver(executor)
    reqs = driver.generate(
        [[1, 2, 3, 4, 5] * 6, [9, 8, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True)
    )
    executor.close()
    records = read_trace(path)
    layers = tiny_model.cfg.num_hidden_layers
    top_k = tiny_model.cfg.index_topk
    # prompt tokens plus every decoded token except the last sampled one, per layer
    expected = sum(len(r.prompt_ids) + len(r.output_ids) - 1 for r in reqs) * layers
    assert len(records) == expected
    by_request = {r.request_id for r in reqs}
    assert {rec["request"] for rec in records} == by_request
    for rec in records:
        picked = rec["top_k"]
        assert len(picked) == min(top_k, rec["position"] + 1)
        assert len(set(picked)) == len(picked)
        assert all(0 <= p <= rec["position"] for p in picked)
    long_req = reqs[0].request_id
    last = [r for r in records if r["request"] == long_req and r["layer"] == 0][-1]
    assert last["position"] == len(reqs[0].prompt_ids) + len(reqs[0].output_ids) - 2
    assert torch.tensor(last["top_k"]).numel() == top_k
