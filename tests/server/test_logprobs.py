"""Logprobs through the API equal the log-softmax (float64) of the model's own logits.

The reference runs the model over prompt + output in one forward of its own (``DecodeSession``, all
KV resident: no paging, no HiSparse, no speculation) and takes each output position's logits,
divided by the request's temperature (1 for a greedy request, as vLLM reports it), and cut to the
request's top-k where it has one (cut tokens: -9999.0 in JSON). The output tokens are those the
engine gives for the same parameters (greedy, or sampled with a seed: the same tokens every time).
Completions (``logprobs: k``) and chat (``logprobs: true, top_logprobs: k``), streamed and not.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch
from _server_util import MODEL_NAME, sse_data

from pipeline import SamplingParams
from pipeline.model.reference import DecodeSession
from pipeline.server.chat import plain_template
from pipeline.server.logprobs import FLOOR
from pipeline.server.protocol import ChatMessage

PROMPT = "def fibonacci(n):"
MESSAGES = [{"role": "user", "content": "Sort a list."}]
MAX_TOKENS = 10
TOL = 1e-6


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def text_of(token_id: int) -> str:
    return bytes([token_id]).decode("utf-8", errors="replace") if token_id < 256 else ""


@torch.no_grad()
def reference(model, prompt_ids: list[int], output_ids: list[int], temperature: float = 1.0, top_k: int = 0):
    """``[len(output_ids), V]``: each output token's log-probabilities under the model's logits."""
    seq = [*prompt_ids, *output_ids[:-1]]
    hidden = DecodeSession(model, len(seq) + 1).target(seq, 0)
    logits = model.logits(hidden)[len(prompt_ids) - 1 :].to(torch.float64) / temperature
    if top_k:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def engine_ids(server, prompt_ids: list[int], **params) -> list[int]:
    result = server.call(server.engine.generate_text, prompt_ids, SamplingParams(**params))
    return list(result.token_ids)


def written(value: float) -> float:
    return value if value != float("-inf") else FLOOR


def expected_completion_logprobs(rows: torch.Tensor, ids: list[int], k: int) -> dict:
    tokens, values, tops, offsets, offset = [], [], [], [], 0
    for row, token in zip(rows, ids, strict=True):
        tokens.append(text_of(token))
        values.append(float(row[token]))
        top: dict[str, float] = {}
        for t in [*torch.topk(row, k).indices.tolist(), token]:
            top.setdefault(text_of(t), float(row[t]))
        tops.append(top)
        offsets.append(offset)
        offset += len(text_of(token))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def assert_completion_logprobs(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert got["text_offset"] == want["text_offset"]
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=TOL)
    assert len(got["top_logprobs"]) == len(want["top_logprobs"])
    for got_top, want_top in zip(got["top_logprobs"], want["top_logprobs"], strict=True):
        assert got_top.keys() == want_top.keys()
        assert got_top == pytest.approx(want_top, abs=TOL)


def merged_completion_logprobs(chunks: list[dict]) -> dict:
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for key in merged:
                merged[key] += choice["logprobs"][key]
    return merged


def test_completion_logprobs_greedy_equal_the_model_log_softmax(server, tiny_model):
    prompt_ids = list(PROMPT.encode())
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 5,
        "ignore_eos": True,
    }
    whole = server.client.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    with server.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        chunks = [json.loads(d) for d in sse_data(response.iter_lines()) if d != "[DONE]"]
    server.wait_idle()
    ids = engine_ids(server, prompt_ids, max_new_tokens=MAX_TOKENS, ignore_eos=True)
    want = expected_completion_logprobs(reference(tiny_model, prompt_ids, ids), ids, 5)
    choice = whole.json()["choices"][0]
    assert_completion_logprobs(choice["logprobs"], want)
    # the greedy token is the most likely one
    assert all(
        max(top.values()) == pytest.approx(lp)
        for top, lp in zip(want["top_logprobs"], want["token_logprobs"])
    )
    # streamed: each chunk carries its own tokens' logprobs; together they are the whole response's
    assert_completion_logprobs(merged_completion_logprobs(chunks), want)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


def test_completion_logprobs_zero_is_the_chosen_token_only(server, tiny_model):
    prompt_ids = list(PROMPT.encode())
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0}
    got = server.client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    ids = engine_ids(server, prompt_ids, max_new_tokens=4)
    rows = reference(tiny_model, prompt_ids, ids)
    assert got["token_logprobs"] == pytest.approx([float(r[t]) for r, t in zip(rows, ids)], abs=TOL)
    assert [list(top) for top in got["top_logprobs"]] == [[text_of(t)] for t in ids]
    # without logprobs: none
    body.pop("logprobs")
    assert server.client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"] is None


def assert_same_chat_logprobs(got: list, want: list) -> None:
    """Equal tokens, logprobs equal to float precision (the prefix cache may change the last bits)."""
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in got] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in want
    ]
    for a, b in zip(got, want, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=TOL)
        assert [t.logprob for t in a.top_logprobs] == pytest.approx(
            [t.logprob for t in b.top_logprobs], abs=TOL
        )


def assert_chat_logprobs(content, rows: torch.Tensor, ids: list[int], k: int) -> None:
    assert len(content) == len(ids)
    for entry, row, token in zip(content, rows, ids, strict=True):
        assert entry.token == text_of(token)
        assert entry.bytes == list(text_of(token).encode())
        assert entry.logprob == pytest.approx(written(float(row[token])), abs=TOL)
        want = [written(v) for v in torch.sort(row, descending=True).values[:k].tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(want, abs=TOL)
        for top in entry.top_logprobs:
            assert top.bytes == list(top.token.encode())


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0},
        {"temperature": 0.7, "seed": 3},
        {"temperature": 0.7, "seed": 3, "top_k": 5},  # 8 alternatives asked, 5 possible: 3 at -9999.0
    ],
    ids=["greedy", "sampled", "sampled-top-k"],
)
def test_chat_logprobs_equal_the_model_log_softmax(client, server, tiny_model, sampling):
    k = 8
    top_k = sampling.get("top_k", 0)
    kwargs = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=sampling["temperature"],
        seed=sampling.get("seed"),
        logprobs=True,
        top_logprobs=k,
        extra_body={"ignore_eos": True, **({"top_k": top_k} if top_k else {})},
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    server.wait_idle()
    prompt_ids = list(plain_template([ChatMessage(**m) for m in MESSAGES]).encode())
    params = {"max_new_tokens": MAX_TOKENS, "ignore_eos": True, **sampling}
    ids = engine_ids(server, prompt_ids, **params)
    temperature = sampling["temperature"] or 1.0
    rows = reference(tiny_model, prompt_ids, ids, temperature=temperature, top_k=top_k)
    assert_chat_logprobs(whole.choices[0].logprobs.content, rows, ids, k)
    if top_k:
        assert all(e.top_logprobs[-1].logprob == FLOOR for e in whole.choices[0].logprobs.content)
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert_same_chat_logprobs(streamed, whole.choices[0].logprobs.content)
    assert chunks[0].choices[0].logprobs is None  # the role chunk carries no tokens


def test_chat_logprobs_without_top_logprobs(client, server, tiny_model):
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True
    )
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens and all(e.top_logprobs == [] for e in content)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == whole.choices[0].message.content
