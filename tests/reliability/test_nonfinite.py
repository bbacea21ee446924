"""Non-finite numbers never become indices, and never crash the process: NaN weights in the MTP
layer (which once segfaulted the compiled attention loop: a NaN score left a rank of the top-k
unwritten) only spoil its drafts, which verification rejects, so the output is plain decoding's;
NaN weights in the target fail every request with a clear reason (its logits are not finite), and
the engine keeps serving with every pool restored."""

from __future__ import annotations

import anyio
import pytest
import torch
from _reliability_util import small_config

from pipeline import Engine, RequestFailed, SamplingParams

from tiny_models import build_tiny_model

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9] * n for n in (1, 2, 4)]
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


def poisoned(prefix: str):
    model = build_tiny_model(seed=3)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.startswith(prefix):
                weight.fill_(float("nan"))
    return model


async def serve(model, cfg) -> list[object]:
    out: list[object] = []
    async with Engine(cfg, model=model) as engine:
        with anyio.fail_after(120):  # hang guard
            for prompt in PROMPTS:
                try:
                    out.append(await engine.generate_text(prompt, PARAMS))
                except RequestFailed as exc:
                    out.append(exc)
        assert engine.executor.pool_counts() == engine.initial_pool_counts
    assert engine.final_pool_counts == engine.initial_pool_counts
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "resident"])
async def test_nan_mtp_weights_only_spoil_drafts(hisparse):
    plain = await serve(build_tiny_model(seed=3), small_config(hisparse=hisparse, num_steps=None))
    spec = await serve(poisoned("mtp."), small_config(hisparse=hisparse, num_steps=3))
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


@pytest.mark.asyncio
@pytest.mark.parametrize("num_steps", [None, 3], ids=["plain", "speculative"])
@pytest.mark.parametrize(
    "where", ["model.layers.1.mlp.gate", "model.embed_tokens", "model.layers.0.self_attn"]
)
async def test_nan_target_weights_fail_each_request_with_its_reason(where, num_steps):
    results = await serve(poisoned(where), small_config(hisparse=True, num_steps=num_steps))
    assert all(isinstance(r, RequestFailed) and "NaN or infinite" in r.reason for r in results), results
