"""The Prometheus collector: engine.stats() -> metric families with the documented names and labels; the snapshot
cache /metrics and /v1/stats read (readers share snapshots, the engine is never asked per scrape, a slow snapshot
never stalls the event loop)."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.serve.metrics import ServerMetrics, StatsCache
from orchestrator.serve.server import ServerSettings, create_app
from tests.fakes_serving import FAKE_TEXT, FakeServingEngine, serve_in_thread

STATS = {
    "time_s": 1.0, "family": "tiny", "members": ["tiny-s", "tiny-m"],
    "pages": {"total": 100, "page_bytes": 16384,
              "by_state": {"free": 60, "used": 25, "cached": 15, "host": 4, "disk": 1},
              "by_member": {"tiny-s": {"used": 20, "cached": 10, "host": 4, "disk": 1},
                            "tiny-m": {"used": 5, "cached": 5, "host": 0, "disk": 0}}},
    "queue_depth": 3, "running": {"tiny-s": 2, "tiny-m": 1}, "waiting": {"tiny-s": 3},
    "counters": {"requests": {"tiny-s": {"finished": 7, "cancelled": 1, "failed": 0, "rejected": 2}},
                 "prefix_query_tokens": {"tiny-s": 1000, "tiny-m": 50},
                 "prefix_hit_tokens": {"tiny-s": {"arena": 600, "host": 32, "disk": 0}},
                 "escalations": {"tiny-s->tiny-m": 4},
                 "preemptions": 5, "preemptions_by_kind": {"swap": 2, "recompute": 3},
                 "downgrades": {"tiny-m->tiny-s": 6}, "evictions": 9, "offloads": {"host": 4, "disk": 1},
                 "warmups": {"issued": 2, "hit": 1},
                 "generated_tokens": {"tiny-s": 300, "tiny-m": 40}, "prompt_tokens": {"tiny-s": 1000},
                 "member_steps": {"tiny-s": 50, "tiny-m": 30}},
    "queue_wait_s": {"tiny-s": {"count": 4, "p50": 0.1, "p90": 0.5, "p99": 0.9}},
    "recent_routes": [],
}


def scrape(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_collector_maps_every_stats_field():
    s = scrape(ServerMetrics(lambda: STATS))
    assert s[("mfs_requests_total", (("member", "tiny-s"), ("outcome", "finished")))] == 7
    assert s[("mfs_requests_total", (("member", "tiny-s"), ("outcome", "rejected")))] == 2
    assert s[("mfs_prefix_cache_queries_total", (("member", "tiny-s"),))] == 1000
    assert s[("mfs_prefix_cache_hits_total", (("member", "tiny-s"), ("tier", "host")))] == 32
    assert s[("mfs_escalations_total", (("from", "tiny-s"), ("to", "tiny-m")))] == 4
    assert s[("mfs_kv_pages", (("member", "all"), ("state", "free")))] == 60
    assert s[("mfs_kv_pages", (("member", "tiny-m"), ("state", "used")))] == 5
    assert s[("mfs_kv_pages", (("member", "tiny-s"), ("state", "disk")))] == 1
    assert s[("mfs_queue_depth", ())] == 3
    assert s[("mfs_running_requests", (("member", "tiny-m"),))] == 1
    assert s[("mfs_waiting_requests", (("member", "tiny-m"),))] == 0
    assert s[("mfs_preemptions_total", ())] == 5 and s[("mfs_evictions_total", ())] == 9
    assert s[("mfs_generated_tokens_total", (("member", "tiny-m"),))] == 40
    assert s[("mfs_offloads_total", (("tier", "host"),))] == 4
    assert s[("mfs_engine_up", ())] == 1
    assert s[("mfs_downgrades_total", (("from", "tiny-m"), ("to", "tiny-s")))] == 6
    assert s[("mfs_member_steps_total", (("member", "tiny-m"),))] == 30
    assert s[("mfs_preemptions_by_kind_total", (("kind", "swap"),))] == 2
    assert s[("mfs_queue_wait_seconds", (("member", "tiny-s"), ("quantile", "p99")))] == 0.9


def test_latency_histograms_observe_per_member():
    metrics = ServerMetrics(lambda: STATS)
    metrics.observe_request("tiny-m", ttft_s=0.2, e2e_s=1.2, completion_tokens=11)
    metrics.observe_request("tiny-m", ttft_s=None, e2e_s=0.1, completion_tokens=0)   # nothing generated
    s = scrape(metrics)
    assert s[("mfs_ttft_seconds_count", (("member", "tiny-m"),))] == 1
    assert s[("mfs_tpot_seconds_sum", (("member", "tiny-m"),))] == 0.1
    assert s[("mfs_e2e_seconds_sum", (("member", "tiny-m"),))] == 1.2


def test_failing_stats_does_not_break_scrape():
    def broken():
        raise RuntimeError("engine gone")
    s = scrape(ServerMetrics(broken))
    assert s[("mfs_engine_up", ())] == 0


def test_each_app_has_its_own_registry():
    a, b = ServerMetrics(lambda: STATS), ServerMetrics(lambda: STATS)
    a.observe_request("tiny-s", 0.1, 0.2, 2)
    assert ("mfs_ttft_seconds_count", (("member", "tiny-s"),)) not in scrape(b)


# ----------------------------------------------------------------------------- the snapshot cache
def test_readers_share_snapshots_and_each_gets_one_taken_after_it_asked():
    """100 readers asking together share one snapshot; 100 more arriving while it is taken share the next one (not
    the older one, which might predate what they want to see)."""
    async def scenario():
        calls = 0
        release = asyncio.Event()

        async def fetch() -> dict:
            nonlocal calls
            calls += 1
            taken = calls
            await release.wait()
            return {"taken": taken}

        cache = StatsCache(fetch, min_interval_s=0.0)
        first = [asyncio.create_task(cache.snapshot()) for _ in range(100)]
        while calls == 0:
            await asyncio.sleep(0)
        second = [asyncio.create_task(cache.snapshot()) for _ in range(100)]
        await asyncio.sleep(0)
        release.set()
        got_first, got_second = [await t for t in first], [await t for t in second]
        return calls, got_first, got_second, cache.fetches

    calls, first, second, fetches = asyncio.run(scenario())
    assert calls == fetches == 2
    assert first == [{"taken": 1}] * 100 and second == [{"taken": 2}] * 100


def test_the_engines_error_reaches_every_reader_and_mfs_engine_up_says_so():
    async def scenario():
        async def fetch() -> dict:
            raise RuntimeError("engine gone")
        cache = StatsCache(fetch, min_interval_s=0.0)
        reading = await cache.read()
        return reading.render(ServerMetrics(lambda: STATS))

    s = {(f.name, tuple(f.samples[0].labels.items())): f.samples[0].value
         for f in text_string_to_metric_families(asyncio.run(scenario()).decode()) if f.samples}
    assert s[("mfs_engine_up", ())] == 0


class SlowStatsEngine(FakeServingEngine):
    """An engine whose snapshot is a round trip that takes as long as the test wants (as the engine process's
    does between two steps): stats() blocks its caller, stats_async() only its awaiter."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate, self.asked, self.calls = threading.Event(), threading.Event(), 0

    def stats(self) -> dict:
        self.calls += 1
        self.asked.set()
        self.gate.wait(30)
        return super().stats()

    async def stats_async(self) -> dict:
        self.calls += 1
        self.asked.set()
        await asyncio.to_thread(self.gate.wait, 30)
        return FakeServingEngine.stats(self)


@pytest.fixture()
def slow_stats(family, tokenizer):
    engine = SlowStatsEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT))
    app = create_app(engine, tokenizer, family, ServerSettings())
    try:
        with serve_in_thread(app) as url:
            yield engine, app, url
    finally:
        engine.gate.set()


def test_a_slow_engine_snapshot_does_not_stall_the_loop(slow_stats):
    """While /metrics waits for the engine's snapshot, streams and other requests are served."""
    engine, app, url = slow_stats
    with ThreadPoolExecutor(2) as pool:
        scrape = pool.submit(httpx.get, url + "/metrics", timeout=60)
        stats = pool.submit(httpx.get, url + "/v1/stats", timeout=60)
        assert engine.asked.wait(30)
        with httpx.Client(base_url=url, timeout=60) as http:
            health = http.get("/health")
            streamed = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True})
            served_while_waiting = not engine.gate.is_set() and not scrape.done()
        engine.gate.set()
        assert scrape.result().status_code == 200 and "mfs_kv_pages" in scrape.result().text
        assert stats.result().status_code == 200 and stats.result().json()["family"] == "tiny"
    assert health.status_code == 200 and "[DONE]" in streamed.text and served_while_waiting


def test_a_scrape_flood_costs_the_engine_one_snapshot_per_wave(slow_stats):
    """Scrapes that arrive while a snapshot is being taken wait for the next one, together: 1 + 40 scrapes of
    /metrics and /v1/stats ask the engine twice."""
    engine, app, url = slow_stats
    cache = app.state.stats_cache
    with ThreadPoolExecutor(41) as pool:
        first = pool.submit(httpx.get, url + "/metrics", timeout=60)
        assert engine.asked.wait(30)
        flood = [pool.submit(httpx.get, url + ("/metrics" if i % 2 else "/v1/stats"), timeout=60) for i in range(40)]
        deadline = time.monotonic() + 60
        while cache.waiting < 41 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cache.waiting == 41
        engine.gate.set()
        responses = [first.result(), *(f.result() for f in flood)]
    assert all(r.status_code == 200 for r in responses)
    assert engine.calls == cache.fetches == 2


def test_metrics_can_require_the_api_key(family, tokenizer):
    engine = FakeServingEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT))
    app = create_app(engine, tokenizer, family, ServerSettings(api_key="sekret", metrics_need_key=True))
    with serve_in_thread(app) as url:
        assert httpx.get(url + "/metrics").status_code == 401
        allowed = httpx.get(url + "/metrics", headers={"Authorization": "Bearer sekret"})
        assert allowed.status_code == 200 and "mfs_engine_up 1.0" in allowed.text
        assert httpx.get(url + "/health").status_code == 200
