"""``/metrics`` parses with prometheus_client's parser and agrees with ``engine.stats()``; ``/health``
says 503 before the engine runs and while draining."""

from __future__ import annotations

import httpx
import pytest
from _server_util import MODEL_NAME, scrape, server_config

from pipeline import Engine
from pipeline.server import create_app


def test_metrics_match_engine_stats(server):
    before = scrape(server.client)
    prompt_tokens = 0
    for prompt in ("a = 1\n", "def g():", "for i in range(3):"):
        response = server.client.post(
            "/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        prompt_tokens += response.json()["usage"]["prompt_tokens"]
    chat = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 10,
        "stream": True,
    }
    with server.client.stream("POST", "/v1/chat/completions", json=chat) as response:
        assert response.read().endswith(b"data: [DONE]\n\n")
    prompt_tokens += len(b"user: hello\nassistant: ")
    server.wait_idle()
    stats = server.stats()
    got = scrape(server.client)

    def value(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    assert (
        value("hispec:prompt_tokens_total") - before.get(("hispec:prompt_tokens_total", ()), 0)
        == prompt_tokens
    )
    assert value("hispec:generation_tokens_total") == stats["throughput"]["tokens_generated"]
    for reason, count in stats["requests"]["ended"].items():
        assert value("hispec:request_success_total", finished_reason=reason) == count
    assert value("hispec:num_requests_running") == value("hispec:num_requests_waiting") == 0
    for pool, figures in stats["pools"].items():
        assert value("hispec:pool_free", pool=pool) == figures["free"] == figures["capacity"]
        assert value("hispec:pool_capacity", pool=pool) == figures["capacity"]
    kv = stats["kv_cache"]
    assert value("hispec:cache_config_info", cache_dtype=kv["dtype"], row_bytes=str(kv["row_bytes"]),
                 key_bytes=str(kv["key_bytes"])) == 1
    assert value("hispec:kv_cache_bytes", memory="device") == kv["device_bytes"] > 0
    assert value("hispec:kv_cache_bytes", memory="host") == kv["host_bytes"] > 0
    hs = stats["hisparse"]
    assert sum(hs["hits"]) > 0 and len(hs["hits"]) == server.engine.executor.model.cfg.num_hidden_layers
    for key in ("hits", "misses", "h2d_bytes", "d2h_bytes"):
        for layer, count in enumerate(hs[key]):
            assert value(f"hispec:hisparse_{key}_total", layer=str(layer)) == count
    spec = stats["speculative"]
    assert spec["verify_rounds"] > 0
    assert value("hispec:spec_decode_num_drafts_total") == spec["verify_rounds"]
    assert value("hispec:spec_decode_num_draft_tokens_total") == spec["proposed_drafts"]
    assert value("hispec:spec_decode_num_accepted_tokens_total") == spec["accepted_drafts"]
    for pos, count in enumerate(spec["accepted_per_pos"]):
        assert value("hispec:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == count
    assert value("hispec:spec_accept_length") == pytest.approx(spec["accept_length"])
    # latency histograms: one observation per request that finished (stop or length)
    finished = stats["requests"]["ended"].get("length", 0) + stats["requests"]["ended"].get("stop", 0)
    assert value("hispec:time_to_first_token_seconds_count") == finished
    assert value("hispec:e2e_request_latency_seconds_count") == finished
    assert value("hispec:time_to_first_token_seconds_bucket", le="+Inf") == finished
    assert value("hispec:inter_token_latency_seconds_count") > 0


@pytest.mark.asyncio
async def test_health_is_503_while_starting_and_draining(tiny_model):
    engine = Engine(server_config(max_running_requests=4), model=tiny_model)
    app = create_app(engine, served_model_name=MODEL_NAME)
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
        starting = await client.get("/health")
        assert (starting.status_code, starting.json()) == (503, {"status": "starting"})
        assert (await client.post("/v1/completions", json=body)).status_code == 503
        async with engine:
            assert (await client.get("/health")).json() == {"status": "ready"}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            app.state.hispec.drain(abort=True)
            draining = await client.get("/health")
            assert (draining.status_code, draining.json()) == (503, {"status": "draining"})
            refused = await client.post("/v1/completions", json=body)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert engine.final_pool_counts == engine.initial_pool_counts
