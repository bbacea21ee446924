"""Day one with a real checkpoint, as a user runs it: each checkpoint users have (DeepSeek-V3.2 saved
by ``save_pretrained`` in bfloat16 in two shards; the same with an MTP layer in a third shard;
GLM-5; the re-saved one whose ``config.json`` names an MTP layer its weights lack) served by
``hispec serve`` with its defaults and an API key, driven by the official ``openai`` client.

Completions and chat, streamed and not, give the same greedy text, and completions give what
``hispec generate`` gives; log-probabilities come with the chosen token first among the greedy
alternatives; ``n=3`` gives three choices; the API key is required; speculation is on exactly for
the checkpoint whose weights hold the MTP layer, and the re-saved one says once why it is off."""

from __future__ import annotations

import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from _server_util import start_cli_server

openai = pytest.importorskip("openai")

KEY = "day-one-key"
PROMPT = "the quick brown fox"
NEW = 10
CHECKPOINTS = ["deepseek_checkpoint", "deepseek_mtp_checkpoint", "glm_checkpoint", "resaved_checkpoint"]


@pytest.fixture(scope="module", params=CHECKPOINTS)
def served(request, tmp_path_factory):
    checkpoint = request.getfixturevalue(request.param)
    log = tmp_path_factory.mktemp("serve") / "serve.jsonl"
    proc, url = start_cli_server(log, extra=["--model", str(checkpoint.path), "--api-key", KEY])
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    try:
        yield request.param, checkpoint, url, client, log
    finally:
        client.close()
        proc.terminate()
        assert proc.wait(timeout=120) == 0, proc.stderr.read()


def generate_cli(checkpoint) -> str:
    """The text ``hispec generate --temperature 0`` prints for PROMPT."""
    from pipeline.generate import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["--model", str(checkpoint.path), "--no-stream", "--temperature", "0",
                     "--max-new-tokens", str(NEW), PROMPT]) == 0
    printed = out.getvalue()
    body = printed.split(" tokens) ---\n", 1)[1].split("\n\nlifecycle", 1)[0]
    assert body.startswith(PROMPT)
    return body[len(PROMPT):]


def test_completions_streamed_and_not_equal_generate(served):
    _, checkpoint, _, client, _ = served
    whole = client.completions.create(
        model=str(checkpoint.path), prompt=PROMPT, max_tokens=NEW, temperature=0
    )
    stream = client.completions.create(
        model=str(checkpoint.path), prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert whole.choices[0].text == streamed
    assert whole.choices[0].text == generate_cli(checkpoint)


def test_chat_streamed_and_not_agree(served):
    _, checkpoint, _, client, _ = served
    messages = [{"role": "user", "content": "Tell me about the fox."}]
    whole = client.chat.completions.create(
        model=str(checkpoint.path), messages=messages, max_tokens=NEW, temperature=0
    )
    stream = client.chat.completions.create(
        model=str(checkpoint.path), messages=messages, max_tokens=NEW, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert whole.choices[0].message.content == streamed
    assert whole.usage.completion_tokens >= 1


def test_greedy_logprobs_rank_the_chosen_token_first(served):
    _, checkpoint, _, client, _ = served
    out = client.chat.completions.create(
        model=str(checkpoint.path),
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=NEW,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_n_choices(served):
    name, checkpoint, _, client, _ = served
    out = client.completions.create(
        model=str(checkpoint.path), prompt=PROMPT, max_tokens=NEW, temperature=1.0, seed=7, n=3
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    if name == "deepseek_mtp_checkpoint":
        return  # speculation: a choice equals a solo request's distribution, not its tokens (docs/server.md)
    for choice in out.choices:
        solo = client.completions.create(
            model=str(checkpoint.path), prompt=PROMPT, max_tokens=NEW, temperature=1.0, seed=7 + choice.index
        )
        assert solo.choices[0].text == choice.text


def test_the_api_key_is_required(served):
    _, checkpoint, url, _, _ = served
    body = {"model": str(checkpoint.path), "prompt": PROMPT, "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(url + "/v1/completions", json=body, headers=wrong, timeout=120).status_code == 401
    right = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(url + "/v1/completions", json=body, headers=right, timeout=120).status_code == 200
    assert httpx.get(url + "/health", timeout=120).status_code == 200


def test_speculation_is_on_exactly_when_the_weights_hold_the_mtp_layer(served):
    name, checkpoint, _, _, log = served
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    decided = [e for e in events if e.get("event") == "config.speculative"]
    assert [e["speculative"] for e in decided] == ["on" if checkpoint.mtp else "off"]
    missing = [e for e in events if e.get("event") == "model.mtp_missing"]
    assert len(missing) == (1 if name == "resaved_checkpoint" else 0)
