"""Prometheus exposition: engine counters from an engine.stats() snapshot + edge latency histograms, and the
snapshot cache that /metrics and /v1/stats read (StatsCache)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
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
    """Turns one engine.stats() snapshot into metric families, so every scrape is self-consistent. `given`, while
    set, is the snapshot (or the error getting it) to render instead of calling stats()."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats
        self.given: dict[str, Any] | Exception | None = None

    def collect(self) -> Iterator[Metric]:
        try:
            s = self._stats() if self.given is None else self.given
            if isinstance(s, Exception):
                raise s
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
        self._engine = EngineStatsCollector(stats)
        self.registry.register(self._engine)
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

    def exposition(self, snapshot: dict[str, Any] | Exception | None = None) -> bytes:
        """The text exposition; the engine's part from `snapshot` (StatsCache's) when given, else from stats()."""
        self._engine.given = snapshot
        try:
            return generate_latest(self.registry)
        finally:
            self._engine.given = None


class StatsReading:
    """One engine stats snapshot (or the error getting it), shared by every reader that waited for it; the
    Prometheus text rendered from it is kept with it, so readers that share a snapshot share one rendering."""

    __slots__ = ("snapshot", "error", "exposition")

    def __init__(self, snapshot: dict[str, Any] | None, error: Exception | None):
        self.snapshot, self.error, self.exposition = snapshot, error, None

    def render(self, metrics: ServerMetrics) -> bytes:
        if self.exposition is None:
            self.exposition = metrics.exposition(self.error if self.error is not None else self.snapshot)
        return self.exposition


class StatsCache:
    """What /metrics and /v1/stats read instead of asking the engine per request.

    Every reader gets a snapshot the engine took after the reader arrived (so a scrape after a request's last
    output sees that request's bookkeeping), but readers share snapshots: while one is being taken, newcomers wait
    for the next, and the engine is asked at most once per `min_interval_s`, one request at a time, however many
    scrapes arrive; the Prometheus text is rendered once per snapshot. `fetch` is awaited on the event loop: an
    engine whose snapshot is a round trip (the engine process) answers it without blocking the loop (stats_async);
    an in-process engine's stats() is a read of its own counters."""

    def __init__(self, fetch: Callable[[], Awaitable[dict[str, Any]]], min_interval_s: float = 0.25):
        self._fetch = fetch
        self.min_interval_s = min_interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next: asyncio.Future | None = None      # the snapshot newcomers wait for (not yet asked for)
        self._lock: asyncio.Lock | None = None        # one engine request at a time
        self._last_asked_s = float("-inf")
        self._tasks: set[asyncio.Task] = set()
        self.fetches = 0                              # engine requests made
        self.waiting = 0                              # readers waiting for a snapshot now

    @classmethod
    def for_engine(cls, engine, min_interval_s: float = 0.25) -> StatsCache:
        stats_async = getattr(engine, "stats_async", None)

        async def fetch() -> dict[str, Any]:
            return await stats_async() if stats_async is not None else engine.stats()
        return cls(fetch, min_interval_s)

    async def read(self) -> StatsReading:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:                # the first read, or the app runs on a new loop (test clients)
            self._loop, self._next, self._lock = loop, None, asyncio.Lock()
        waiting = self._next
        if waiting is None:
            waiting = self._next = loop.create_future()
            task = loop.create_task(self._take(waiting))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self.waiting += 1
        try:
            return await asyncio.shield(waiting)  # a reader that leaves does not cancel the others' snapshot
        finally:
            self.waiting -= 1

    async def snapshot(self) -> dict[str, Any]:
        """The snapshot, or the error the engine gave (EngineUnavailableError while it is gone)."""
        reading = await self.read()
        if reading.error is not None:
            raise reading.error
        return reading.snapshot

    async def _take(self, waiting: asyncio.Future) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with self._lock:
                wait_s = self._last_asked_s + self.min_interval_s - loop.time()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                self._next = None                 # from here on, newcomers wait for a later snapshot
                self._last_asked_s = loop.time()
                self.fetches += 1
                try:
                    reading = StatsReading(await self._fetch(), None)
                except Exception as exc:  # noqa: BLE001 - every reader gets it (/metrics: mfs_engine_up 0)
                    reading = StatsReading(None, exc)
                waiting.set_result(reading)
        finally:
            if not waiting.done():                # cancelled (the server stops): its readers end too
                if self._next is waiting:
                    self._next = None
                waiting.cancel()
