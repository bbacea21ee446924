"""Bad requests get a 400 with OpenAI's error body naming the field, and the server keeps serving;
a request that fails inside the engine is a 500 for that request alone, whose body names the request
and nothing internal (the details are in the log).

A prompt that cannot fit the context is refused before it is tokenized in full, and a long one is
tokenized off the event loop: the server answers others meanwhile.
"""

from __future__ import annotations

import io
import json
import threading

import httpx
import pytest
from _server_util import (
    BROKEN_SEED,
    CRASH_SEED,
    FAIL_SEED,
    HANG_S,
    MAX_CONTEXT,
    MODEL_NAME,
    SECRET,
    sse_data,
)

from pipeline.logs import configure_logging
from pipeline.model.tokenizer import ByteTokenizer

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
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"best_of": 3}, "best_of"),  # unsupported values are refused, not ignored
    ({"suffix": "end"}, "suffix"),
    ({"echo": True, "logprobs": 1}, "echo"),  # would need the prompt's logprobs
    ({"logprobs": 6}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),  # outside the vocabulary (the engine's check)
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5}, "min_tokens"),  # more than max_tokens
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
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": 20}, "n"),
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


class LogEvents:
    """A log processor keeping every event (as a dict); ``wait_for`` one that matches."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._changed = threading.Condition()

    def __call__(self, logger, method, event: dict) -> dict:
        with self._changed:
            self.events.append(dict(event))
            self._changed.notify_all()
        return event

    def wait_for(self, **fields) -> dict:
        def found() -> list[dict]:
            return [e for e in self.events if all(e.get(k) == v for k, v in fields.items())]

        with self._changed:
            assert self._changed.wait_for(found, timeout=HANG_S), fields
            return found()[0]

    def at_least(self, level: str) -> list[dict]:
        order = ["debug", "info", "warning", "error", "critical"]
        return [e for e in self.events if order.index(e["level"]) >= order.index(level)]


@pytest.fixture
def logs():
    """Info logging with every event kept (the suite's autouse fixture restores structlog after)."""
    events = LogEvents()
    sink = configure_logging(json=True, level="info", stream=io.StringIO(), processors=[events])
    yield events
    sink.close()


def request_id_of(message: str) -> str:
    assert message.startswith("internal error (request id: ") and message.endswith(")"), message
    return message.removeprefix("internal error (request id: ").removesuffix(")")


def test_a_request_failing_in_the_engine_is_a_500_for_it_alone(server, logs):
    failing = body_with(GOOD, {"seed": FAIL_SEED, "max_tokens": 8})
    error = assert_error(server.client.post("/v1/completions", json=failing), 500, None)
    assert error["type"] == "internal_error" and error["code"] == "request_failed"
    request_id = request_id_of(error["message"])  # the reason is in the log, not in the body
    # streamed: the stream carries the error, then [DONE]
    with server.client.stream("POST", "/v1/completions", json={**failing, "stream": True}) as response:
        assert response.status_code == 200
        events = list(sse_data(response.iter_lines()))
    assert events[-1] == "[DONE]"
    streamed = json.loads(events[-2])["error"]
    assert streamed["code"] == "request_failed"
    for rid in (request_id, request_id_of(streamed["message"])):
        ended = logs.wait_for(event="server.request_ended", request_id=rid)
        assert ended["outcome"] == "failed" and ended["finish_reason"] == "injected fault"
    assert_serving(server)
    server.wait_idle()
    assert server.pool_counts() == server.engine.initial_pool_counts


@pytest.mark.parametrize("seed", [CRASH_SEED, BROKEN_SEED], ids=["in-the-stream", "at-submission"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_unexpected_error_is_a_500_naming_the_request_only(server, logs, seed, path):
    body = body_with(GOOD if path == "/v1/completions" else CHAT, {"seed": seed, "max_tokens": 8})
    response = server.client.post(path, json=body)
    with server.client.stream("POST", path, json={**body, "stream": True}) as streamed:
        events = list(sse_data(streamed.iter_lines())) if streamed.status_code == 200 else None
        if events is None:
            streamed.read()
    errors = [assert_error(response, 500, None)]
    if events is None:  # failed before the stream began: a plain 500
        errors.append(assert_error(streamed, 500, None))
    else:
        assert events[-1] == "[DONE]"
        errors.append(json.loads(events[-2])["error"])
    for error in errors:
        assert error["type"] == "internal_error"
        assert SECRET not in error["message"] and "RuntimeError" not in error["message"]
        entry = logs.wait_for(event="server.internal_error", request_id=request_id_of(error["message"]))
        assert entry["level"] == "error" and SECRET in repr(entry["exc_info"])  # with its traceback
    assert_serving(server)
    server.wait_idle()
    assert server.pool_counts() == server.engine.initial_pool_counts


SURROGATES = [  # (path, body with a lone surrogate written as a JSON escape, the field named)
    ("/v1/completions", '{"model": "tiny-test", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "tiny-test", "prompt": ["a\\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "tiny-test", "prompt": "ab", "stop": ["\\ud800"]}', "stop"),
    (
        "/v1/chat/completions",
        '{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}, '
        '{"role": "user", "content": "a\\ud800"}]}',
        "messages.1.content",
    ),
    (
        "/v1/chat/completions",
        '{"model": "tiny-test", "messages": [{"role": "user", "content": '
        '[{"type": "text", "text": "\\udc00"}]}]}',
        "messages.0.content",
    ),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
]


@pytest.mark.parametrize(("path", "raw", "param"), SURROGATES, ids=[f"{p}-{f}" for p, _, f in SURROGATES])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, logs, path, raw, param):
    response = server.client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    error = assert_error(response, 400, param)
    assert "surrogate" in error["message"]
    assert not logs.at_least("error")
    assert_serving(server)


class EncodeSpy:
    """``ByteTokenizer.encode`` patched: records the length of every text and the thread it ran on;
    with ``hold``, an encoding of a text longer than ``hold`` waits for ``release``."""

    def __init__(self, monkeypatch, hold: int | None = None) -> None:
        self.calls: list[tuple[int, threading.Thread]] = []
        self.hold = hold
        self.holding = threading.Event()
        self.release = threading.Event()
        original = ByteTokenizer.encode

        def encode(tokenizer, text):
            self.calls.append((len(text), threading.current_thread()))
            if self.hold is not None and len(text) > self.hold:
                self.holding.set()
                assert self.release.wait(timeout=HANG_S)
            return original(tokenizer, text)

        monkeypatch.setattr(ByteTokenizer, "encode", encode)


HUGE = 2_000_000  # characters: far more than any context holds, and well within the body limit


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**GOOD, "prompt": "y" * HUGE}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "y" * HUGE}]}, "messages"),
        ("/tokenize", {"prompt": "y" * HUGE}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "y" * HUGE}]}, "messages"),
    ],
    ids=["completion", "chat", "tokenize-prompt", "tokenize-messages"],
)
def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(server, monkeypatch, path, body, param):
    spy = EncodeSpy(monkeypatch)
    error = assert_error(server.client.post(path, json=body), 400, param)
    assert error["code"] == "context_length_exceeded" and str(MAX_CONTEXT) in error["message"]
    assert all(length <= MAX_CONTEXT for length, _ in spy.calls), [n for n, _ in spy.calls]
    assert_serving(server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_long_prompt_is_tokenized_off_the_event_loop(server, monkeypatch, path):
    from pipeline.server import prompts

    monkeypatch.setattr(prompts, "chars_per_token", lambda tokenizer: None)  # no bound: tokenized in full
    spy = EncodeSpy(monkeypatch, hold=prompts.OFF_LOOP_CHARS)
    long = "z" * (2 * prompts.OFF_LOOP_CHARS)
    body = (
        {"prompt": long}
        if path != "/v1/chat/completions"
        else {"messages": [{"role": "user", "content": long}]}
    )
    if path != "/tokenize":
        body = {**body, "model": MODEL_NAME, "max_tokens": 2}
    answers: list[httpx.Response] = []
    sender = threading.Thread(
        target=lambda: answers.append(httpx.post(server.url + path, json=body, timeout=HANG_S)), daemon=True
    )
    sender.start()
    try:
        assert spy.holding.wait(timeout=HANG_S)
        # the long text is being tokenized: the event loop still answers
        assert httpx.get(server.url + "/health", timeout=HANG_S).status_code == 200
    finally:
        spy.release.set()
        sender.join(timeout=HANG_S)
    loop_thread = server.call(threading.current_thread)
    long_calls = [thread for length, thread in spy.calls if length > prompts.OFF_LOOP_CHARS]
    assert long_calls and all(thread is not loop_thread for thread in long_calls)
    assert answers[0].status_code in (200, 400), answers[0].text  # /tokenize counts it; the others: too long
    assert_serving(server)
