"""The official ``openai`` client against a real server: completions and chat, streamed and not.

Greedy requests: the streamed text equals the non-streamed text, and both equal what
``Engine.generate_text`` gives for the same prompt tokens.
"""

from __future__ import annotations

import openai
import pytest
from _server_util import MODEL_NAME

from pipeline import SamplingParams
from pipeline.server.chat import plain_template
from pipeline.server.protocol import ChatMessage

PROMPTS = ["def add(a, b):", "class Queue:\n    def"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def engine_text(server, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> tuple[str, int, str]:
    result = server.call(server.engine.generate_text, prompt_ids, SamplingParams(max_new_tokens=max_tokens))
    return result.text, len(result.token_ids), result.finish_reason


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert server.client.get("/health").json() == {"status": "ready"}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_streamed_equals_whole_equals_engine(client, server, prompt):
    whole = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text, num_tokens, reason = engine_text(server, list(prompt.encode()))
    assert whole.choices[0].text == text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert whole.choices[0].finish_reason == reason == chunks[-2].choices[0].finish_reason
    assert whole.usage.prompt_tokens == len(prompt.encode())
    assert whole.usage.completion_tokens == num_tokens
    # include_usage: a last chunk without choices carries the usage; the streamed request came
    # second, so the prefix cache held the whole prompt's pages but its last token (OpenAI's
    # prompt_tokens_details.cached_tokens)
    streamed = chunks[-1].usage
    assert chunks[-1].choices == [] and streamed.prompt_tokens == whole.usage.prompt_tokens
    assert streamed.completion_tokens == whole.usage.completion_tokens
    page = server.engine.config.page_size
    assert streamed.prompt_tokens_details.cached_tokens == (len(prompt.encode()) - 1) // page * page
    assert all(c.usage is None for c in chunks[:-1])
    assert {c.id for c in chunks} == {chunks[0].id} != {whole.id}


def test_completion_accepts_token_ids(client, server):
    ids = list(PROMPTS[0].encode())
    whole = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].text == engine_text(server, ids)[0]


def test_chat_streamed_equals_whole_equals_engine(client, server):
    messages = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "A stack class."}]
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    chunks = list(stream)
    rendered = plain_template([ChatMessage(**m) for m in messages])
    assert rendered == "system: Write Python.\nuser: A stack class.\nassistant: "
    text, num_tokens, reason = engine_text(server, list(rendered.encode()))
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert whole.choices[0].finish_reason == reason == chunks[-1].choices[0].finish_reason
    assert whole.usage.completion_tokens == num_tokens
    assert whole.usage.prompt_tokens == len(rendered.encode())


def test_stop_string_and_sampling_parameters(client, server):
    prompt = PROMPTS[1]
    text = engine_text(server, list(prompt.encode()), max_tokens=24)[0]
    stop = text[3:5] if len(text) >= 5 else None
    if stop:  # the engine cuts before the first occurrence of a stop string
        got = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop]
        )
        assert got.choices[0].text == text[: text.index(stop)]
        assert got.choices[0].finish_reason == "stop"
    # sampled with a seed: the same seed gives the same text (top_k and top_p pass through)
    kwargs = dict(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=8,
        temperature=0.9,
        top_p=0.9,
        seed=7,
        extra_body={"top_k": 20, "ignore_eos": True},
    )
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert first.choices[0].text == second.choices[0].text
    assert first.usage.completion_tokens == 8 and first.choices[0].finish_reason == "length"
    sampled = server.call(
        server.engine.generate_text,
        list(prompt.encode()),
        SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, top_k=20, seed=7, ignore_eos=True),
    )
    assert first.choices[0].text == sampled.text
