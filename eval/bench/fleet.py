"""Fleet benchmark: real `mfs fleet up` processes (replicas + SGLang Model Gateway) replaying ShareGPT sessions.

  python -m eval.bench.fleet [--replicas 2] [--policies sticky cache_aware round_robin] [--sessions 16]
                             [--turns 3] [--concurrency 4] [--seeds 1] [--out artifacts/fleet_bench.json]

For each seed and policy it starts a fresh fleet (cold caches), replays the same sessions (the recorded assistant
replies are the history, so every policy sees identical prompts), and prints per policy: the prefix-cache hit
rate of turns 2+ (cached / prompt tokens), how often a turn landed on its session's previous node, and the
end-to-end latency. Then, on the first policy's fleet, the cost of the two extra hops (front + gateway):
identical requests sent alternately straight to a replica and through the front, pinned to that replica.
Everything runs on this machine's CPUs: the figures are measured, not simulated, and noisy when other work
shares the machine.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from orchestrator.serve.fleet import port_is_free
from orchestrator.sharegpt import iter_conversations

REPO = Path(__file__).resolve().parents[2]
MAX_MESSAGE_CHARS = 240          # the tiny family's context is 1024 tokens: keep 3 turns of history inside it
NUM_OVERHEAD_PAIRS = 40


def free_base_port(count: int) -> int:
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = sock.getsockname()[1]
        if base + count < 65000 and all(port_is_free("127.0.0.1", p) for p in range(base, base + count)):
            return base
    raise RuntimeError("no block of free ports")



@contextlib.contextmanager
def running_fleet(replicas: int, policy: str, config: str | None, log_dir: Path) -> Iterator[dict]:
    """`mfs fleet up` in a subprocess; yields its fleet.json; SIGTERM (its own clean shutdown) on exit."""
    port = free_base_port(2 * replicas + 5)
    cmd = [sys.executable, "-m", "orchestrator.serve.cli", "fleet", "up", "--replicas", str(replicas),
           "--policy", policy, "--port", str(port), "--log-dir", str(log_dir), "--restart-delay-s", "-1"]
    if config:
        cmd += ["--config", config]
    with (log_dir.parent / f"{log_dir.name}.out").open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (log_dir / "fleet.json").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"fleet did not start; see {log_dir}")
            time.sleep(0.5)
        yield json.loads((log_dir / "fleet.json").read_text())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def load_sessions(num_sessions: int, num_turns: int, seed: int) -> list[list[list[dict]]]:
    """num_sessions ShareGPT conversations with >= num_turns user turns; per session, the prompt of each turn."""
    pool = [c for c in iter_conversations(limit=num_sessions * 8, min_messages=2 * num_turns)
            if c.messages[0]["role"] == "user"]
    if len(pool) < num_sessions:
        raise RuntimeError(f"only {len(pool)} ShareGPT conversations with {num_turns} turns")
    random.Random(seed).shuffle(pool)
    sessions = []
    for conversation in pool[:num_sessions]:
        messages = [{"role": m["role"], "content": m["content"][:MAX_MESSAGE_CHARS]} for m in conversation.messages]
        sessions.append([messages[:2 * k + 1] for k in range(num_turns)])
    return sessions


def post(client: httpx.Client, url: str, session: str | None, messages: list[dict], max_tokens: int,
         headers: dict | None = None) -> dict:
    headers = {**({"X-Session-ID": session} if session else {}), **(headers or {})}
    started = time.perf_counter()
    response = client.post(url + "/v1/chat/completions", headers=headers, json={
        "model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    latency_s = time.perf_counter() - started
    response.raise_for_status()
    usage = response.json()["usage"]
    return {"latency_s": latency_s, "node": response.headers.get("x-mfs-node"),
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def replay(front: str, sessions: list[list[list[dict]]], concurrency: int, max_tokens: int) -> list[dict]:
    """Each session's turns in order; `concurrency` sessions at a time. Returns one record per request."""
    records: list[dict] = []
    lock = threading.Lock()
    next_session = iter(range(len(sessions)))

    def worker() -> None:
        with httpx.Client(timeout=300) as client:
            while True:
                with lock:
                    index = next(next_session, None)
                if index is None:
                    return
                for turn, messages in enumerate(sessions[index]):
                    record = post(client, front, f"bench-{index}", messages, max_tokens)
                    record.update(session=index, turn=turn)
                    with lock:
                        records.append(record)
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return records


def summarize(records: list[dict], wall_s: float) -> dict:
    later = [r for r in records if r["turn"] > 0]
    node_of = {(r["session"], r["turn"]): r["node"] for r in records}
    same = sum(node_of[(r["session"], r["turn"] - 1)] == r["node"] for r in later)
    latencies = sorted(r["latency_s"] for r in records)
    return {"num_requests": len(records), "wall_s": wall_s,
            "hit_rate_turns_2plus": sum(r["cached_tokens"] for r in later)
            / max(1, sum(r["prompt_tokens"] for r in later)),
            "same_node_turns_2plus": same / max(1, len(later)),
            "latency_mean_s": statistics.fmean(latencies), "latency_p50_s": latencies[len(latencies) // 2],
            "latency_p90_s": latencies[int(0.9 * (len(latencies) - 1))],
            "requests_by_node": {n: sum(r["node"] == n for r in records) for n in sorted({r["node"] for r in records})}}


def hop_overhead(plan: dict) -> dict:
    """Paired: the same request straight to a replica, through its gateway (routing key set by hand) and through
    the front, interleaved, all pinned to the same replica; the differences split the cost of the two hops."""
    messages = [{"role": "user", "content": "Name three rivers in Europe."}]
    gateway = plan["gateways"].get("sticky") or next(iter(plan["gateways"].values()))
    times_s: dict[str, list[float]] = {"direct": [], "gateway": [], "front": []}
    with httpx.Client(timeout=120) as client:
        node = post(client, plan["front"], "overhead", messages, 1)["node"]
        for _ in range(NUM_OVERHEAD_PAIRS):
            times_s["front"].append(post(client, plan["front"], "overhead", messages, 1)["latency_s"])
            times_s["gateway"].append(post(client, gateway, None, messages, 1,
                                           {"x-smg-routing-key": "overhead"})["latency_s"])
            times_s["direct"].append(post(client, f"http://{node}", "overhead", messages, 1)["latency_s"])

    def paired_ms(a: str, b: str) -> float:
        return 1e3 * statistics.median(x - y for x, y in zip(times_s[a], times_s[b]))
    return {"num_pairs": NUM_OVERHEAD_PAIRS, "direct_median_ms": 1e3 * statistics.median(times_s["direct"]),
            "gateway_median_ms": 1e3 * statistics.median(times_s["gateway"]),
            "front_median_ms": 1e3 * statistics.median(times_s["front"]),
            "gateway_hop_ms": paired_ms("gateway", "direct"), "front_hop_ms": paired_ms("front", "gateway"),
            "paired_diff_median_ms": paired_ms("front", "direct")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench.fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--policies", nargs="+", default=["sticky", "cache_aware", "round_robin"])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--config", help="replica config (default: tiny family, local CPU engine, 1 thread, "
                                         "1024 pages, no host tier)")
    parser.add_argument("--out", default="artifacts/fleet_bench.json")
    args = parser.parse_args(argv)
    results: dict = {"args": vars(args), "runs": []}
    with tempfile.TemporaryDirectory(prefix="mfs-fleet-bench-") as tmp:
        if args.config is None:   # one engine thread per replica: N replicas share this machine's cores
            args.config = str(Path(tmp) / "replica.yaml")
            Path(args.config).write_text(json.dumps({"family": "tiny", "pool": {"num_pages": 1024, "host_tier_mb": 0},
                                                     "engine": {"device": "cpu", "num_threads": 1}}))
        for seed in range(args.seeds):
            sessions = load_sessions(args.sessions, args.turns, seed)
            for j, policy in enumerate(args.policies):
                with running_fleet(args.replicas, policy, args.config, Path(tmp) / f"s{seed}-{policy}") as plan:
                    started = time.perf_counter()
                    records = replay(plan["front"], sessions, args.concurrency, args.max_tokens)
                    run = {"seed": seed, "policy": policy, **summarize(records, time.perf_counter() - started)}
                    if seed == 0 and j == 0:
                        run["hop_overhead"] = hop_overhead(plan)
                results["runs"].append(run)
                print(f"seed {seed} {policy:12s} hit(turns 2+) {run['hit_rate_turns_2plus']:6.1%}  same node "
                      f"{run['same_node_turns_2plus']:6.1%}  latency mean {run['latency_mean_s'] * 1e3:7.1f} ms "
                      f"p90 {run['latency_p90_s'] * 1e3:7.1f} ms  wall {run['wall_s']:.1f} s  "
                      f"by node {list(run['requests_by_node'].values())}", flush=True)
                if "hop_overhead" in run:
                    h = run["hop_overhead"]
                    print(f"  hops: direct median {h['direct_median_ms']:.1f} ms, via the gateway "
                          f"{h['gateway_median_ms']:.1f} ms, via the front {h['front_median_ms']:.1f} ms; paired "
                          f"medians: gateway hop {h['gateway_hop_ms']:.1f} ms, front hop {h['front_hop_ms']:.1f} ms, "
                          f"both {h['paired_diff_median_ms']:.1f} ms over {h['num_pairs']} triples", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
