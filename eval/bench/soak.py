"""Soak benchmark: a real `mfs serve` under mixed load for minutes to hours; does anything grow?

Starts `mfs serve` on the shipped tiny family (local engine in its own process), runs the clients of
eval/bench/soak_load.py (chat sessions, completions, streams, cancelled streams, slow readers, clients that give up,
penalties, invalid bodies, a stalled reader held past the server's send timeout, a /metrics scrape flood) and
samples every few seconds: the RSS, open descriptors and threads of the HTTP process and of its engine process
(psutil, each process on its own), KV pages used and cached and the queue depth (/v1/stats). After the load it
waits for the server to go idle, takes a last sample, stops the server (SIGTERM) and reports per process the RSS
slope in MiB/hour, a least-squares fit over the samples under load after the warm-up (not two end points), beside
the old end-against-warm-up drift, the descriptor and thread counts, pages used at the end and the outcome counts.
Writes a JSON and a PNG plot.

Exit status 1 (the failures listed) when any process's RSS slope exceeds --max-rss-slope (MiB/hour, default 1)
or too few samples follow the warm-up to fit one, when any answer was an error the clients did not ask for, when
the server answered a 5xx, when a stalled reader ran but the server cut no stream, when a page is still used
once idle, when the server is unhealthy at the end or exits non-zero, or when a sample failed.

    python -m eval.bench.soak --minutes 1 --sample-s 1     # a smoke (1 MiB/hour is below what 1 minute resolves)
    python -m eval.bench.soak --minutes 30 --out docs/results/bench/soak_30min.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

from eval.bench.servers import REPO, free_port, wait_ready
from eval.bench.soak_load import Tally, run_load

_READY_TIMEOUT_S = 300.0
_IDLE_TIMEOUT_S = 60.0


def start_server(port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "orchestrator.serve.cli", "serve", "--port", str(port), "--log-level", "warning"]
    log = open(log_path, "wb")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _process_figures(proc: psutil.Process) -> dict:
    with proc.oneshot():
        return {"rss_mb": proc.memory_info().rss / 2**20, "fds": proc.num_fds(), "threads": proc.num_threads()}


def sample(url: str, server: psutil.Process, started_s: float) -> dict:
    """One sample: the server's and its engine child's figures, pages and queue from /v1/stats."""
    row = {"t_s": round(time.monotonic() - started_s, 2), "server": _process_figures(server)}
    children = [c for c in server.children() if "resource_tracker" not in " ".join(c.cmdline())]
    row["engine"] = _process_figures(children[0]) if children else None
    stats = httpx.get(url + "/v1/stats", timeout=10).json()
    row["pages_used"] = stats["pages"]["by_state"]["used"]
    row["pages_cached"] = stats["pages"]["by_state"]["cached"]
    row["queue_depth"] = stats.get("queue_depth", 0)
    row["rss_total_mb"] = row["server"]["rss_mb"] + (row["engine"]["rss_mb"] if row["engine"] else 0.0)
    return row


class Sampler(threading.Thread):
    """Samples every interval_s until stopped (bounded by its own deadline too)."""

    def __init__(self, url: str, server: psutil.Process, interval_s: float, deadline_s: float):
        super().__init__(name="soak-sampler", daemon=True)
        self.url, self.server, self.interval_s, self.deadline_s = url, server, interval_s, deadline_s
        self.rows: list[dict] = []
        self.started_s = time.monotonic()
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set() and time.monotonic() < self.deadline_s:
            try:
                self.rows.append(sample(self.url, self.server, self.started_s))
            except (httpx.HTTPError, psutil.Error) as exc:
                self.rows.append({"t_s": round(time.monotonic() - self.started_s, 2), "error": str(exc)})
            self.stop_event.wait(self.interval_s)


def wait_idle(url: str) -> dict:
    """Waits (bounded) until no page is used and nothing queues; returns the last stats."""
    deadline = time.monotonic() + _IDLE_TIMEOUT_S
    while True:
        stats = httpx.get(url + "/v1/stats", timeout=10).json()
        if (stats["pages"]["by_state"]["used"] == 0 and not stats.get("queue_depth")) or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


PROCESSES = ("server", "engine")       # the HTTP process and its engine child, as sample() names them
MIN_FIT_POINTS = 5


def least_squares_slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of y over x (ordinary, one regressor). Needs two distinct x."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if sxx == 0:
        raise ValueError("a slope needs samples at two different times at least")
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx


def rss_slopes(rows: list[dict], warmup_s: float, duration_s: float) -> dict[str, dict]:
    """Per process: the RSS slope in MiB/hour fitted over the samples under load after the warm-up
    (warmup_s <= t_s <= duration_s), with the number of samples and the window it covers."""
    fits = {}
    for name in PROCESSES:
        points = [(r["t_s"], r[name]["rss_mb"]) for r in rows
                  if "error" not in r and r.get(name) and warmup_s <= r["t_s"] <= duration_s]
        fit = {"points": len(points), "window_s": [points[0][0], points[-1][0]] if points else None,
               "slope_mib_per_hour": None}
        if len(points) >= 2 and points[0][0] != points[-1][0]:
            fit["slope_mib_per_hour"] = round(least_squares_slope(points) * 3600.0, 3)
        fits[name] = fit
    return fits


def drift_failures(slopes: dict[str, dict], max_slope_mib_h: float, min_points: int = MIN_FIT_POINTS) -> list[str]:
    """Why the RSS is not steady: a process whose slope exceeds max_slope_mib_h, or one with too few samples after
    the warm-up to fit one (fail closed: no verdict is no pass)."""
    failures = []
    for name in PROCESSES:
        fit = slopes.get(name) or {"points": 0, "slope_mib_per_hour": None}
        if fit["points"] < min_points or fit["slope_mib_per_hour"] is None:
            failures.append(f"{name} RSS: {fit['points']} samples after the warm-up, fewer than the {min_points} "
                            f"a slope needs")
        elif fit["slope_mib_per_hour"] > max_slope_mib_h:
            failures.append(f"{name} RSS grows {fit['slope_mib_per_hour']:.2f} MiB/hour, over the "
                            f"{max_slope_mib_h:g} MiB/hour allowed")
    return failures


def verdict(summary: dict, max_slope_mib_h: float) -> list[str]:
    """Every reason the soak fails (empty: it passes)."""
    failures = drift_failures(summary["rss_slope"], max_slope_mib_h)
    if summary["unexpected"]:
        failures.append(f"{summary['unexpected']} answers were errors the clients did not ask for")
    if summary.get("server_5xx"):
        failures.append(f"the server answered {summary['server_5xx']} 5xx responses")
    if summary.get("stalled_asked") and not summary.get("stalled_cut"):
        failures.append("stalled readers ran but the server cut no stream (mfs_stalled_streams_total is 0)")
    if summary["pages_used_at_end"]:
        failures.append(f"{summary['pages_used_at_end']} KV pages still used once idle")
    if summary["queue_depth_at_end"]:
        failures.append(f"{summary['queue_depth_at_end']} requests still queued once idle")
    if not summary.get("healthy_at_end", False):
        failures.append("/health was not 200 at the end")
    if summary.get("server_exit_code", 0) != 0:
        failures.append(f"mfs serve exited with {summary['server_exit_code']} on SIGTERM")
    if summary["sample_errors"]:
        failures.append(f"{summary['sample_errors']} samples failed")
    if summary.get("log_tracebacks"):
        failures.append(f"the server log holds {summary['log_tracebacks']} tracebacks")
    return failures


def metric_total(text: str, name: str, label_filter: Callable[[str], bool] = lambda labels: True) -> float:
    """The sum of a Prometheus text exposition's samples of `name` whose label text passes label_filter."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            rest = line[len(name):]
            labels = rest[1:rest.index("}")] if rest.startswith("{") else ""
            if (rest.startswith("{") or rest.startswith(" ")) and label_filter(labels):
                total += float(line.rsplit(" ", 1)[1])
    return total


def server_counts(url: str) -> dict:
    """What the server itself counted: 5xx responses and streams cut for a stalled reader (/metrics)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {"server_5xx": int(metric_total(text, "mfs_http_responses_total", lambda l: 'code="5' in l)),
            "stalled_cut": int(metric_total(text, "mfs_stalled_streams_total"))}


def summarize(rows: list[dict], idle: dict, tally: Tally, warmup_s: float, duration_s: float) -> dict:
    good = [r for r in rows if "error" not in r]
    under_load = [r for r in good if r["t_s"] <= duration_s]
    window_s = max(duration_s * 0.1, 10.0)
    after_warmup = [r for r in under_load if warmup_s <= r["t_s"] < warmup_s + window_s] or under_load[:1]
    at_end = [r for r in under_load if r["t_s"] >= duration_s - window_s] or under_load[-1:]

    def median(rs, key) -> float:
        return statistics.median(key(r) for r in rs)

    def drift(key) -> dict:
        start, end = median(after_warmup, key), median(at_end, key)
        return {"after_warmup": round(start, 1), "end": round(end, 1),
                "drift_pct": round(100 * (end - start) / start, 2)}

    def count(key) -> dict:
        series = [key(r) for r in good if r["t_s"] >= warmup_s]
        return {"after_warmup": key(after_warmup[0]), "max": max(series), "end_idle": key(good[-1])}

    return {
        "rss_slope": rss_slopes(rows, warmup_s, duration_s),
        "rss_total_mb": drift(lambda r: r["rss_total_mb"]),
        "rss_server_mb": drift(lambda r: r["server"]["rss_mb"]),
        "rss_engine_mb": drift(lambda r: r["engine"]["rss_mb"]),
        "server_fds": count(lambda r: r["server"]["fds"]), "server_threads": count(lambda r: r["server"]["threads"]),
        "engine_fds": count(lambda r: r["engine"]["fds"]), "engine_threads": count(lambda r: r["engine"]["threads"]),
        "pages_used_at_end": idle["pages"]["by_state"]["used"],
        "pages_cached_at_end": idle["pages"]["by_state"]["cached"],
        "queue_depth_at_end": idle.get("queue_depth", 0),
        "outcomes": {k: dict(v) for k, v in tally.counts.items()},
        "completed": tally.total("completed"), "cancelled": tally.total("cancelled"),
        "refused": tally.total("refused"), "unexpected": tally.total("unexpected"),
        "stalled": tally.total("stalled"), "stalled_asked": sum(tally.counts.get("stalled_reader", {}).values()),
        "unexpected_reasons": tally.reasons, "sample_errors": len(rows) - len(good),
    }


def plot(rows: list[dict], warmup_s: float, duration_s: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in rows if "error" not in r]
    t_min = [r["t_s"] / 60 for r in good]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    axes[0].plot(t_min, [r["server"]["rss_mb"] for r in good], label="HTTP process")
    axes[0].plot(t_min, [r["engine"]["rss_mb"] for r in good], label="engine process")
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].plot(t_min, [r["server"]["fds"] for r in good], label="fds, HTTP")
    axes[1].plot(t_min, [r["engine"]["fds"] for r in good], label="fds, engine")
    axes[1].plot(t_min, [r["server"]["threads"] for r in good], label="threads, HTTP")
    axes[1].plot(t_min, [r["engine"]["threads"] for r in good], label="threads, engine")
    axes[1].set_ylabel("count")
    axes[2].plot(t_min, [r["pages_used"] for r in good], label="KV pages used")
    axes[2].plot(t_min, [r["pages_cached"] for r in good], label="KV pages cached")
    axes[2].plot(t_min, [r["queue_depth"] for r in good], label="queue depth")
    axes[2].set_xlabel("minutes")
    for ax in axes:
        ax.axvline(warmup_s / 60, color="grey", linestyle=":")
        ax.axvline(duration_s / 60, color="grey", linestyle="--")
        ax.legend(loc="upper left", fontsize=8)
    axes[0].set_title("mfs serve soak (tiny family): warm-up ends at the dotted line, load at the dashed one")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--warmup-frac", type=float, default=0.2, help="share of the run counted as warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rss-slope", type=float, default=1.0, metavar="MIB_PER_HOUR",
                        help="fail when a process's RSS slope after the warm-up exceeds this (default 1 MiB/hour)")
    parser.add_argument("--stalled-readers", type=int, default=1,
                        help="clients that stop reading a stream past the server's send timeout (30 s)")
    parser.add_argument("--scrapers", type=int, default=4, help="clients reading /metrics at about 20 Hz each")
    parser.add_argument("--out", default="artifacts/soak.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    duration_s, warmup_s = args.minutes * 60, args.minutes * 60 * args.warmup_frac
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port, out.with_suffix(".server.log"))
    try:
        asyncio.run(wait_ready(url, proc, _READY_TIMEOUT_S))
        sampler = Sampler(url, psutil.Process(proc.pid), args.sample_s, time.monotonic() + duration_s + 300)
        sampler.start()
        tally = asyncio.run(run_load(url, args.clients, duration_s, args.seed, stalled_readers=args.stalled_readers,
                                     scrapers=args.scrapers))
        idle = wait_idle(url)
        sampler.stop_event.set()
        sampler.join(30)
        sampler.rows.append(sample(url, psutil.Process(proc.pid), sampler.started_s))
        healthy = httpx.get(url + "/health", timeout=5).status_code == 200
        counted = server_counts(url)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            exit_code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            exit_code = proc.wait(timeout=10)
    summary = summarize(sampler.rows, idle, tally, warmup_s, duration_s)
    log_text = out.with_suffix(".server.log").read_text(errors="replace")
    summary.update(counted, minutes=args.minutes, clients=args.clients, healthy_at_end=healthy,
                   server_exit_code=exit_code, log_tracebacks=log_text.count("Traceback (most recent call last)"),
                   max_rss_slope_mib_per_hour=args.max_rss_slope,
                   command=" ".join(["python -m eval.bench.soak", *sys.argv[1:]]))
    summary["failures"] = verdict(summary, args.max_rss_slope)
    out.write_text(json.dumps({"summary": summary, "samples": sampler.rows}, indent=1))
    plot(sampler.rows, warmup_s, duration_s, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("outcomes", "unexpected_reasons", "failures")},
                     indent=1))
    print("outcomes:", json.dumps(summary["outcomes"]))
    for reason in summary["unexpected_reasons"]:
        print("  unexpected:", reason)
    for name, fit in summary["rss_slope"].items():
        print(f"RSS slope, {name}: {fit['slope_mib_per_hour']} MiB/hour over {fit['points']} samples {fit['window_s']}")
    for failure in summary["failures"]:
        print("  FAIL:", failure)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
