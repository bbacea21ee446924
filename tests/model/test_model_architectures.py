"""DeepSeek-V3.2 with YaRN RoPE and GLM-MoE-DSA (GLM-5) against HF transformers, float64.

Random HF models, saved by HF, loaded by hispec (plus a random MTP layer written where real
checkpoints keep it: HF has none, so it only drafts; greedy output must not change). HF is
patched as in ``_hf_oracle`` (wide-dtype numerics, stable top-k). Per architecture:

* prefill logits equal HF's to 1e-9 over a context past ``original_max_position_embeddings`` (YaRN)
  and past ``index_topk``; every full layer's top-k equals HF's, and every GLM shared layer uses its
  full layer's;
* greedy tokens through the engine, HiSparse on with contexts past HOT, plain and speculative,
  equal HF ``generate``;
* GLM: one indexer pass per full layer per forward, and each shared layer swaps the same positions
  into its own buffer (its hit and miss counts equal its full layer's).
"""

from __future__ import annotations

import io

import anyio
import pytest
import structlog
import torch
from _checkpoints import add_mtp_layer
from _hf_oracle import hf_float64_patches, random_hf_model, tiny_glm_config, tiny_hf_config
from _model_util import new_backend, prefill_logits, run

import pipeline.hisparse.backend as hisparse_backend
from kernels import hisparse_attend_numba
from pipeline import Engine, EngineConfig, SamplingParams
from pipeline.config import HiSparseConfig, SpeculativeConfig
from pipeline.logs import configure_logging
from pipeline.model import load_model

HOT = 16
PAGE = 8
YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
    mscale=0.9, mscale_all_dim=0.7, beta_fast=32, beta_slow=1,
)
ARCHS = {
    "v32-yarn": lambda: tiny_hf_config(rope_parameters=dict(YARN), max_position_embeddings=128),
    "glm5": lambda: tiny_glm_config(max_position_embeddings=128),
}
PROMPT_LENS = (20, 80)  # past HOT; the longer one past original_max_position_embeddings (32)
MAX_NEW = 24


@pytest.fixture(autouse=True)
def quiet_logs():
    sink = configure_logging(level="warning", stream=io.StringIO())
    yield
    sink.close()
    structlog.reset_defaults()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, tmp_path_factory):
    hf_model = random_hf_model(ARCHS[request.param](), seed=21)
    ckpt = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(ckpt)
    add_mtp_layer(ckpt, seed=5)
    return hf_model, load_model(ckpt, dtype=torch.float64)


def _ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_the_loaded_config_is_the_architecture(pair):
    hf_model, ours = pair
    cfg = ours.cfg
    assert cfg.num_nextn_predict_layers == 1
    if cfg.model_type == "glm_moe_dsa":
        assert cfg.indexer_types == ("full", "shared", "full", "shared")
        assert cfg.indexer_rope == "interleaved"
        assert ours.model.layers[1].self_attn.indexer is None
    else:
        assert cfg.rope_yarn is not None and cfg.rope_yarn.factor == 4.0
        assert cfg.attn_scale == hf_model.model.layers[0].self_attn.scaling != cfg.qk_head_dim**-0.5
        assert cfg.rope.cos_sin_factor() == hf_model.model.rotary_emb.attention_scaling != 1.0
        assert torch.equal(cfg.rope.inv_freq(cfg.qk_rope_head_dim), hf_model.model.rotary_emb.inv_freq)


def test_prefill_logits_and_topk_match_hf(pair):
    hf_model, ours = pair
    n = 100
    ids = _ids(n, ours.cfg.vocab_size, 1)
    with hf_float64_patches(), torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    backend = new_backend(ours, num_rows=n, num_requests=1, max_ctx=n)
    got = run(ours, backend, ids, torch.arange(n))
    assert torch.allclose(got, expected, atol=1e-9, rtol=0), (got - expected).abs().max()
    assert torch.equal(prefill_logits(ours, ids), got)
    k = ours.cfg.index_topk
    last_full = None
    for layer, hf_layer in enumerate(hf_model.model.layers):
        mine = backend.topk[layer].long()
        if ours.cfg.indexer_kind(layer) == "shared":
            assert hf_layer.self_attn.indexer is None
            assert torch.equal(mine, backend.topk[last_full])
            continue
        last_full = layer
        theirs = hf_layer.self_attn.indexer.last_topk[0]
        for t in range(n):
            visible = min(k, t + 1)
            assert torch.equal(mine[t, :visible], theirs[t, :visible]), (layer, t)


def _engine_config(num_steps: int | None) -> EngineConfig:
    return EngineConfig(
        dtype="float64",
        page_size=PAGE,
        max_context_len=128,
        max_running_requests=4,
        device_pool_tokens=512,
        hisparse=HiSparseConfig(device_buffer_size=HOT, host_to_device_ratio=2),
        speculative=SpeculativeConfig(
            num_steps=num_steps,
            max_batch_size=None,
            timed=False,
            min_accept_length=None,
            plain_tail=False,
            plain_while_prefilling=False,
        )
        if num_steps
        else None,
    )


async def _engine_tokens(model, cfg: EngineConfig, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    outputs: dict[int, list[int]] = {}
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)

    async def consume(i: int, prompt: list[int]) -> None:
        result = await engine.generate_text(prompt, params)
        outputs[i] = list(result.token_ids)

    async with Engine(cfg, model=model) as engine:
        async with anyio.create_task_group() as tg:
            for i, prompt in enumerate(prompts):
                tg.start_soon(consume, i, prompt)
        stats = engine.stats()
    return [outputs[i] for i in range(len(prompts))], stats


@pytest.mark.asyncio
@pytest.mark.parametrize("num_steps", [None, 3], ids=["plain", "spec"])
async def test_engine_greedy_with_hisparse_matches_hf_generate(pair, num_steps):
    hf_model, ours = pair
    prompts = [_ids(n, ours.cfg.vocab_size, 10 + n) for n in PROMPT_LENS]
    with hf_float64_patches(), torch.no_grad():
        expected = [
            hf_model.generate(p[None], max_new_tokens=MAX_NEW, do_sample=False, use_cache=True)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    got, stats = await _engine_tokens(ours, _engine_config(num_steps), [p.tolist() for p in prompts])
    assert got == expected
    assert all(len(set(tokens)) > 3 for tokens in got)  # not a degenerate constant stream
    assert sum(stats["hisparse"]["misses"]) > 0  # contexts past HOT really swapped rows in


@pytest.mark.asyncio
async def test_glm_shared_layers_run_no_indexer_and_count_their_own_swaps(pair, monkeypatch):
    _, ours = pair
    if ours.cfg.model_type != "glm_moe_dsa":
        pytest.skip("shared indexer layers are GLM-5's")
    forwards, passes = [0], [0]
    real_topk, real_forward = hisparse_backend.indexer_topk, ours.forward

    def counted_topk(*args, **kwargs):
        passes[0] += 1
        return real_topk(*args, **kwargs)

    def counted_forward(*args, **kwargs):
        forwards[0] += 1
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(hisparse_backend, "indexer_topk", counted_topk)
    real_one_call, real_warm_up = hisparse_attend_numba.attend_views, hisparse_attend_numba.warm_up
    warming = [False]

    def counted_one_call(*args):  # a full layer's decode on a CPU: its indexer pass inside one call
        passes[0] += not warming[0]  # (the engine's start-up compiles it with one call)
        return real_one_call(*args)

    def warm_up(*args):
        warming[0] = True
        try:
            real_warm_up(*args)
        finally:
            warming[0] = False

    monkeypatch.setattr(hisparse_attend_numba, "attend_views", counted_one_call)
    monkeypatch.setattr(hisparse_attend_numba, "warm_up", warm_up)
    monkeypatch.setattr(ours, "forward", counted_forward)
    prompts = [_ids(n, ours.cfg.vocab_size, 30 + n).tolist() for n in PROMPT_LENS]
    _, stats = await _engine_tokens(ours, _engine_config(None), prompts)
    full = ours.cfg.num_full_indexer_layers
    assert full == 2 and forwards[0] >= MAX_NEW  # a prefill, then a decode step per token
    assert passes[0] == forwards[0] * full  # one pass per full layer per forward, none for shared ones
    hits, misses = stats["hisparse"]["hits"], stats["hisparse"]["misses"]
    for shared, source in ((1, 0), (3, 2)):
        # the same positions, swapped into the layer's own buffer with the same LRU history
        assert (hits[shared], misses[shared]) == (hits[source], misses[source])
        assert misses[shared] > 0
