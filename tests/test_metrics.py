"""The Prometheus collector: engine.stats() -> metric families with the documented names and labels."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from orchestrator.serve.metrics import ServerMetrics

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
