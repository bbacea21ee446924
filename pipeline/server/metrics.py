"""Prometheus metrics of the server, named as vLLM names them (``hispec:`` in place of ``vllm:``).

Two sources:

* what the engine counts (``engine.stats()``), read at every scrape by ``EngineCollector``: running
  and waiting requests, generated tokens, ended requests by reason, pool occupancy, HiSparse
  counters per layer, dynamic residency (requests resident and demoted, demotions, promotions and
  the bytes each moved), speculative counters;
* with data-parallel replicas (``ReplicatedEngine``), every engine figure once per replica
  (``replica="0"``, ``"1"``, ...) and summed over the live ones (``replica="all"``), and
  ``hispec:replica_up`` (1 while a replica serves, 0 once it is lost or stopped);
* what the server observes per request (``ServerMetrics``): prompt tokens accepted, latency
  histograms from each request's final metrics (time to first token, end-to-end, queue time, time
  per output token), inter-token latency as the server receives the deltas (a delta of k tokens
  after a gap g counts k gaps of g/k, as SGLang counts them), and client disconnects.

Every app has its own ``CollectorRegistry``, so several apps can live in one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics_core import Metric as MetricFamily
from prometheus_client.registry import Collector

from pipeline.errors import EngineClosed

PREFIX = "hispec:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)  # fmt: skip
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                     1.0, 2.5, 5.0)  # fmt: skip


class EngineCollector(Collector):
    """Reads ``engine.stats()`` at scrape time (nothing while the engine is not running)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.engine.stats()
        except EngineClosed:
            return
        replicas = stats.get("replicas")
        if replicas is None:
            yield from engine_families(stats)
            return
        # replica="all": the gauges of the replicas serving, the counters of every replica that ever
        # served (a lost replica's counts stay in the total, which a scraper would otherwise read as
        # a counter reset)
        live = list(engine_families(stats))
        counted = {f.name: f for f in engine_families(stats.get("counted") or stats) if f.type == "counter"}
        total = [counted.get(f.name, f) if f.type == "counter" else f for f in live]
        sources = [("all", total)] + [(str(i), list(engine_families(s))) for i, s in enumerate(replicas)
                                      if s is not None]  # fmt: skip
        yield from _labelled(sources)
        up = GaugeMetricFamily(PREFIX + "replica_up", "1 while a replica serves, else 0.", labels=["replica"])
        for index, status in stats["replica_status"].items():
            up.add_metric([index], 1 if status == "serving" else 0)
        yield up


def engine_families(stats: dict[str, Any]) -> Iterator[Metric]:
    """The metric families of one ``Engine.stats()`` (or of a sum of several)."""
    requests = stats["requests"]
    yield _gauge(
        "num_requests_running",
        "Requests admitted (prefill, staging, decode).",
        requests["live"] - requests["queued"],
    )
    yield _gauge("num_requests_waiting", "Requests waiting for admission.", requests["queued"])
    yield _counter("generation_tokens", "Output tokens generated.", stats["throughput"]["tokens_generated"])
    ended = CounterMetricFamily(
        PREFIX + "request_success", "Requests ended, by finish reason.", labels=["finished_reason"]
    )
    for reason, count in sorted(requests["ended"].items()):
        ended.add_metric([reason], count)
    yield ended
    yield from _pools(stats["pools"])
    if stats.get("kv_cache"):
        yield from _kv_cache(stats["kv_cache"])
    if stats.get("hisparse"):
        yield from _hisparse(stats["hisparse"])
    if stats.get("residency"):
        yield from _residency(stats["residency"])
    if stats.get("speculative"):
        yield from _speculative(stats["speculative"])
    if stats.get("prefix_cache"):
        yield from _prefix_cache(stats["prefix_cache"])


def _labelled(sources: Iterable[tuple[str, list[Metric]]]) -> Iterator[Metric]:
    """Each family of every source once, its samples from every source with a ``replica`` label."""
    merged: dict[str, MetricFamily] = {}
    for replica, families in sources:
        for family in families:
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = MetricFamily(family.name, family.documentation, family.type)
            for sample in family.samples:
                into.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value)
    yield from merged.values()


# figures of ``Engine.stats()`` that describe each engine alike (the bytes of one KV row, the ranks of
# its tensor-parallel group): the sum of several engines keeps the first one's
SAME_ON_EVERY_ENGINE = (("kv_cache", "row_bytes"), ("kv_cache", "key_bytes"), ("tensor_parallel", "size"))


def sum_stats(many: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several engines' ``stats()`` as one: counts and per-layer lists summed, rates recomputed from
    the summed counts, a label (a dtype, a mode) and ``SAME_ON_EVERY_ENGINE`` taken from the first;
    empty without any."""
    if not many:
        return {}
    total = _sum(list(many))
    for section, key in SAME_ON_EVERY_ENGINE:  # a layout, not an amount: every replica's is the same
        alike = [s[section][key] for s in many if isinstance(s.get(section), dict) and key in s[section]]
        if alike:
            total[section][key] = alike[0]
    if isinstance(total.get("prefix_cache"), dict):
        cache = total["prefix_cache"]
        cache["hit_rate"] = _ratio(cache.get("hit_tokens", 0), cache.get("queried_tokens", 0))
    if isinstance(total.get("hisparse"), dict) and "hits" in total["hisparse"]:
        hs = total["hisparse"]
        hs["hit_rate"] = [_ratio(h, h + m) for h, m in zip(hs["hits"], hs["misses"], strict=True)]
    if isinstance(total.get("speculative"), dict):
        spec = total["speculative"]
        rounds, accepted = spec.get("verify_rounds", 0), spec.get("accepted_drafts", 0)
        spec["accept_rate"] = _ratio(accepted, spec.get("proposed_drafts", 0))
        spec["accept_length"] = (rounds + accepted) / rounds if rounds else None
    if isinstance(total.get("throughput"), dict):
        total["throughput"]["uptime_s"] = max(s["throughput"].get("uptime_s", 0.0) for s in many)
    return total


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


def _sum(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    if isinstance(first, dict):
        keys = list(dict.fromkeys(k for v in present if isinstance(v, dict) for k in v))
        return {k: _sum([v.get(k) for v in present if isinstance(v, dict)]) for k in keys}
    if isinstance(first, list):
        lists = [v for v in present if isinstance(v, list)]
        return [_sum([v[i] if i < len(v) else None for v in lists]) for i in range(max(map(len, lists)))]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(v for v in present if isinstance(v, (int, float)))
    return first


def _prefix_cache(cache: dict[str, float]) -> Iterator[Metric]:
    """vLLM's prefix-cache figures: tokens queried and hit, and the pages held."""
    yield _counter(
        "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", cache["queried_tokens"]
    )
    yield _counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", cache["hit_tokens"])
    yield _counter(
        "prefix_cache_evicted_pages", "Pages evicted from the prefix cache.", cache["evicted_pages"]
    )
    yield _gauge("prefix_cache_pages", "Pages the prefix cache holds.", cache["pages_held"])


def _kv_cache(kv: dict[str, Any]) -> Iterator[Metric]:
    """How KV is stored (vLLM's ``cache_config_info``) and the bytes it takes where."""
    info = GaugeMetricFamily(PREFIX + "cache_config_info", "KV cache storage (labels).",
                             labels=["cache_dtype", "row_bytes", "key_bytes"])
    info.add_metric([str(kv["dtype"]), str(kv["row_bytes"]), str(kv["key_bytes"])], 1)
    yield info
    memory = GaugeMetricFamily(PREFIX + "kv_cache_bytes", "Bytes of the KV memory layer, by memory.",
                               labels=["memory"])
    memory.add_metric(["device"], kv["device_bytes"])
    memory.add_metric(["host"], kv["host_bytes"])
    if "host_node_bytes" in kv:  # tensor parallelism: the host pools of the node's ranks (one when shared)
        memory.add_metric(["host_node"], kv["host_node_bytes"])
    yield memory


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


def _pools(pools: dict[str, dict[str, int]]) -> Iterator[Metric]:
    free = GaugeMetricFamily(PREFIX + "pool_free", "Free units of each memory pool.", labels=["pool"])
    capacity = GaugeMetricFamily(PREFIX + "pool_capacity", "Capacity of each memory pool.", labels=["pool"])
    for name, pool in pools.items():
        free.add_metric([name], pool["free"])
        capacity.add_metric([name], pool["capacity"])
    yield free
    yield capacity
    device = pools.get("device")
    if device and device["capacity"]:
        yield _gauge(
            "kv_cache_usage_perc",
            "Share of the device KV pool in use (0-1).",
            1 - device["free"] / device["capacity"],
        )


HISPARSE_COUNTERS = {
    "hits": ("hisparse_hits", "Top-k entries served from the device buffers."),
    "misses": ("hisparse_misses", "KV rows loaded host -> device on a miss."),
    "h2d_bytes": ("hisparse_h2d_bytes", "Bytes copied host -> device."),
    "d2h_bytes": ("hisparse_d2h_bytes", "Bytes copied device -> host."),
}


def _hisparse(hs: dict[str, list[int]]) -> Iterator[Metric]:
    for key, (name, doc) in HISPARSE_COUNTERS.items():
        family = CounterMetricFamily(PREFIX + name, doc + " Per layer.", labels=["layer"])
        for layer, value in enumerate(hs[key]):
            family.add_metric([str(layer)], value)
        yield family


def _residency(res: dict[str, Any]) -> Iterator[Metric]:
    """Dynamic residency (HiSparse only): where the decode rows' KV lives now, and the moves so far."""
    info = GaugeMetricFamily(PREFIX + "residency_config_info", "Residency mode (label).", labels=["mode"])
    info.add_metric([str(res["mode"])], 1)
    yield info
    yield _gauge("num_requests_resident", "Requests whose whole context is on the device.", res["resident"])
    yield _gauge(
        "num_requests_demoted", "Requests decoding through the hot buffer over the host copy.", res["demoted"]
    )
    yield _counter("residency_demotions", "Requests demoted (device -> hot buffer).", res["demotions"])
    yield _counter("residency_promotions", "Requests promoted (hot buffer -> device).", res["promotions"])
    yield _counter("residency_demoted_bytes", "Device bytes freed by demotions.", res["demoted_bytes"])
    yield _counter(
        "residency_promoted_bytes", "Bytes copied host -> device by promotions.", res["promoted_bytes"]
    )


def _speculative(spec: dict[str, Any]) -> Iterator[Metric]:
    yield _counter("spec_decode_num_drafts", "Verify rounds (one draft chain each).", spec["verify_rounds"])
    yield _counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", spec["proposed_drafts"])
    yield _counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec["accepted_drafts"])
    per_pos = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each draft position.",
        labels=["position"],
    )
    for pos, value in enumerate(spec["accepted_per_pos"]):
        per_pos.add_metric([str(pos)], value)
    yield per_pos
    yield _gauge(
        "spec_accept_length",
        "Tokens committed per verify round, the bonus token included.",
        spec["accept_length"] or 0.0,
    )
    yield _gauge("spec_accept_rate", "Accepted / proposed draft tokens.", spec["accept_rate"] or 0.0)


class ServerMetrics:
    """The server's own observations, beside the engine's counters, in one registry."""

    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=self.registry)

        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens",
            "Prompt tokens of the requests the engine accepted.",
            registry=self.registry,
        )
        self.disconnects = Counter(
            PREFIX + "request_disconnects",
            "Requests aborted because their client disconnected.",
            registry=self.registry,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to the first output token.")
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Gap between output tokens as the server receives them.",
            TOKEN_GAP_BUCKETS,
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the end of the request.")
        self.queue = histogram("request_queue_time_seconds", "Arrival to admission into a prefill.")
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Mean gap between a request's output tokens after the first.",
            TOKEN_GAP_BUCKETS,
        )

    def observe_delta(self, gap: float, num_tokens: int) -> None:
        """``num_tokens`` arrived ``gap`` seconds after the request's previous tokens."""
        share = gap / num_tokens
        for _ in range(num_tokens):
            self.itl.observe(share)

    def observe_finished(self, metrics: Any) -> None:
        """A request's final ``RequestMetrics`` (it ended with stop or length)."""
        for histogram, value in (
            (self.ttft, metrics.time_to_first_token),
            (self.e2e, metrics.e2e_latency),
            (self.queue, metrics.queue_time),
            (self.tpot, metrics.inter_token_latency),
        ):
            if value is not None:
                histogram.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
