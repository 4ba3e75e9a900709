"""Dashboard data layer: Prometheus parsing, histogram percentiles from bucket deltas, results loading."""
from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dashboard import data

FIXTURE = Path(__file__).parent / "fixtures" / "bench_results_small.json"
BUCKETS_S = (0.1, 0.2, 0.4, 0.8)


class FakeServerMetrics:
    """The metric names the dashboard reads, made with prometheus_client as a server would."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("mfs_ttft_seconds", "ttft", ["member"], buckets=BUCKETS_S, registry=r)
        self.tpot = Histogram("mfs_tpot_seconds", "tpot", ["member"], buckets=BUCKETS_S, registry=r)
        self.e2e = Histogram("mfs_e2e_seconds", "e2e", ["member"], buckets=BUCKETS_S, registry=r)
        self.hits = Counter("mfs_prefix_cache_hits_total", "hits", ["member", "tier"], registry=r)
        self.queries = Counter("mfs_prefix_cache_queries_total", "queries", ["member"], registry=r)
        self.pages = Gauge("mfs_kv_pages", "pages", ["state", "member"], registry=r)
        self.queue = Gauge("mfs_queue_depth", "queue", registry=r)
        self.escalations = Counter("mfs_escalations_total", "esc", ["from", "to"], registry=r)
        self.requests = Counter("mfs_requests_total", "requests", ["member", "outcome"], registry=r)

    def samples(self) -> list[data.Sample]:
        return data.parse_metrics(generate_latest(self.registry).decode())


def test_parse_real_prometheus_text_for_every_dashboard_metric():
    m = FakeServerMetrics()
    m.requests.labels("tiny-s", "finished").inc(3)
    m.requests.labels("tiny-m", "failed").inc()
    m.hits.labels("tiny-s", "arena").inc(40)
    m.hits.labels("tiny-s", "host").inc(10)
    m.queries.labels("tiny-s").inc(100)
    m.pages.labels("free", "all").set(7)
    m.pages.labels("used", "tiny-s").set(5)
    m.queue.set(2)
    m.escalations.labels("tiny-s", "tiny-m").inc(4)
    m.ttft.labels("tiny-s").observe(0.15)
    samples = m.samples()
    assert data.sum_by(samples, "mfs_requests_total", ("member", "outcome")) == {
        ("tiny-s", "finished"): 3.0, ("tiny-m", "failed"): 1.0}
    assert data.sum_by(samples, "mfs_requests_total", ("member",)) == {("tiny-s",): 3.0, ("tiny-m",): 1.0}
    assert data.sum_by(samples, "mfs_prefix_cache_hits_total", ("tier",)) == {("arena",): 40.0, ("host",): 10.0}
    assert data.sum_by(samples, "mfs_queue_depth", ()) == {(): 2.0}
    assert data.histogram_buckets(samples, "mfs_ttft_seconds") == [
        (0.1, 0.0), (0.2, 1.0), (0.4, 1.0), (0.8, 1.0), (math.inf, 1.0)]
    assert data.requests_frame(samples).to_dict("records") == [
        {"member": "tiny-m", "outcome": "failed", "requests": 1},
        {"member": "tiny-s", "outcome": "finished", "requests": 3}]
    assert data.escalation_totals_frame(samples).to_dict("records") == [
        {"from": "tiny-s", "to": "tiny-m", "escalations": 4}]


def test_parse_rejects_non_prometheus_text():
    with pytest.raises(data.FetchError, match="Prometheus"):
        data.parse_metrics("<html>{not: metrics}</html>\n")


def test_percentiles_come_from_bucket_deltas_between_polls():
    m = FakeServerMetrics()
    for _ in range(10):
        m.ttft.labels("tiny-s").observe(0.05)      # before the first poll: all in le=0.1
    first = data.Poll(100.0, m.samples())
    for value, n in ((0.15, 4), (0.3, 4), (0.6, 2)):  # split over two members: buckets are summed
        for i in range(n):
            m.ttft.labels("tiny-s" if i % 2 else "tiny-m").observe(value)
    second = data.Poll(105.0, m.samples())

    delta = data.bucket_deltas(data.histogram_buckets(first.samples, "mfs_ttft_seconds"),
                               data.histogram_buckets(second.samples, "mfs_ttft_seconds"))
    assert delta == [(0.1, 0.0), (0.2, 4.0), (0.4, 8.0), (0.8, 10.0), (math.inf, 10.0)]
    assert data.histogram_quantile(0.5, delta) == pytest.approx(0.25)   # rank 5: 0.2 + 0.2 * (5-4)/(8-4)
    assert data.histogram_quantile(0.9, delta) == pytest.approx(0.6)    # rank 9: 0.4 + 0.4 * (9-8)/(10-8)
    assert data.histogram_quantile(0.99, delta) == pytest.approx(0.78)  # rank 9.9: 0.4 + 0.4 * 1.9/2
    cumulative = data.histogram_buckets(second.samples, "mfs_ttft_seconds")
    assert data.histogram_quantile(0.5, cumulative) == pytest.approx(0.1)  # the old observations dominate

    frame = data.latency_frame([first, second])
    ttft = frame[frame["metric"] == "TTFT"]
    at_second = dict(zip(ttft[ttft["time"] == ttft["time"].max()]["quantile"], ttft[ttft["time"] == ttft["time"].max()]["seconds"]))
    assert at_second == pytest.approx({"p50": 0.25, "p90": 0.6, "p99": 0.78})
    at_first = ttft[ttft["time"] == ttft["time"].min()]
    assert list(at_first["seconds"]) == pytest.approx([0.05, 0.09, 0.099])  # since server start: 10 in [0, 0.1]
    assert frame[frame["metric"] == "TPOT"].empty  # nothing observed: no points, no error


def test_histogram_quantile_edges():
    assert data.histogram_quantile(0.5, []) is None
    assert data.histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    # every observation above the last finite bound: the bound is the best estimate
    assert data.histogram_quantile(0.99, [(0.1, 0.0), (0.8, 0.0), (math.inf, 3.0)]) == 0.8
    # a counter that went down means the server restarted: the new counts are the interval's
    assert data.bucket_deltas([(0.1, 5.0), (math.inf, 9.0)], [(0.1, 1.0), (math.inf, 2.0)]) == [
        (0.1, 1.0), (math.inf, 2.0)]


def test_hit_rates_per_member_and_tier_over_intervals():
    m = FakeServerMetrics()
    m.queries.labels("tiny-s").inc(100)
    m.hits.labels("tiny-s", "arena").inc(40)
    m.hits.labels("tiny-s", "host").inc(10)
    first = data.Poll(10.0, m.samples())
    m.queries.labels("tiny-s").inc(100)
    m.queries.labels("tiny-m").inc(300)
    m.hits.labels("tiny-s", "arena").inc(60)
    m.hits.labels("tiny-m", "arena").inc(90)
    m.hits.labels("tiny-m", "disk").inc(30)
    second = data.Poll(20.0, m.samples())
    frame = data.hit_rate_frame([first, second])
    rates = {(t, by, series): rate for t, by, series, rate in frame.itertuples(index=False)}
    t1, t2 = data._time(10.0), data._time(20.0)
    assert rates[(t1, "member", "tiny-s")] == pytest.approx(0.5)
    assert rates[(t1, "tier", "arena")] == pytest.approx(0.4)
    assert rates[(t2, "member", "tiny-s")] == pytest.approx(0.6)     # (60 + 0) / 100
    assert rates[(t2, "member", "tiny-m")] == pytest.approx(0.4)     # (90 + 30) / 300
    assert rates[(t2, "tier", "arena")] == pytest.approx(150 / 400)
    assert rates[(t2, "tier", "disk")] == pytest.approx(30 / 400)
    assert rates[(t2, "tier", "host")] == pytest.approx(0.0)


def test_kv_queue_and_escalation_series():
    m = FakeServerMetrics()
    m.pages.labels("free", "all").set(10)
    m.pages.labels("cached", "tiny-s").set(3)
    m.queue.set(1)
    m.escalations.labels("tiny-s", "tiny-m").inc(2)
    first = data.Poll(0.0, m.samples())
    m.escalations.labels("tiny-s", "tiny-m").inc(3)
    m.escalations.labels("tiny-m", "tiny-l").inc(1)
    m.queue.set(4)
    second = data.Poll(30.0, m.samples())
    kv = data.kv_frame([first, second])
    assert set(kv["series"]) == {"free / all", "cached / tiny-s"}
    assert list(kv[kv["state"] == "free"]["pages"]) == [10.0, 10.0]
    assert list(data.queue_frame([first, second])["queue_depth"]) == [1.0, 4.0]
    rate = data.escalation_rate_frame([first, second])
    assert dict(zip(rate["pair"], rate["per_min"])) == {"tiny-m → tiny-l": 2.0, "tiny-s → tiny-m": 6.0}
    assert data.escalation_rate_frame([first]).empty


def test_routes_frame_newest_first_and_tolerant():
    stats = {"recent_routes": [
        {"request_id": "a", "member": "tiny-s", "reason": "complexity", "complexity": 0.12345,
         "scores": {"tiny-s": 0.9, "tiny-m": 0.4}, "matched_prefix_tokens": 32},
        {"request_id": "b"}, "not a route",
        {"request_id": "c", "matched_prefix_tokens": {"tiny-s": 16, "tiny-m": 0}}]}
    frame = data.routes_frame(stats)
    assert list(frame["request_id"]) == ["c", "b", "a"]
    assert frame.iloc[0]["matched_prefix_tokens"] == "tiny-s: 16, tiny-m: 0"
    assert frame.iloc[1]["member"] == "n/a" and frame.iloc[1]["scores"] == "n/a"
    assert frame.iloc[2]["scores"] == "tiny-s: 0.9, tiny-m: 0.4"
    assert frame.iloc[2]["complexity"] == "0.123" and frame.iloc[2]["matched_prefix_tokens"] == "32"
    assert data.routes_frame(None).empty


def test_real_server_exposition_feeds_the_dashboard():
    import orchestrator.serve.metrics as metrics
    stats = {"members": ["tiny-s", "tiny-m"], "queue_depth": 3,
             "pages": {"total": 64, "by_state": {"free": 40}, "by_member": {"tiny-s": {"used": 4, "cached": 2}}},
             "counters": {"requests": {"tiny-s": {"finished": 5}}, "prefix_query_tokens": {"tiny-s": 200},
                          "prefix_hit_tokens": {"tiny-s": {"arena": 50, "host": 30}},
                          "escalations": {"tiny-s->tiny-m": 2}}}
    server = metrics.ServerMetrics(lambda: stats)
    server.observe_request("tiny-s", ttft_s=0.03, e2e_s=0.2, completion_tokens=5)
    poll = data.Poll(1.0, data.parse_metrics(server.exposition().decode()))
    assert not data.latency_frame([poll]).empty
    hits = data.hit_rate_frame([poll])
    assert dict(zip(hits["series"], hits["hit_rate"]))["tiny-s"] == pytest.approx(0.4)
    assert data.queue_frame([poll])["queue_depth"].tolist() == [3.0]
    assert "used / tiny-s" in set(data.kv_frame([poll])["series"])
    assert data.escalation_totals_frame(poll.samples)["escalations"].tolist() == [2]


def test_fetch_poll_reports_an_unreachable_server():
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(data.FetchError, match="cannot reach the MFS server"):
        data.fetch_poll(f"127.0.0.1:{port}", now_s=0.0, timeout_s=1.0)


# ---------------------------------------------------------------- results

def test_load_fixture_results():
    results = data.load_results(FIXTURE)
    assert data.system_roles(results["systems"]) == ("mfs", "baseline")
    assert data.ordered_systems(results["systems"])[:2] == ["mfs", "baseline"]
    summary = data.summary_frame(results)
    assert summary.iloc[0]["role"] == "MFS" and summary.iloc[0]["reduction vs baseline"] == "37.5%"
    assert summary.iloc[1]["mean token latency (ms)"] == "18.88"
    assert len(data.per_request_frame(results)) == 36
    assert set(data.hit_rates_frame(results, "prefix_hit_rate_by_tier")["name"]) == {"arena", "host", "disk"}
    assert set(data.pages_timeline_frame(results)["state"]) == {"used", "cached", "host", "disk"}
    assert len(data.sweep_frame(results)) == 3
    assert data.headline(results)["reduction"] == 0.375 and data.headline(results)["ceiling"] == 0.52


def test_missing_optional_keys_read_na(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"systems": {"mfs": {"mean_token_latency_s": 0.01}, "baseline": {}}}))
    results = data.load_results(path)
    row = data.summary_frame(results).iloc[1]
    assert row["system"] == "baseline" and row["TTFT p99 (ms)"] == "n/a" and row["prefix hit rate"] == "n/a"
    assert data.per_request_frame(results).empty and data.sweep_frame(results) is None
    assert data.headline(results)["reduction"] is None and data.headline(results)["ceiling"] is None
    assert data.fmt(float("nan")) == "n/a" and data.fmt(None) == "n/a" and data.fmt(True) == "n/a"


@pytest.mark.parametrize("text, error, message", [
    ("", data.EmptyResultsError, "is empty"),
    ("{\"systems\": {}}", data.EmptyResultsError, "no systems"),
    ("{\"systems\": ", data.ResultsError, "not valid JSON"),
    ("[1, 2]", data.ResultsError, "JSON object"),
    ("{\"systems\": {\"mfs\": {\"ttft_p50_s\": \"fast\"}}}", data.ResultsError, "systems.mfs.ttft_p50_s must be a number"),
    ("{\"systems\": {\"mfs\": {\"per_request\": [{\"ttft_s\": []}]}}}", data.ResultsError, r"per_request\[0\].ttft_s"),
    ("{\"systems\": {\"mfs\": {\"pages_timeline\": [[1, 2]]}}}", data.ResultsError, "pages_timeline"),
    ("{\"systems\": {\"mfs\": {}}, \"sweep\": {}}", data.ResultsError, "'sweep' must be a list"),
    ("{\"systems\": [1]}", data.ResultsError, "'systems' must be an object"),
])
def test_results_validation_errors(tmp_path, text, error, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(error, match=message):
        data.load_results(path)


def test_results_shaped_by_the_real_bench_summary_load():
    import eval.bench.metrics as metrics_calc
    records = [metrics_calc.RequestRecord("s0", 0, 0.0, 0.05, 0.4, 100, 0, 8, ["tiny-s"]),
               metrics_calc.RequestRecord("s0", 1, 1.0, 1.03, 1.3, 140, 96, 8, ["tiny-s", "tiny-m"]),
               metrics_calc.RequestRecord("s1", 0, 1.5, None, None, 90, 0, 0, [], error="timeout")]
    counters = {"prefix_query_tokens": {"tiny-s": 240, "tiny-m": 0},
                "prefix_hit_tokens": {"tiny-s": {"arena": 96}}, "escalations": {"tiny-s->tiny-m": 1}}
    system = metrics_calc.summarize(records, counters, 2.0, [[0.0, 1, 2, 0, 0], [1.0, 3, 2, 1, 0]])
    results = data.validate_results(json.loads(json.dumps(
        {"systems": {"mfs": system, "baseline": system}, "reduction_mean_token_latency": 0.0})))
    assert len(data.per_request_frame(results)) == 6
    assert set(data.hit_rates_frame(results, "prefix_hit_rate_by_member")["name"]) == {"tiny-s"}  # tiny-m: null
    assert data.summary_frame(results).iloc[0]["requests"] == "2"


def test_missing_results_file(tmp_path):
    with pytest.raises(data.ResultsError, match="not found"):
        data.load_results(tmp_path / "nope.json")


def test_sweep_file_from_eval_sweep_is_shown_as_a_sweep(tmp_path):
    grid = [{"workload": "multiturn", "rate": r, "kv_pages": 128, "system": s, "mean_token_latency_s": lat,
             "reduction_vs_baseline": red}
            for r in (1.0, 2.0) for s, lat, red in (("mfs", 0.01, 0.3), ("baseline", 0.02, None))]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"grid": grid, "notes": []}))
    results = data.load_results(path)
    sweep = data.sweep_frame(results)
    assert results["systems"] == {}
    assert sweep[["rate", "reduction_mean_token_latency", "baseline_mean_token_latency_s"]].values.tolist() == [
        [1.0, 0.3, 0.02], [2.0, 0.3, 0.02]]


# ---------------------------------------------------------------- load curve (mfs bench --rates)
CURVE_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "bench_results_curve.json"


def test_curve_frame_and_summary_from_a_real_curve_file():
    results = data.load_results(CURVE_FIXTURE)
    frame = data.curve_frame(results)
    rates = [p["rate"] for p in results["curve"]]
    assert sorted(set(frame["rate"])) == rates and len(rates) >= 2
    assert len(frame) == sum(len(p["systems"]) for p in results["curve"])
    row = frame[(frame.rate == rates[-1]) & (frame.system == "mfs")].iloc[0]
    assert row["mean_token_latency_s"] == results["curve"][-1]["systems"]["mfs"]["mean_token_latency_s"]
    summary = data.curve_summary(results)
    assert summary["knee_rate"] == results["knee_rate"]
    assert set(summary["capacity"]) == set(results["capacity_at_slo"])
    assert summary["slo"].startswith("p90 TTFT <= ")


def test_curve_absent_or_single_rate_shows_nothing_and_bad_curves_are_named(tmp_path):
    one = {"systems": {"mfs": {}}, "curve": [{"rate": 1.0, "systems": {"mfs": {"mean_token_latency_s": 0.01}}}]}
    assert data.curve_frame(data.validate_results(one)) is None
    assert data.curve_frame(data.validate_results({"systems": {"mfs": {}}})) is None
    for bad, message in (({"curve": {}}, "'curve' must be a list"),
                         ({"curve": [{"rate": "fast", "systems": {}}]}, r"curve\[0\] must be an object"),
                         ({"curve": [{"rate": 1, "systems": {"mfs": {"ttft_p90_s": "x"}}}]},
                          r"curve\[0\].systems.mfs.ttft_p90_s must be a number")):
        with pytest.raises(data.ResultsError, match=message):
            data.validate_results({"systems": {"mfs": {}}, **bad})
    summary = data.curve_summary({"systems": {}})
    assert summary["knee"] == "n/a" and summary["reduction_at_knee"] == "n/a" and summary["capacity"] == {}
