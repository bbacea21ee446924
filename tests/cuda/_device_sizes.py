"""The sizes the device suite runs at: DeepSeek-V3.2's attention on CUDA, small ones on a CPU."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class KernelCase:
    hot: int  # HOT: hot columns per request
    top_k: int  # the indexer's top-k
    extra: int = 16  # newest and draft columns past HOT
    requests: int = 2
    steps: int = 1  # query steps per request (a verify has several)

    @property
    def id(self) -> str:
        return f"hot{self.hot}-k{self.top_k}-s{self.steps}"


@attrs.frozen
class Sizes:
    name: str
    swap_in: tuple[KernelCase, ...]  # swap-in worlds
    heads: int  # attention heads of the sparse MLA cases
    latent: int  # C, the MLA latent
    rope: int  # R
    mla_top_k: int  # slots per query of the sparse MLA cases
    index_heads: int
    index_dim: int
    index_top_k: int
    index_context: int  # positions a request of the indexer cases holds
    row_dim: int  # a KV row (C + R) of the copy cases
    layers: int  # layers of the copy cases
    # the engine test at the model's attention shapes: model overrides, HOT, page, prompt lengths
    model: dict[str, Any]
    hot: int
    page: int
    prompts: tuple[int, ...]
    new_tokens: int


SMALL = Sizes(
    name="small",
    swap_in=(KernelCase(hot=16, top_k=8), KernelCase(hot=32, top_k=16, steps=3)),
    heads=4,
    latent=32,
    rope=8,
    mla_top_k=24,
    index_heads=4,
    index_dim=16,
    index_top_k=16,
    index_context=300,
    row_dim=40,
    layers=3,
    model=dict(kv_lora_rank=64, qk_rope_head_dim=16, index_n_heads=4, index_head_dim=32, index_topk=16,
               max_position_embeddings=1024),
    hot=32,
    page=8,
    prompts=(150, 90),
    new_tokens=12,
)

# DeepSeek-V3.2: MLA 512 + 64, 128 heads, an indexer of 64 heads of 128, top-k 2,048; HOT 4,096
V32 = Sizes(
    name="v32",
    swap_in=(
        KernelCase(hot=1024, top_k=128),  # the sizes the first Triton swap-in took
        KernelCase(hot=2048, top_k=256, steps=4),
        KernelCase(hot=4096, top_k=2048, requests=3),
        KernelCase(hot=4096, top_k=2048, requests=2, steps=2),
    ),
    heads=128,
    latent=512,
    rope=64,
    mla_top_k=2048,
    index_heads=64,
    index_dim=128,
    index_top_k=2048,
    index_context=32768,
    row_dim=576,
    layers=4,
    model=dict(kv_lora_rank=512, qk_rope_head_dim=64, index_n_heads=64, index_head_dim=128, index_topk=2048,
               num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=16384),
    hot=4096,
    page=16,
    prompts=(6500, 4500),
    new_tokens=16,
)

SIZES = {s.name: s for s in (SMALL, V32)}
