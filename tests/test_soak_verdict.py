"""The soak's memory verdict (eval/bench/soak.py) on synthetic samples: a least-squares RSS slope per process after
the warm-up, in MiB/hour, and a failing exit when any process's slope exceeds the threshold, whatever the total
does; and the load's stalled reader is held past the server's send timeout (eval/bench/soak_load.py)."""
from __future__ import annotations

import random

import pytest

from eval.bench.soak import drift_failures, least_squares_slope, metric_total, rss_slopes, verdict
from eval.bench.soak_load import stall_hold_s
from orchestrator.serve.edge import ServerSettings


def _rows(server_mib_per_hour: float, engine_mib_per_hour: float = 0.0, *, minutes: float = 30, every_s: float = 5,
          noise_mib: float = 0.0, warmup_ramp_mib: float = 0.0, warmup_s: float = 360, seed: int = 0) -> list[dict]:
    """Samples as soak.sample() writes them: RSS lines per process, plus noise and a warm-up ramp."""
    rng = random.Random(seed)
    rows = []
    for i in range(int(minutes * 60 / every_s) + 1):
        t = i * every_s
        ramp = warmup_ramp_mib * min(t, warmup_s) / warmup_s
        server = 84.0 + ramp + server_mib_per_hour * t / 3600 + rng.gauss(0, noise_mib)
        engine = 660.0 + 10 * ramp + engine_mib_per_hour * t / 3600 + rng.gauss(0, noise_mib)
        rows.append({"t_s": t, "server": {"rss_mb": server, "fds": 20, "threads": 8},
                     "engine": {"rss_mb": engine, "fds": 8, "threads": 3}, "rss_total_mb": server + engine})
    return rows


def test_the_least_squares_slope_recovers_a_line_and_needs_two_times():
    assert least_squares_slope([(0, 1.0), (1, 3.0), (2, 5.0)]) == pytest.approx(2.0)
    assert least_squares_slope([(0, 0.0), (1, 1.0), (2, 0.0), (3, 1.0)]) == pytest.approx(0.2)   # not the end points
    with pytest.raises(ValueError):
        least_squares_slope([(5, 1.0), (5, 2.0)])


def test_the_slope_is_fitted_per_process_after_the_warm_up_in_mib_per_hour():
    # a steep warm-up ramp (the arena filling) and noise: the fit over minutes 6-30 still finds 7.6 and 0 MiB/hour
    rows = _rows(7.6, 0.0, noise_mib=0.05, warmup_ramp_mib=5.0, seed=1)
    slopes = rss_slopes(rows, warmup_s=360, duration_s=1800)
    assert slopes["server"]["slope_mib_per_hour"] == pytest.approx(7.6, abs=0.3)
    assert slopes["engine"]["slope_mib_per_hour"] == pytest.approx(0.0, abs=0.3)
    assert slopes["server"]["points"] == 289 and slopes["server"]["window_s"] == [360, 1800]
    # the samples after the load (idle, server stopping) are not in the fit
    idle = {**rows[-1], "t_s": 1900.0, "server": {**rows[-1]["server"], "rss_mb": 500.0}}
    error = {"t_s": 1000.0, "error": "connection refused"}
    assert rss_slopes([*rows, idle, error], 360, 1800) == slopes


def test_the_http_process_growing_fails_the_soak_although_the_total_passes():
    # the 30-minute run's shape: HTTP +7.6 MiB/hour (3% of 84 MiB), engine flat, total +0.5%: it must fail
    rows = _rows(7.6, 0.0, noise_mib=0.05, seed=2)
    slopes = rss_slopes(rows, 360, 1800)
    failures = drift_failures(slopes, max_slope_mib_h=1.0)
    assert len(failures) == 1 and failures[0].startswith("server RSS grows 7.")
    assert drift_failures(slopes, max_slope_mib_h=10.0) == []                 # the threshold is a flag
    assert drift_failures(rss_slopes(_rows(0.0, 3.0), 360, 1800), 1.0)[0].startswith("engine RSS grows 3.00")
    assert drift_failures(rss_slopes(_rows(0.3, -2.0, noise_mib=0.02), 360, 1800), 1.0) == []


def test_a_spike_at_the_end_does_not_decide_the_verdict_as_end_points_would():
    rows = _rows(0.0, 0.0)
    for row in rows[-3:]:
        row["server"]["rss_mb"] += 2.0               # a burst in the last 15 s: end points would say +8 MiB/hour
    assert rss_slopes(rows, 360, 1800)["server"]["slope_mib_per_hour"] < 1.0


def test_too_few_samples_after_the_warm_up_fail_rather_than_pass():
    rows = _rows(0.0, 0.0, minutes=1, every_s=20)
    failures = drift_failures(rss_slopes(rows, 50, 60), 1.0)
    assert len(failures) == 2 and all("fewer than" in f for f in failures)


def _summary(**changes) -> dict:
    summary = {"rss_slope": rss_slopes(_rows(0.2, 0.1), 360, 1800), "unexpected": 0, "server_5xx": 0,
               "stalled_asked": 2, "stalled_cut": 2, "pages_used_at_end": 0, "queue_depth_at_end": 0,
               "healthy_at_end": True, "server_exit_code": 0, "sample_errors": 0, "log_tracebacks": 0}
    return {**summary, **changes}


@pytest.mark.parametrize("changes, failure", [
    ({}, None),
    ({"rss_slope": rss_slopes(_rows(7.6, 0.0), 360, 1800)}, "server RSS grows"),
    ({"unexpected": 1}, "errors the clients did not ask for"),
    ({"server_5xx": 3}, "5xx"),
    ({"stalled_cut": 0}, "cut no stream"),
    ({"pages_used_at_end": 4}, "KV pages still used"),
    ({"healthy_at_end": False}, "/health"),
    ({"server_exit_code": 1}, "exited with 1"),
    ({"sample_errors": 2}, "samples failed"),
    ({"log_tracebacks": 1}, "tracebacks"),
])
def test_the_verdict_names_every_reason_to_fail(changes, failure):
    failures = verdict(_summary(**changes), max_slope_mib_h=1.0)
    assert failures == [] if failure is None else (len(failures) == 1 and failure in failures[0])


def test_server_counts_are_read_from_the_prometheus_text():
    text = ('# HELP mfs_http_responses_total x\nmfs_http_responses_total{code="200",route="/metrics"} 950.0\n'
            'mfs_http_responses_total{code="503",route="/health"} 2.0\n'
            'mfs_http_responses_total{code="500",route="other"} 1.0\nmfs_http_responses_created{code="500"} 1.7e9\n'
            'mfs_stalled_streams_total 3.0\nmfs_stalled_streams_created 1.7e9\n')
    assert metric_total(text, "mfs_http_responses_total", lambda labels: 'code="5' in labels) == 3
    assert metric_total(text, "mfs_stalled_streams_total") == 3


def test_the_stalled_reader_holds_past_the_servers_send_timeout_and_its_watchdog():
    stall_s = ServerSettings().stream_stall_s
    assert stall_s == 30.0
    # SSEResponse's watchdog looks every stall_s / 4: a cut comes at most 1.25 * stall_s after the send blocked
    assert stall_hold_s(stall_s) > 1.25 * stall_s + 5
