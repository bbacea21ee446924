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
    res = stats["residency"]  # HiSparse has it in every mode
    assert value("hispec:residency_config_info", mode=res["mode"]) == 1
    assert value("hispec:num_requests_resident") == res["resident"]
    assert value("hispec:num_requests_demoted") == res["demoted"]
    for key in ("demotions", "promotions", "demoted_bytes", "promoted_bytes"):
        assert value(f"hispec:residency_{key}_total") == res[key]
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


class StatsOnly:
    """An engine that only answers ``stats()``, with the figures given."""

    def __init__(self, **extra: object) -> None:
        self.figures = {
            "requests": {"live": 5, "queued": 1, "ended": {"length": 2}},
            "throughput": {"tokens_generated": 40},
            "pools": {"device": {"free": 3, "capacity": 8}},
            **extra,
        }

    def stats(self) -> dict:
        return self.figures


def collected(engine) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What ``/metrics`` would show for ``engine``: (sample name, sorted labels) -> value."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pipeline.server.metrics import EngineCollector

    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_residency_metrics_come_from_the_stats():
    residency = {"mode": "dynamic", "resident": 3, "demoted": 2, "demotions": 7, "promotions": 4,
                 "demoted_bytes": 7 << 20, "promoted_bytes": 5 << 20}
    got = collected(StatsOnly(residency=residency))
    assert got[("hispec:residency_config_info", (("mode", "dynamic"),))] == 1
    assert got[("hispec:num_requests_resident", ())] == 3
    assert got[("hispec:num_requests_demoted", ())] == 2
    assert got[("hispec:residency_demotions_total", ())] == 7
    assert got[("hispec:residency_promotions_total", ())] == 4
    assert got[("hispec:residency_demoted_bytes_total", ())] == 7 << 20
    assert got[("hispec:residency_promoted_bytes_total", ())] == 5 << 20
    assert got[("hispec:num_requests_running", ())] == 4  # beside the others, unchanged


def test_no_residency_metrics_without_hisparse():
    """All-resident memory (``hisparse=None``) has no ``residency`` figures: no such metric."""
    got = collected(StatsOnly())
    assert got[("hispec:num_requests_waiting", ())] == 1
    assert not any("residency" in name or name.endswith(("_resident", "_demoted")) for name, _ in got)
