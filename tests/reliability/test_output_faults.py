"""A request whose output cannot be turned into text fails alone: a detokenizer that raises on one
request's tokens fails that request (``RequestFailed`` with the reason), the others get the tokens
of a fault-free run, the engine keeps serving and every pool comes back. A tokenizer that raises
on a prompt is a ``RequestError`` naming ``prompt`` at the call."""

from __future__ import annotations

import anyio
import pytest
from _reliability_util import small_config

from pipeline import Engine, RequestError, RequestFailed, SamplingParams
from pipeline.model.tokenizer import ByteTokenizer

PROMPTS = {"a": [10, 20, 30, 40, 50], "b": [7, 8, 9], "c": [100, 101, 102, 103]}
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


class FaultyTokenizer:
    """The byte-level tokenizer, except that decoding a text that holds ``poison`` raises, and so
    does encoding a text that holds "☠"."""

    def __init__(self, poison: int | None) -> None:
        self._inner = ByteTokenizer()
        self.poison = poison

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def decode(self, ids) -> str:
        if self.poison is not None and self.poison in ids:
            raise RuntimeError(f"cannot decode token {self.poison}")
        return self._inner.decode(ids)

    def encode(self, text: str) -> list[int]:
        if "☠" in text:
            raise TypeError("this tokenizer cannot encode that")
        return self._inner.encode(text)


async def serve_all(model, cfg, tokenizer) -> dict[str, object]:
    outcomes: dict[str, object] = {}
    async with Engine(cfg, model=model, tokenizer=tokenizer) as engine:

        async def one(rid: str) -> None:
            try:
                outcomes[rid] = await engine.generate_text(PROMPTS[rid], PARAMS, request_id=rid)
            except RequestFailed as exc:
                outcomes[rid] = exc

        with anyio.fail_after(120):  # hang guard
            async with anyio.create_task_group() as tg:
                for rid in PROMPTS:
                    tg.start_soon(one, rid)
            outcomes["after"] = await engine.generate_text(PROMPTS["b"], PARAMS)
        with pytest.raises(RequestError) as err:
            engine.generate("a ☠ prompt", PARAMS)
        assert err.value.field == "prompt" and "tokenizer" in str(err.value)
        assert engine.executor.pool_counts() == engine.initial_pool_counts
    assert engine.final_pool_counts == engine.initial_pool_counts
    return outcomes


@pytest.mark.asyncio
@pytest.mark.parametrize("num_steps", [None, 3], ids=["plain", "speculative"])
@pytest.mark.parametrize("hisparse", [True, False], ids=["hisparse", "resident"])
async def test_a_detokenizer_fault_fails_its_request_only(tiny_model, hisparse, num_steps):
    cfg = small_config(hisparse=hisparse, num_steps=num_steps)
    clean = await serve_all(tiny_model, cfg, FaultyTokenizer(None))
    others = {t for rid in ("b", "c") for t in clean[rid].token_ids}
    poison = next(t for t in clean["a"].token_ids[3:] if t not in others)  # a's alone, after its first tokens
    faulty = await serve_all(tiny_model, cfg, FaultyTokenizer(poison))
    assert isinstance(faulty["a"], RequestFailed) and "detokenized" in faulty["a"].reason
    for rid in ("b", "c"):
        assert faulty[rid].token_ids == clean[rid].token_ids
    assert faulty["after"].token_ids == clean["b"].token_ids
