"""The sampling options of the API reach the engine: ``n`` choices, the penalties, ``logit_bias``,
``min_tokens``, ``echo``, and the checkpoint's generation defaults.

* ``n``: choice i equals a request of its own with ``seed + i`` (on a server without speculation:
  with it, a sampled request's tokens may depend on what runs beside it); streamed, the choices'
  chunks interleave tagged with their index; usage counts the prompt once; a client that leaves
  aborts every choice; a choice that fails fails the response and aborts the others.
* The penalties: the greedy text equals a reference greedy decode over the model's own logits with
  the penalty applied as defined (and differs from the text without it). ``logit_bias`` +100 on a
  token forces it; ``min_tokens`` keeps the end token out for that many tokens.
"""

from __future__ import annotations

import functools
import json

import anyio
import attrs
import httpx
import openai
import pytest
import torch
from _server_util import FAIL_SEED, MODEL_NAME, RunningServer, scrape, server_config, sse_data

from pipeline import Engine
from pipeline.model.reference import DecodeSession
from pipeline.server import create_app

PROMPT = "for item in items:"
EOS = 256


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def plain_server(tiny_model):
    """A server without speculation: a seeded sampled request gives the same tokens whatever runs
    beside it."""
    running = RunningServer(tiny_model, attrs.evolve(server_config(), speculative=None))
    yield running
    running.stop()
    assert running.server.pools_restored


@pytest.fixture(scope="module")
def plain_client(plain_server):
    with openai.OpenAI(base_url=plain_server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def completion(server, **fields) -> dict:
    response = server.client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(server, path: str, body: dict) -> list[dict]:
    with server.client.stream("POST", path, json={"model": MODEL_NAME, **body, "stream": True}) as response:
        assert response.status_code == 200
        events = list(sse_data(response.iter_lines()))
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# --- n ----------------------------------------------------------------------------------------------

SAMPLED = {"max_tokens": 8, "temperature": 0.9, "ignore_eos": True}
SAMPLED_CHAT = {"max_tokens": 8, "temperature": 0.9}  # ignore_eos goes in extra_body


def test_n_choices_each_equal_a_solo_request_with_seed_plus_index(plain_server):
    server = plain_server
    whole = completion(server, n=3, seed=40, **SAMPLED)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    solo = [completion(server, seed=40 + i, **SAMPLED)["choices"][0]["text"] for i in range(3)]
    assert [c["text"] for c in whole["choices"]] == solo
    assert all(c["finish_reason"] == "length" for c in whole["choices"])
    usage = whole["usage"]
    assert usage["prompt_tokens"] == len(PROMPT.encode())  # counted once
    assert usage["completion_tokens"] == 3 * 8 and usage["total_tokens"] == usage["prompt_tokens"] + 24
    # best_of equal to n is accepted (every choice is returned)
    assert [c["text"] for c in completion(server, n=3, best_of=3, seed=40, **SAMPLED)["choices"]] == solo
    # streamed: chunks tagged with their choice's index; each choice's text and end as above
    chunks = stream_events(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "n": 3, "seed": 40, **SAMPLED, "stream_options": {"include_usage": True}},
    )
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    assert texts == solo and reasons == ["length"] * 3
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24
    assert len({c["id"] for c in chunks}) == 1


def test_n_chat_choices_and_cached_tokens(plain_client, plain_server):
    client, server = plain_client, plain_server
    messages = [{"role": "user", "content": "Count to three, please, in Python."}]
    kwargs = dict(
        model=MODEL_NAME, messages=messages, n=2, seed=5, extra_body={"ignore_eos": True}, **SAMPLED_CHAT
    )
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    solo = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, seed=6, **SAMPLED_CHAT, extra_body={"ignore_eos": True}
    )
    assert second.choices[1].message.content == solo.choices[0].message.content
    # the second time every choice found the prompt's pages in the prefix cache (all but its last token)
    prompt_tokens = second.usage.prompt_tokens
    page = server.engine.config.page_size
    assert second.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // page * page
    assert second.usage.completion_tokens == 16
    # streamed: each choice's role chunk first, then the interleaved content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [
        (0, "assistant"),
        (1, "assistant"),
    ]
    texts = ["", ""]
    for chunk in chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert texts == [c.message.content for c in first.choices]


def counters(server) -> tuple[float, int]:
    disconnects = scrape(server.client)[("hispec:request_disconnects_total", ())]
    return disconnects, server.stats()["requests"]["ended"].get("abort", 0)


@pytest.mark.asyncio
async def test_a_client_leaving_aborts_every_choice(server):
    disconnects_before, aborts_before = counters(server)
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "n": 3,
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=120) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if any(json.loads(d)["choices"][0]["text"] for d in sse_data([line])):
                break  # leaving the block closes the connection mid-stream
    await anyio.to_thread.run_sync(server.wait_idle)
    disconnects, aborts = counters(server)
    assert (disconnects - disconnects_before, aborts - aborts_before) == (3, 3)
    assert server.pool_counts() == server.engine.initial_pool_counts


@pytest.mark.asyncio
async def test_a_non_streamed_request_with_n_is_aborted_when_its_client_leaves(server):
    disconnects_before, aborts_before = counters(server)
    state = server.server.state
    body = {"model": MODEL_NAME, "prompt": PROMPT, "n": 2, "max_tokens": 200, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http, anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(http.post, "/v1/completions", json=body))
        with anyio.fail_after(60):  # a hang guard, not a timing assertion
            while await anyio.to_thread.run_sync(server.call, lambda: len(state.in_flight)) < 2:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    await anyio.to_thread.run_sync(server.wait_idle)
    disconnects, aborts = counters(server)
    assert (disconnects - disconnects_before, aborts - aborts_before) == (2, 2)
    assert server.pool_counts() == server.engine.initial_pool_counts


def test_a_failing_choice_fails_the_response_and_aborts_the_others(server):
    # choice 1 samples with FAIL_SEED: the test engine fails it after its first delta
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "n": 3,
        "seed": FAIL_SEED - 1,
        "max_tokens": 200,
        "ignore_eos": True,
        "temperature": 0.5,
    }
    ended_before = sum(server.stats()["requests"]["ended"].values())
    response = server.client.post("/v1/completions", json=body)
    assert response.status_code == 500
    error = response.json()["error"]  # it names the failed choice's request; its reason is in the log
    assert error["code"] == "request_failed" and error["message"].endswith("-1)")
    chunks = stream_events(server, "/v1/completions", {k: v for k, v in body.items() if k != "model"})
    assert chunks[-1]["error"]["code"] == "request_failed" and chunks[-1]["error"]["message"].endswith("-1)")
    server.wait_idle()
    # each response: its 3 choices, and the one-step request that computed its prompt for them
    assert sum(server.stats()["requests"]["ended"].values()) - ended_before == 2 * (3 + 1)
    assert server.pool_counts() == server.engine.initial_pool_counts
    assert server.server.state.in_flight == {}


# --- penalties, logit_bias, min_tokens ------------------------------------------------------------


@torch.no_grad()
def reference_greedy(model, prompt_ids: list[int], max_tokens: int, adjust) -> list[int]:
    """Greedy decoding over the model's own logits, ``adjust(logits, output)`` applied to each."""
    output: list[int] = []
    for _ in range(max_tokens):
        seq = [*prompt_ids, *output]
        logits = model.logits(DecodeSession(model, len(seq) + 1).target(seq, 0))[-1].to(torch.float64)
        output.append(int(adjust(logits, output).argmax()))
    return output


def presence(value: float):
    def adjust(logits, output):
        seen = sorted(set(output))
        logits = logits.clone()
        logits[seen] -= value
        return logits

    return adjust


def frequency(value: float):
    def adjust(logits, output):
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=logits.numel())
        return logits - value * counts.to(logits) if output else logits

    return adjust


def repetition(prompt_ids: list[int], value: float):
    def adjust(logits, output):
        seen = sorted({*prompt_ids, *output})
        logits = logits.clone()
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / value, logits[seen] * value)
        return logits

    return adjust


def decoded(ids: list[int]) -> str:
    return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


PENALTIES = [
    ({"presence_penalty": 2.0}, lambda p: presence(2.0)),
    ({"frequency_penalty": 1.5}, lambda p: frequency(1.5)),
    ({"repetition_penalty": 1.8}, lambda p: repetition(p, 1.8)),
]


@pytest.mark.parametrize(("fields", "adjust"), PENALTIES, ids=[next(iter(f)) for f, _ in PENALTIES])
def test_a_penalty_changes_the_greedy_text_as_defined(server, tiny_model, fields, adjust):
    max_tokens = 24
    prompt_ids = list(PROMPT.encode())
    plain = completion(server, max_tokens=max_tokens, temperature=0, ignore_eos=True)["choices"][0]["text"]
    penalized = completion(server, max_tokens=max_tokens, temperature=0, ignore_eos=True, **fields)
    streamed = stream_events(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **fields},
    )
    server.wait_idle()
    want = decoded(reference_greedy(tiny_model, prompt_ids, max_tokens, adjust(prompt_ids)))
    assert decoded(reference_greedy(tiny_model, prompt_ids, max_tokens, lambda logits, _: logits)) == plain
    assert penalized["choices"][0]["text"] == want != plain
    assert "".join(c["choices"][0]["text"] for c in streamed) == want


def test_logit_bias_forces_a_token(client):
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={"65": 100}
    )
    assert got.choices[0].text == "AAAAAA"
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logit_bias={"66": 100, "65": -100},
    )
    assert chat.choices[0].message.content == "BBB"


def test_min_tokens_keeps_the_end_token_out(server):
    eager = {"max_tokens": 20, "temperature": 0, "logit_bias": {str(EOS): 100}}
    ended = completion(server, **eager)
    assert ended["usage"]["completion_tokens"] == 1 and ended["choices"][0]["finish_reason"] == "stop"
    held = completion(server, **eager, min_tokens=5)
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "stop"
    assert len(held["choices"][0]["text"]) <= 5  # the end token is not text


# --- echo -------------------------------------------------------------------------------------------


def test_echo_prepends_the_prompt(server):
    plain = completion(server, max_tokens=6, temperature=0)["choices"][0]["text"]
    assert completion(server, max_tokens=6, temperature=0, echo=True)["choices"][0]["text"] == PROMPT + plain
    ids = list(PROMPT.encode())
    by_ids = server.client.post(
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 6, "temperature": 0, "echo": True},
    ).json()
    assert by_ids["choices"][0]["text"] == PROMPT + plain
    chunks = stream_events(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True, "n": 2}
    )
    assert [c["choices"][0]["text"] for c in chunks[:2]] == [PROMPT, PROMPT]
    texts = ["", ""]
    for chunk in chunks:
        texts[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
    assert texts == [PROMPT + plain] * 2


# --- the checkpoint's generation defaults --------------------------------------------------------


class DefaultsEngine(Engine):
    """An engine whose checkpoint would say: greedy, 5 new tokens, top_k 3."""

    @property
    def generation_defaults(self) -> dict:
        return {"temperature": 0.0, "max_new_tokens": 5, "top_k": 3}


@pytest.mark.asyncio
async def test_unset_fields_take_the_checkpoint_defaults(tiny_model):
    engine = DefaultsEngine(server_config(max_running_requests=4), model=tiny_model)
    app = create_app(engine, served_model_name=MODEL_NAME)
    base = {"model": MODEL_NAME, "prompt": PROMPT, "ignore_eos": True}
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http,
        engine,
    ):
        defaulted = (await http.post("/v1/completions", json=base)).json()
        greedy = (await http.post("/v1/completions", json={**base, "temperature": 0, "max_tokens": 5})).json()
        assert defaulted["usage"]["completion_tokens"] == 5  # max_new_tokens, not OpenAI's 16
        assert defaulted["choices"][0]["text"] == greedy["choices"][0]["text"]  # temperature 0
        longer = (await http.post("/v1/completions", json={**base, "temperature": 0, "max_tokens": 7})).json()
        assert longer["usage"]["completion_tokens"] == 7  # the request's own value wins
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
        assert (await http.post("/v1/chat/completions", json=chat)).json()["usage"]["completion_tokens"] == 5
    assert engine.final_pool_counts == engine.initial_pool_counts


def test_sampling_params_precedence():
    from pipeline.server.generation import sampling_params
    from pipeline.server.protocol import ChatCompletionRequest, CompletionRequest

    defaults = {"temperature": 0.3, "top_p": 0.8, "top_k": 4, "repetition_penalty": 1.2}
    body = CompletionRequest(model="m", prompt="x", temperature=0.9, top_k=-1)
    params = sampling_params(body, 1, 100, prompt_field="prompt", defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.9, 0.8, 0, 1.2)
    assert params.max_new_tokens == 16  # OpenAI's default for completions
    params = sampling_params(body, 1, 100, prompt_field="prompt")
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.9, 1.0, 0, 1.0)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True)
    params = sampling_params(chat, 10, 100, prompt_field="messages", defaults={"max_new_tokens": 500})
    assert (params.temperature, params.max_new_tokens, params.logprobs) == (1.0, 90, 0)  # capped at the room
    biased = CompletionRequest(
        model="m", prompt="x", logit_bias={"7": -1, "3": 2.5}, min_tokens=2, logprobs=4
    )
    params = sampling_params(biased, 1, 100, prompt_field="prompt")
    assert (params.logit_bias, params.min_tokens, params.logprobs) == (((3, 2.5), (7, -1.0)), 2, 4)


def test_n_choices_share_one_computation_of_the_prompt(plain_server):
    """The prompt is computed once and its full pages shared by every choice through the prefix
    cache: each choice reports them as cached tokens, and the engine's cache saw them hit."""
    server = plain_server
    page = server.engine.config.page_size
    prompt = (
        "def fibonacci(n):\n    if n < 2:\n        return n\n"
        "    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    )
    before = server.stats()["prefix_cache"]
    whole = server.client.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "n": 3, "seed": 3, **SAMPLED}
    ).json()
    shared = (len(prompt.encode()) - 1) // page * page  # the full pages before the prompt's last token
    assert shared >= 3 * page
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
    after = server.stats()["prefix_cache"]
    assert after["hit_tokens"] - before["hit_tokens"] >= 3 * shared
