"""Bad requests get a 400 with OpenAI's error body naming the field, and the server keeps serving;
a request that fails inside the engine is a 500 for that request alone."""

from __future__ import annotations

import json

import pytest
from _server_util import FAIL_SEED, MAX_CONTEXT, MODEL_NAME, sse_data

GOOD = {"model": MODEL_NAME, "prompt": "x = ", "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

BAD_COMPLETIONS = [  # (changes to GOOD, the field named; None: delete the key)
    ({"max_tokens": "4"}, "max_tokens"),  # wrong type: strings are not integers
    ({"max_tokens": 4.5}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"stream": "yes"}, "stream"),
    ({"max_tokens": 0}, "max_tokens"),  # out of range
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"prompt": [1, 2, 99999]}, "prompt"),  # a token id outside the vocabulary
    ({"prompt": ""}, "prompt"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"n": 2}, "n"),  # unsupported values are refused, not ignored
    ({"echo": True}, "echo"),
    ({"logprobs": 3}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"colour": "blue"}, "colour"),  # unknown field
    ({"model": None}, "model"),  # missing fields
    ({"prompt": None}, "prompt"),
    ({"model": "gpt-4o"}, "model"),  # a model this server does not serve
    ({"prompt": "y" * MAX_CONTEXT}, "prompt"),  # a prompt over the context
    ({"prompt": "y" * (MAX_CONTEXT - 10), "max_tokens": 11}, "max_tokens"),  # prompt + output over it
]

BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        "messages.0.content",
    ),
    ({"messages": [{"role": "user", "content": "y" * MAX_CONTEXT}]}, "messages"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"n": 3}, "n"),
]


def body_with(base: dict, changes: dict) -> dict:
    body = dict(base)
    for key, value in changes.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def assert_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    if param is not None:
        assert error["message"].startswith(param.split(".")[0])
    return error


def assert_serving(server) -> None:
    good = server.client.post("/v1/completions", json=GOOD)
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(("changes", "param"), BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_completion_is_a_400_naming_the_field(server, changes, param):
    error = assert_error(server.client.post("/v1/completions", json=body_with(GOOD, changes)), 400, param)
    assert error["type"] == "invalid_request_error"
    assert_serving(server)


@pytest.mark.parametrize(("changes", "param"), BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_bad_chat_is_a_400_naming_the_field(server, changes, param):
    assert_error(server.client.post("/v1/chat/completions", json=body_with(CHAT, changes)), 400, param)
    assert_serving(server)


@pytest.mark.parametrize("raw", [b'{"model": "tiny-test", "prompt": ', b"not json", b"[1, 2]", b""])
def test_a_body_that_is_not_a_json_object_is_a_400(server, raw):
    response = server.client.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    error = assert_error(response, 400, None)
    assert "JSON" in error["message"] or "required" in error["message"]
    assert_serving(server)


def test_stream_error_messages_and_unknown_paths(server):
    assert_error(server.client.get("/v1/nowhere"), 404, None)
    assert_error(server.client.get("/v1/completions"), 405, None)
    error = assert_error(
        server.client.post("/v1/completions", json=body_with(GOOD, {"max_tokens": "4"})), 400, "max_tokens"
    )
    assert "'4'" in error["message"]


def test_a_request_failing_in_the_engine_is_a_500_for_it_alone(server):
    failing = body_with(GOOD, {"seed": FAIL_SEED, "max_tokens": 8})
    error = assert_error(server.client.post("/v1/completions", json=failing), 500, None)
    assert error["type"] == "internal_error" and "injected fault" in error["message"]
    # streamed: the stream carries the error, then [DONE]
    with server.client.stream("POST", "/v1/completions", json={**failing, "stream": True}) as response:
        assert response.status_code == 200
        events = list(sse_data(response.iter_lines()))
    assert events[-1] == "[DONE]"
    assert "injected fault" in json.loads(events[-2])["error"]["message"]
    assert_serving(server)
    server.wait_idle()
    assert server.pool_counts() == server.engine.initial_pool_counts
