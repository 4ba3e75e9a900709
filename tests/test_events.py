"""Event ring, subscribers and the exact shape of the stats snapshot."""
from __future__ import annotations

import json
import threading

import pytest

from orchestrator.core.events import Event, EventKind, EventLog, Stats
from orchestrator.core.types import MemberName, RequestId, RouteDecision

MEMBERS = ["s", "m", "l"]


def test_event_log_ring_keeps_the_last_events() -> None:
    log = EventLog(capacity=3)
    for i in range(5):
        log.emit(EventKind.ADMIT, float(i), request_id=f"r{i}", member="s", prompt_tokens=i)
    assert len(log) == 3
    assert [e.request_id for e in log.recent(10)] == ["r2", "r3", "r4"]
    assert [e.time_s for e in log.recent(2)] == [3.0, 4.0]
    assert log.recent(0) == []
    assert log.recent(1)[0] == Event(EventKind.ADMIT, 4.0, "r4", "s", {"prompt_tokens": 4})


def test_event_log_records_what_was_emitted() -> None:
    log = EventLog()
    log.emit(EventKind.EVICT, 1.0, num_pages=2)
    assert log.recent() == [Event(EventKind.EVICT, 1.0, None, None, {"num_pages": 2})]


def test_event_kinds_are_complete() -> None:
    assert {k.name for k in EventKind} == {"ADMIT", "ROUTE", "ESCALATE", "PREEMPT", "EVICT", "OFFLOAD", "LOAD",
                                           "FINISH", "CANCEL", "WARMUP", "HOLD"}


def empty_snapshot(stats: Stats) -> dict:
    return stats.snapshot(time_s=1.5, family="tiny", members=MEMBERS, pages={"total": 8, "page_bytes": 16384},
                          queue_depth=0, running={}, waiting={})


def test_empty_snapshot_has_zeros_everywhere() -> None:
    snap = empty_snapshot(Stats())
    assert snap == {
        "time_s": 1.5, "family": "tiny", "members": MEMBERS,
        "pages": {"total": 8, "page_bytes": 16384,
                  "by_state": {"free": 0, "used": 0, "cached": 0, "host": 0, "disk": 0},
                  "by_member": {m: {"used": 0, "cached": 0, "host": 0, "disk": 0} for m in MEMBERS}},
        "queue_depth": 0, "running": {m: 0 for m in MEMBERS}, "waiting": {m: 0 for m in MEMBERS},
        "counters": {
            "requests": {m: {"finished": 0, "cancelled": 0, "failed": 0, "rejected": 0} for m in MEMBERS},
            "prefix_query_tokens": {m: 0 for m in MEMBERS},
            "prefix_hit_tokens": {m: {"arena": 0, "host": 0, "disk": 0} for m in MEMBERS},
            "escalations": {"s->m": 0, "s->l": 0, "m->l": 0}, "escalations_refused": 0,
            "preemptions": 0, "preemptions_by_kind": {"swap": 0, "recompute": 0}, "downgrades": {},
            "evictions": 0, "offloads": {"host": 0, "disk": 0},
            "warmups": {"issued": 0, "hit": 0},
            "generated_tokens": {m: 0 for m in MEMBERS}, "prompt_tokens": {m: 0 for m in MEMBERS},
            "member_steps": {m: 0 for m in MEMBERS},
            "drafted_tokens": {"s->m": 0, "s->l": 0}, "accepted_draft_tokens": {"s->m": 0, "s->l": 0},
            "draft_length_steps": {}},
        "queue_wait_s": {m: {"count": 0, "p50": 0.0, "p90": 0.0, "p99": 0.0} for m in MEMBERS},
        "recent_routes": []}
    json.dumps(snap)


def test_counters_accumulate() -> None:
    stats = Stats()
    stats.on_request_done("s", "finished")
    stats.on_request_done("s", "finished")
    stats.on_request_done("l", "rejected")
    with pytest.raises(ValueError):
        stats.on_request_done("s", "exploded")
    stats.on_prefix_query("m", 100, {"arena": 32, "disk": 16})
    stats.on_prefix_query("m", 50, {"host": 8})
    stats.on_escalation("s", "l")
    stats.on_preemption()
    stats.on_preemption("swap")
    with pytest.raises(ValueError):
        stats.on_preemption("teleport")
    for wait_s in (0.4, 0.1, 0.2, 0.3):
        stats.on_queue_wait("l", wait_s)
    stats.on_eviction(5)
    stats.on_offload("host", 3)
    stats.on_offload("disk", 2)
    stats.on_warmup(issued=True, hit=False)
    stats.on_warmup(issued=True, hit=True)
    stats.on_tokens("s", prompt_tokens=10, generated_tokens=4)
    stats.on_tokens("s", generated_tokens=1)
    snap = stats.snapshot(time_s=2.0, family="tiny", members=MEMBERS,
                          pages={"total": 8, "page_bytes": 64, "by_state": {"used": 3, "free": 5},
                                 "by_member": {"s": {"used": 3}}},
                          queue_depth=2, running={"s": 1}, waiting={"l": 2})
    c = snap["counters"]
    assert c["requests"]["s"] == {"finished": 2, "cancelled": 0, "failed": 0, "rejected": 0}
    assert c["requests"]["l"]["rejected"] == 1
    assert c["prefix_query_tokens"] == {"s": 0, "m": 150, "l": 0}
    assert c["prefix_hit_tokens"]["m"] == {"arena": 32, "host": 8, "disk": 16}
    assert c["escalations"] == {"s->m": 0, "s->l": 1, "m->l": 0}
    assert (c["preemptions"], c["evictions"]) == (2, 5)
    assert c["preemptions_by_kind"] == {"swap": 1, "recompute": 1}
    assert snap["queue_wait_s"]["l"] == {"count": 4, "p50": pytest.approx(0.25), "p90": pytest.approx(0.37),
                                         "p99": pytest.approx(0.397)}
    assert snap["queue_wait_s"]["s"]["count"] == 0
    assert c["offloads"] == {"host": 3, "disk": 2} and c["warmups"] == {"issued": 2, "hit": 1}
    assert c["prompt_tokens"]["s"] == 10 and c["generated_tokens"] == {"s": 5, "m": 0, "l": 0}
    assert snap["pages"]["by_state"] == {"free": 5, "used": 3, "cached": 0, "host": 0, "disk": 0}
    assert snap["pages"]["by_member"]["s"] == {"used": 3, "cached": 0, "host": 0, "disk": 0}
    assert snap["running"] == {"s": 1, "m": 0, "l": 0} and snap["waiting"] == {"s": 0, "m": 0, "l": 2}
    assert snap["queue_depth"] == 2
    json.dumps(snap)


def route(i: int) -> RouteDecision:
    return RouteDecision(request_id=RequestId(f"r{i}"), member=MemberName("m"), reason="complexity",
                         scores={"s": 0.1, "m": 0.9}, components={"m": {"complexity": 0.9}},
                         matched_prefix_tokens={"m": 32}, complexity=0.5)


def test_recent_routes_keep_the_last_100_as_plain_dicts() -> None:
    stats = Stats()
    for i in range(105):
        stats.record_route(route(i))
    routes = empty_snapshot(stats)["recent_routes"]
    assert len(routes) == 100 and routes[0]["request_id"] == "r5" and routes[-1]["request_id"] == "r104"
    assert routes[-1] == {"request_id": "r104", "member": "m", "reason": "complexity", "complexity": 0.5,
                          "scores": {"s": 0.1, "m": 0.9}, "matched_prefix_tokens": {"m": 32}}
    routes[-1]["scores"]["s"] = 99.0   # a snapshot is a copy
    assert empty_snapshot(stats)["recent_routes"][-1]["scores"]["s"] == 0.1


def test_snapshot_while_another_thread_counts() -> None:
    stats = Stats()

    def work() -> None:
        for _ in range(2000):
            stats.on_tokens("s", generated_tokens=1)
            stats.on_prefix_query("s", 1, {"arena": 1})

    thread = threading.Thread(target=work)
    thread.start()
    while thread.is_alive():
        json.dumps(empty_snapshot(stats))
    thread.join()
    assert empty_snapshot(stats)["counters"]["generated_tokens"]["s"] == 2000


def test_percentile_interpolates_between_ranks_of_values_in_any_order():
    from orchestrator.core.events import percentile

    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([0, 10], 99) == pytest.approx(9.9)
    assert percentile([5], 99) == 5 and percentile([], 50) is None
