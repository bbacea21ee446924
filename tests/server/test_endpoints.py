"""The API key, ``/tokenize`` and ``/detokenize``, ``/version``, ``/v1/models/{id}`` and the access log.

* With an API key, every ``/v1`` route, ``/tokenize`` and ``/detokenize`` answer 401 (OpenAI's error
  body) without ``Authorization: Bearer <key>`` or with another key; ``/health``, ``/metrics`` and
  ``/version`` stay open. ``hispec serve`` takes the key from ``HISPEC_API_KEY`` when ``--api-key``
  is not given.
* The access log: one ``server.access`` line per request, with its method, path, status, seconds and
  client; none with ``--disable-access-log``.
"""

from __future__ import annotations

import io
import threading

import httpx
import openai
import pytest
from _server_util import MODEL_NAME, RunningServer, server_config, start_cli_server

from pipeline import Engine
from pipeline.cli import version
from pipeline.logs import configure_logging, read_json_lines
from pipeline.server import create_app
from pipeline.server.chat import plain_template
from pipeline.server.protocol import ChatMessage
from pipeline.server.serve import build_parser

KEY = "sk-test-0123"
COMPLETION = {"model": MODEL_NAME, "prompt": "x = ", "max_tokens": 2}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


class AccessLines:
    """A log processor keeping the ``server.access`` events; ``wait_for`` one that matches."""

    def __init__(self) -> None:
        self.lines: list[dict] = []
        self._changed = threading.Condition()

    def __call__(self, logger, method, event: dict) -> dict:
        if event.get("event") == "server.access":
            with self._changed:
                self.lines.append(dict(event))
                self._changed.notify_all()
        return event

    def wait_for(self, count: int = 1, **fields) -> list[dict]:
        """The lines with these fields, once there are ``count`` of them."""

        def found() -> list[dict]:
            return [e for e in self.lines if all(e.get(k) == v for k, v in fields.items())]

        with self._changed:
            assert self._changed.wait_for(lambda: len(found()) >= count, timeout=60), (fields, self.lines)
            return found()


@pytest.fixture
def access_lines():
    """Info logging with the access lines captured (the suite's autouse fixture restores structlog)."""
    lines = AccessLines()
    sink = configure_logging(json=True, level="info", stream=io.StringIO(), processors=[lines])
    yield lines
    sink.close()


@pytest.fixture(scope="module")
def keyed(tiny_model):
    running = RunningServer(tiny_model, api_key=KEY)
    yield running
    running.stop()
    assert running.server.pools_restored


def assert_401(response: httpx.Response) -> dict:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
    return error


def test_the_api_key_guards_v1_and_tokenize(keyed, access_lines):
    http = keyed.client
    wrong = {"Authorization": "Bearer nope"}
    right = {"Authorization": f"Bearer {KEY}"}
    assert "missing" in assert_401(http.post("/v1/completions", json=COMPLETION))["message"]
    assert "incorrect" in assert_401(http.post("/v1/completions", json=COMPLETION, headers=wrong))["message"]
    assert_401(http.get("/v1/models"))
    assert_401(http.get(f"/v1/models/{MODEL_NAME}", headers={"Authorization": KEY}))  # no scheme
    assert_401(http.post("/tokenize", json={"prompt": "x"}))
    assert_401(http.post("/detokenize", json={"tokens": [65]}, headers=wrong))
    assert_401(http.post("/v1/completions", content=b"not json"))  # before the body is read
    assert http.post("/v1/completions", json=COMPLETION, headers=right).status_code == 200
    assert http.post("/tokenize", json={"prompt": "x"}, headers=right).status_code == 200
    assert http.post(
        "/detokenize", json={"tokens": [65]}, headers={"authorization": f"bearer {KEY}"}
    ).json() == {"prompt": "A"}
    for path in ("/health", "/metrics", "/version"):
        assert http.get(path).status_code == 200, path
    # the official client: its api_key is the bearer token
    with (
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError),
    ):
        bad.models.list()
    with openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0) as good:
        assert [m.id for m in good.models.list().data] == [MODEL_NAME]
        assert (
            good.completions.create(model=MODEL_NAME, prompt="y", max_tokens=2).usage.completion_tokens >= 1
        )
    # the refusals are in the access log too
    line = access_lines.wait_for(2, path="/v1/models", status=401)[0]  # raw, then the official client
    assert line["method"] == "GET" and line["client"].startswith("127.0.0.1:")


def test_tokenize_and_detokenize_round_trip(server):
    http = server.client
    prompt = "def héllo():"
    got = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": prompt}).json()
    assert got == {"tokens": list(prompt.encode()), "count": len(prompt.encode()), "max_model_len": 256}
    assert http.post("/detokenize", json={"model": MODEL_NAME, "tokens": got["tokens"]}).json() == {
        "prompt": prompt
    }
    # messages: as a chat completion renders them (with the assistant's cue unless asked not to)
    rendered = plain_template([ChatMessage(**m) for m in MESSAGES])
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == list(rendered.encode())
    bare = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["tokens"] == list(plain_template([ChatMessage(**m) for m in MESSAGES], False).encode())
    assert http.post("/detokenize", json={"tokens": bare["tokens"]}).json()[
        "prompt"
    ] == rendered.removesuffix("assistant: ")
    # a chat completion's prompt_tokens is the count /tokenize gives
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"] == chat["count"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "messages"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/tokenize", {"prompt": "x", "colour": "red"}, "colour"),
        ("/detokenize", {"tokens": [65, 99999]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_tokenize_errors_name_the_field(server, path, body, param):
    response = server.client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_version_and_model_card(server):
    assert server.client.get("/version").json() == {"version": version()}
    card = server.client.get(f"/v1/models/{MODEL_NAME}")
    assert card.status_code == 200
    assert card.json() == server.client.get("/v1/models").json()["data"][0]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-4o")
    missing = server.client.get("/v1/models/org/other-model")
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found") and "org/other-model" in error[
        "message"
    ]


def test_every_request_gets_an_access_line(server, access_lines):
    assert server.client.post("/v1/completions", json=COMPLETION).status_code == 200
    with server.client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as response:
        response.read()
    assert server.client.get("/v1/nowhere").status_code == 404
    assert server.client.post("/v1/completions", json={**COMPLETION, "max_tokens": 0}).status_code == 400
    lines = access_lines.wait_for(2, method="POST", path="/v1/completions", status=200)  # whole and streamed
    assert all(line["seconds"] >= 0 and line["client"].startswith("127.0.0.1:") for line in lines)
    access_lines.wait_for(path="/v1/nowhere", status=404)
    access_lines.wait_for(path="/v1/completions", status=400)


@pytest.mark.asyncio
async def test_no_access_line_when_disabled(tiny_model, access_lines):
    engine = Engine(server_config(max_running_requests=4), model=tiny_model)
    quiet = create_app(engine, served_model_name=MODEL_NAME, access_log=False)
    logged = create_app(engine, served_model_name=MODEL_NAME)
    async with engine:
        for app in (quiet, logged):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
                assert (await http.post("/v1/completions", json=COMPLETION)).status_code == 200
            # the ASGI transport returns once the app has: its access line is written by then
            assert len(access_lines.lines) == (0 if app is quiet else 1)


def test_serve_flags():
    args = build_parser().parse_args(["--api-key", KEY, "--disable-access-log"])
    assert (args.api_key, args.disable_access_log) == (KEY, True)
    args = build_parser().parse_args([])
    assert (args.api_key, args.disable_access_log) == (None, False)


@pytest.mark.slow
def test_the_cli_takes_the_key_from_the_environment(tmp_path):
    log_path = tmp_path / "serve.jsonl"
    proc, url = start_cli_server(log_path, extra=["--disable-access-log"], env={"HISPEC_API_KEY": KEY})
    try:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 401
        keyed = httpx.post(
            url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        )
        assert keyed.status_code == 200
        assert httpx.get(url + "/health").status_code == 200
        proc.terminate()
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    records = read_json_lines(log_path)
    assert [r for r in records if r.get("event") == "server.request_ended"]  # logging is on
    assert not [r for r in records if r.get("event") == "server.access"]  # but not the access log
    assert KEY not in log_path.read_text()
