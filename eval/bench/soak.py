"""Soak benchmark: a real `mfs serve` under mixed load for minutes to hours; does anything grow?

Starts `mfs serve` on the shipped tiny family (local engine in its own process), runs the clients of
eval/bench/soak_load.py (chat sessions, completions, streams, cancelled streams, slow readers, clients that give up,
penalties, invalid bodies) and samples every few seconds: the RSS, open descriptors and threads of the server
and of its engine process, KV pages used and cached and the queue depth (/v1/stats). After the load it waits
for the server to go idle, takes a last sample, stops the server (SIGTERM) and reports the drift: RSS at the
end against RSS after warm-up (the median of the samples in a window of each), descriptor and thread counts,
pages used at the end, and the outcome counts. Writes a JSON and a PNG plot.

    python -m eval.bench.soak --minutes 2                  # a check
    python -m eval.bench.soak --minutes 30 --out docs/results/bench/soak_30min.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from eval.bench.soak_load import Tally, run_load

REPO = Path(__file__).resolve().parent.parent
_READY_TIMEOUT_S = 300.0
_IDLE_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "orchestrator.serve.cli", "serve", "--port", str(port), "--log-level", "warning"]
    log = open(log_path, "wb")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mfs serve exited with {proc.returncode} while starting")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("mfs serve did not become healthy")


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
    parser.add_argument("--out", default="artifacts/soak.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    duration_s, warmup_s = args.minutes * 60, args.minutes * 60 * args.warmup_frac
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port, out.with_suffix(".server.log"))
    try:
        wait_ready(url, proc)
        sampler = Sampler(url, psutil.Process(proc.pid), args.sample_s, time.monotonic() + duration_s + 300)
        sampler.start()
        tally = asyncio.run(run_load(url, args.clients, duration_s, args.seed))
        idle = wait_idle(url)
        sampler.stop_event.set()
        sampler.join(30)
        sampler.rows.append(sample(url, psutil.Process(proc.pid), sampler.started_s))
        healthy = httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            exit_code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            exit_code = proc.wait(timeout=10)
    summary = summarize(sampler.rows, idle, tally, warmup_s, duration_s)
    summary.update(minutes=args.minutes, clients=args.clients, healthy_at_end=healthy, server_exit_code=exit_code,
                   command=" ".join(["python -m eval.bench.soak", *sys.argv[1:]]))
    out.write_text(json.dumps({"summary": summary, "samples": sampler.rows}, indent=1))
    plot(sampler.rows, warmup_s, duration_s, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("outcomes", "unexpected_reasons")}, indent=1))
    print("outcomes:", json.dumps(summary["outcomes"]))
    for reason in summary["unexpected_reasons"]:
        print("  unexpected:", reason)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0 if summary["unexpected"] == 0 and summary["pages_used_at_end"] == 0 and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
