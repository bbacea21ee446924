"""Helpers of the tensor-parallel tests: functions the spawned ranks run (importable by name)."""

from __future__ import annotations

import torch

from pipeline.model import ForwardLayout

from pipeline.distributed.group import TensorGroup, open_store
from pipeline.distributed.loading import StateDictSource, build_shard


def sharded_logits(rank: int, size: int, port: int, cfg, tensors: dict, ids: list[int], out_path: str) -> None:
    """One rank of a sharded forward over one prompt (a resident backend); rank 0 saves the
    target logits and the MTP logits of the prefill."""
    from _model_util import new_backend, run

    torch.set_num_threads(1)
    store = open_store(port, size + 1, host=False, timeout_s=60)
    group = TensorGroup(store, rank, size, timeout_s=60, device=torch.device("cpu"))
    model = build_shard(cfg, torch.float64, torch.device("cpu"), group, StateDictSource(tensors))
    n = len(ids)
    backend = new_backend(model, num_rows=n, num_requests=1, max_ctx=n)
    logits = run(model, backend, ids, torch.arange(n))
    backend = new_backend(model, num_rows=n, num_requests=1, max_ctx=n)
    pos = torch.arange(n)
    backend.begin(ForwardLayout(req_rows=torch.zeros_like(pos), positions=pos, write_locs=pos))
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(n), backend)
        mtp = model.mtp_forward(torch.tensor(ids), torch.arange(n), hidden, backend).logits
    if rank == 0:
        torch.save({"logits": logits, "mtp": mtp, "params": sum(p.numel() for p in model.parameters())}, out_path)
