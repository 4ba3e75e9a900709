"""Load: 32 streaming multi-turn clients for 60 s against `mfs serve` (real engine, tiny family, small pool).

10% of requests disconnect at a random point. Afterwards: no used pages, no errors other than the
cancelled ones, server RSS flat within 10% between warm-up and the end, and SIGTERM exits 0.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.fakes_serving import REPO, family_dir, free_port

FAMILY_DIR = family_dir()
pytestmark = [pytest.mark.slow]
CLIENTS = 32
DURATION_S = 60.0
WARMUP_S = 15.0
MAX_REQUESTS = 20000             # a bound on the count as well as the time
DISCONNECT_RATE = 0.10
TURNS_PER_SESSION = 4
USER_LINES = [
    "Can you explain how a river forms a delta over many years?",
    "What is a good way to learn to cook simple meals at home?",
    "Tell me about the history of the bicycle in three sentences.",
    "Why do cats sleep so much during the day?",
    "How should I plan a small vegetable garden on a balcony?",
    "Write a short poem about the sea at night.",
]


@dataclass(slots=True)
class Tally:
    completed: int = 0
    disconnected: int = 0
    tokens: int = 0
    cached_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def one_turn(http: httpx.AsyncClient, session: str, messages: list[dict], rng: random.Random,
                   tally: Tally) -> str | None:
    body = {"model": "tiny", "messages": messages, "max_tokens": rng.randint(8, 32), "stream": True,
            "temperature": 0.8, "seed": rng.randint(0, 2**31), "stream_options": {"include_usage": True}}
    cut_after = rng.randint(1, 12) if rng.random() < DISCONNECT_RATE else None
    started = time.monotonic()
    text, events = [], 0
    async with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-ID": session}) as resp:
        if resp.status_code != 200:
            tally.errors.append(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            return None
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            payload = json.loads(line[6:])
            if "error" in payload:
                tally.errors.append(f"stream error: {payload['error']}")
                return None
            events += 1
            if events == 2:
                tally.ttft_s.append(time.monotonic() - started)
            if cut_after is not None and events >= cut_after:
                tally.disconnected += 1
                return None                       # leaving the block closes the connection mid-stream
            if payload.get("usage"):
                tally.tokens += payload["usage"]["completion_tokens"]
                tally.cached_tokens += payload["usage"]["prompt_tokens_details"]["cached_tokens"]
            for choice in payload["choices"]:
                text.append(choice["delta"].get("content") or "")
                if choice["finish_reason"] not in (None, "stop", "length"):
                    tally.errors.append(f"finish_reason {choice['finish_reason']}")
    tally.completed += 1
    return "".join(text)


async def client_loop(base_url: str, index: int, deadline_s: float, tally: Tally) -> None:
    rng = random.Random(index)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        session_no = 0
        while time.monotonic() < deadline_s and tally.completed + tally.disconnected < MAX_REQUESTS:
            session_no += 1
            session, messages = f"c{index}-s{session_no}", []
            for _ in range(TURNS_PER_SESSION):
                if time.monotonic() >= deadline_s:
                    return
                messages.append({"role": "user", "content": rng.choice(USER_LINES)})
                answer = await one_turn(http, session, messages, rng, tally)
                if answer is None:
                    break
                messages.append({"role": "assistant", "content": answer})


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def start_server(tmp_path: Path, grace_s: float) -> tuple[subprocess.Popen, str]:
    """`mfs serve` in a subprocess on the tiny family with a small KV pool; returns it once healthy."""
    port = free_port()
    config = tmp_path / "load.yaml"
    config.write_text(json.dumps({   # JSON is YAML
        "family": str(FAMILY_DIR),
        "pool": {"num_pages": 384, "host_tier_mb": 0},
        "engine": {"device": "cpu", "num_threads": 1},
        "scheduler": {"request_timeout_s": 120},
    }))
    with (tmp_path / "server.log").open("w") as log_file:
        server = subprocess.Popen([sys.executable, "-m", "orchestrator.serve.cli", "serve", "--config", str(config),
                                   "--port", str(port), "--log-level", "warning", "--grace-s", str(grace_s)],
                                  cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(base + "/health").status_code == 200, 180, "server health")
    except AssertionError:
        server.kill()
        raise
    return server, base


def terminate(server: subprocess.Popen, timeout_s: float = 30) -> int:
    server.send_signal(signal.SIGTERM)
    try:
        return server.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        return -9


def test_concurrent_streaming_sessions_with_disconnects(tmp_path):
    server, base = start_server(tmp_path, grace_s=5)
    try:
        tally = Tally()
        start_s = time.monotonic()

        async def run() -> int:
            clients = [asyncio.create_task(client_loop(base, i, start_s + DURATION_S, tally)) for i in range(CLIENTS)]
            await asyncio.sleep(WARMUP_S)
            warm_rss = rss_kib(server.pid)
            await asyncio.gather(*clients)
            return warm_rss
        warm_rss = asyncio.run(run())
        elapsed_s = time.monotonic() - start_s

        def idle() -> bool:
            s = httpx.get(base + "/v1/stats").json()
            return s["queue_depth"] == 0 and not any(s["running"].values()) and s["pages"]["by_state"]["used"] == 0
        wait_until(idle, 30, "the engine to go idle with no used pages")
        stats = httpx.get(base + "/v1/stats").json()
        end_rss = rss_kib(server.pid)
        p50 = sorted(tally.ttft_s)[len(tally.ttft_s) // 2] if tally.ttft_s else float("nan")
        print(f"\nload: {elapsed_s:.0f} s, {CLIENTS} clients, {tally.completed} completed, {tally.disconnected} "
              f"disconnected, {len(tally.errors)} errors, {tally.tokens} tokens ({tally.tokens / elapsed_s:.0f}/s), "
              f"{tally.cached_tokens} cached prompt tokens, p50 ttft {p50 * 1000:.0f} ms")
        print(f"load: pages {stats['pages']['by_state']}, requests {stats['counters']['requests']}")
        print(f"load: RSS warm {warm_rss / 1024:.0f} MiB -> end {end_rss / 1024:.0f} MiB "
              f"({(end_rss - warm_rss) / warm_rss:+.1%})")
        assert not tally.errors, tally.errors[:5]
        assert tally.completed > CLIENTS and tally.disconnected > 0
        assert stats["pages"]["by_state"]["used"] == 0
        assert abs(end_rss - warm_rss) <= 0.10 * warm_rss
    finally:
        rc = terminate(server)
    assert rc == 0, (tmp_path / "server.log").read_text()[-2000:]


def test_sigterm_drains_in_flight_stream_and_exits_zero(tmp_path):
    server, base = start_server(tmp_path, grace_s=1)
    lines: list[str] = []

    async def long_stream() -> None:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 300, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=base, timeout=60) as http, \
                http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)

    async def run() -> tuple[int, float]:
        stream = asyncio.create_task(long_stream())
        while len(lines) < 3 and not stream.done():
            await asyncio.sleep(0.05)
        assert not stream.done(), stream.exception()
        started = time.monotonic()
        rc = await asyncio.to_thread(terminate, server)
        await stream
        return rc, time.monotonic() - started
    try:
        rc, exit_s = asyncio.run(run())
    finally:
        if server.poll() is None:
            server.kill()
    print(f"\nsigterm: exit {rc} after {exit_s:.1f} s, {len(lines)} events, last {lines[-2][:120]}")
    assert rc == 0 and exit_s < 15
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"cancelled"' in lines[-2] or '"finish_reason":"length"' in lines[-2]
