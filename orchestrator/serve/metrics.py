"""Prometheus exposition: engine counters read from engine.stats() at scrape time + edge latency histograms."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PAGE_STATES = ("used", "cached", "host", "disk")     # per member; "free" is arena-wide (member="all")
# Latency buckets span a tiny CPU model (ms) to a large model under load (minutes).
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class EngineStatsCollector(Collector):
    """Turns one engine.stats() snapshot into metric families, so every scrape is self-consistent."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            s = self._stats()
        except Exception:  # a failing engine must not break /metrics; mfs_engine_up says so
            yield _gauge("mfs_engine_up", "1 when engine.stats() answered at this scrape", [], [((), 0)])
            return
        yield _gauge("mfs_engine_up", "1 when engine.stats() answered at this scrape", [], [((), 1)])
        counters = s.get("counters", {})
        pages = s.get("pages", {})
        members = list(s.get("members", []))

        yield _counter("mfs_requests", "requests that left the engine, by member and outcome",
                       ["member", "outcome"], [((m, o), n) for m, by in counters.get("requests", {}).items()
                                               for o, n in by.items()])
        yield _counter("mfs_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                       ["member"], _flat(counters.get("prefix_query_tokens", {})))
        yield _counter("mfs_prefix_cache_hits", "prompt tokens found in the prefix cache, by tier",
                       ["member", "tier"], [((m, t), n) for m, by in counters.get("prefix_hit_tokens", {}).items()
                                            for t, n in by.items()])
        yield _counter("mfs_escalations", "mid-request handovers from one member to a larger one",
                       ["from", "to"], [(tuple(k.split("->", 1)), n)
                                        for k, n in counters.get("escalations", {}).items() if "->" in k])
        yield _counter("mfs_preemptions", "requests preempted to free pages", [],
                       [((), counters.get("preemptions", 0))])
        yield _counter("mfs_preemptions_by_kind", "preemptions by kind (swap: blocks saved to the host tier)",
                       ["kind"], _flat(counters.get("preemptions_by_kind", {})))
        yield _counter("mfs_downgrades", "requests routed to a smaller member than scored best, under load",
                       ["from", "to"], [(tuple(k.split("->", 1)), n)
                                        for k, n in counters.get("downgrades", {}).items() if "->" in k])
        yield _counter("mfs_member_steps", "engine steps that ran the member's forward", ["member"],
                       _flat(counters.get("member_steps", {})))
        yield _counter("mfs_evictions", "cached pages evicted from the arena", [],
                       [((), counters.get("evictions", 0))])
        yield _counter("mfs_offloads", "pages copied to a lower tier", ["tier"],
                       _flat(counters.get("offloads", {})))
        warmups = counters.get("warmups", {})
        yield _counter("mfs_warmups", "speculative prefills on the next member (issued, later hit)",
                       ["outcome"], _flat(warmups))
        yield _counter("mfs_generated_tokens", "tokens generated", ["member"],
                       _flat(counters.get("generated_tokens", {})))
        yield _counter("mfs_prompt_tokens", "prompt tokens admitted", ["member"],
                       _flat(counters.get("prompt_tokens", {})))
        yield _counter("mfs_speculation_drafted_tokens", "tokens a smaller member drafted for a larger one",
                       ["draft", "target"], _pairs(counters.get("drafted_tokens", {})))
        yield _counter("mfs_speculation_accepted_tokens", "drafted tokens the larger member accepted",
                       ["draft", "target"], _pairs(counters.get("accepted_draft_tokens", {})))
        yield _counter("mfs_speculation_ride_tokens",
                       "tokens the draft member's own decodes took riding its draft forwards", ["member"],
                       _flat(counters.get("ride_tokens", {})))
        yield _counter("mfs_speculation_draft_length_steps",
                       "member batches that could draft, by the tokens drafted (0: none)", ["k"],
                       _flat(counters.get("draft_length_steps", {})))

        by_state = pages.get("by_state", {})
        page_rows = [(("free", "all"), by_state.get("free", 0))]
        for m, by in pages.get("by_member", {}).items():
            page_rows += [((state, m), by.get(state, 0)) for state in PAGE_STATES]
        yield _gauge("mfs_kv_pages", "KV pages by state (free is arena-wide: member=all)",
                     ["state", "member"], page_rows)
        yield _gauge("mfs_kv_pages_capacity", "pages in the arena", [], [((), pages.get("total", 0))])
        yield _gauge("mfs_kv_page_bytes", "bytes per page", [], [((), pages.get("page_bytes", 0))])
        yield _gauge("mfs_queue_depth", "requests waiting in the global queue", [],
                     [((), s.get("queue_depth", 0))])
        running = s.get("running", {})
        waiting = s.get("waiting", {})
        yield _gauge("mfs_running_requests", "admitted requests (prefilling or decoding)", ["member"],
                     [((m,), running.get(m, 0)) for m in members or running])
        yield _gauge("mfs_waiting_requests", "queued requests by routed member", ["member"],
                     [((m,), waiting.get(m, 0)) for m in members or waiting])
        waits = s.get("queue_wait_s", {})
        yield _gauge("mfs_queue_wait_seconds", "arrival to first admission, recent requests, by member and quantile",
                     ["member", "quantile"], [((m, q), w.get(q, 0.0)) for m, w in waits.items()
                                              for q in ("p50", "p90", "p99")])


def _pairs(by_pair: dict[str, Any]) -> list[tuple[tuple[str, ...], float]]:
    """{"a->b": n} -> ((a, b), n) rows."""
    return [(tuple(k.split("->", 1)), n) for k, n in by_pair.items() if "->" in k]


def _flat(by_key: dict[str, Any]) -> list[tuple[tuple[str, ...], float]]:
    return [((k,), v) for k, v in by_key.items()]


def _counter(name: str, doc: str, labels: list[str], rows) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for values, n in rows:
        family.add_metric(list(values), float(n))
    return family


def _gauge(name: str, doc: str, labels: list[str], rows) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels)
    for values, n in rows:
        family.add_metric(list(values), float(n))
    return family


class ServerMetrics:
    """One registry per app (tests run several apps in one process): engine collector + edge histograms."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineStatsCollector(stats))
        self.ttft_s = Histogram("mfs_ttft_seconds", "arrival to first generated token, at the server edge",
                                ["member"], buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.tpot_s = Histogram("mfs_tpot_seconds", "mean time per output token after the first, per request",
                                ["member"], buckets=_TPOT_BUCKETS_S, registry=self.registry)
        self.e2e_s = Histogram("mfs_e2e_seconds", "arrival to last token, at the server edge",
                               ["member"], buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.http_responses = Counter("mfs_http_responses", "HTTP responses by route and status code",
                                      ["route", "code"], registry=self.registry)
        self.stalled_streams = Counter("mfs_stalled_streams", "streams cancelled because their client took no data "
                                       "for the stall timeout", registry=self.registry)

    def observe_request(self, member: str, ttft_s: float | None, e2e_s: float, completion_tokens: int) -> None:
        if ttft_s is None:
            return  # nothing generated: no latency to report
        self.ttft_s.labels(member).observe(ttft_s)
        self.e2e_s.labels(member).observe(e2e_s)
        if completion_tokens > 1:
            self.tpot_s.labels(member).observe((e2e_s - ttft_s) / (completion_tokens - 1))

    def count_response(self, route: str, code: int) -> None:
        self.http_responses.labels(route, str(code)).inc()

    def count_stalled_stream(self) -> None:
        self.stalled_streams.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
