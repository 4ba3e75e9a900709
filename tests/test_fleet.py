"""`mfs fleet up --replicas 2`: two real `mfs serve` processes behind the real SGLang Model Gateway, through the
official `openai` client, on loopback. Sessions stick to a replica, turn 2 hits its cache, a replica killed
mid-run costs only its in-flight stream, the gateway takes it out and back, and nothing outlives the fleet."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from orchestrator.core.config import load_config
from orchestrator.core.family import dtype_bytes, load_family
from orchestrator.serve.cli import main as cli_main
from tests.fakes_serving import REPO, family_dir

NUM_PORTS = 7                      # front, 2 replicas, 2 gateways, 2 gateway metrics endpoints
RESTART_DELAY_S = 8                # the killed replica comes back after this (+ its start-up)
TURN1_MAX_TOKENS = 4
TOPIC = "tell me what to pack for a long walk by the river with two friends and a dog"


def free_port_block(count: int, attempts: int = 50) -> int:
    """A base port with `count` consecutive free ports above it (bounded search), below the kernel's ephemeral
    range: a block found free there can be taken by any outgoing connection before the fleet binds it (CI saw
    `mfs fleet` refuse a port that was free a moment before)."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(10000, max(10001, ephemeral_low - count))
        free = True
        for port in range(base, base + count):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    free = False
                    break
        if free:
            return base
    raise RuntimeError("no block of free ports")


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def processes_mentioning(needle: str) -> list[int]:
    """Live pids whose command line contains `needle` (the fleet's unique config path or ports)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmdline:
                pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    config_path = tmp / "replica.yaml"
    config_path.write_text(json.dumps({"family": str(family_dir()), "pool": {"num_pages": 512, "host_tier_mb": 0},
                                       "engine": {"device": "cpu", "num_threads": 1},
                                       "scheduler": {"request_timeout_s": 120},
                                       # a replica keeps a session on its member (nested families default to
                                       # 0); this file checks the fleet's stickiness, so exact
                                       # turn-2 hits need the member fixed too
                                       "router": {"session_bonus": 0.2}}))
    port = free_port_block(NUM_PORTS)
    log_dir = tmp / "logs"
    with (tmp / "fleet.out").open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.serve.cli", "fleet", "up", "--replicas", "2",
                                 "--config", str(config_path), "--port", str(port), "--log-dir", str(log_dir),
                                 "--restart-delay-s", str(RESTART_DELAY_S), "--grace-s", "5"],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    started_s = time.monotonic()
    try:
        wait_for(lambda: (log_dir / "fleet.json").exists() or proc.poll() is not None, 240, "fleet.json")
        assert proc.poll() is None, f"mfs fleet exited: {(tmp / 'fleet.out').read_text()[-3000:]}"
        print(f"fleet up in {time.monotonic() - started_s:.1f} s")
        plan = json.loads((log_dir / "fleet.json").read_text())
        yield {"plan": plan, "front": plan["front"], "config": config_path, "log_dir": log_dir, "proc": proc}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)          # the fleet's own shutdown path, not a group kill
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        # Every replica and gateway (restarted ones included) mentions the config path or a replica URL.
        needles = [str(config_path)] + plan_urls(log_dir)
        try:
            wait_for(lambda: not any(processes_mentioning(n) for n in needles), 20, "the fleet's children to exit",
                     interval_s=0.5)
        except AssertionError:
            for pid in {p for n in needles for p in processes_mentioning(n)}:
                os.kill(pid, signal.SIGKILL)
            raise
        assert proc.returncode == 0, f"mfs fleet exit status {proc.returncode}"


def plan_urls(log_dir: Path) -> list[str]:
    try:
        return json.loads((log_dir / "fleet.json").read_text())["replicas"]
    except (OSError, ValueError):
        return []


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, session: str | None, messages: list[dict], max_tokens: int, **extra):
    """One non-streaming turn; returns (completion, replica node that answered, node it moved from or None)."""
    headers = {"X-Session-ID": session} if session else {}
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, extra_headers=headers, **extra)
    return raw.parse(), raw.headers.get("x-mfs-node"), raw.headers.get("x-mfs-session-moved")


def block_tokens(config_path: Path, member: str) -> int:
    config = load_config(str(config_path))
    return load_family(family_dir()).member(member).tokens_per_block(config.pool.page_bytes,
                                                                     dtype_bytes(config.engine.dtype))


def replica_requests(url: str) -> float:
    """Requests that left this replica's engine (its own /metrics)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("mfs_requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def expected_turn2_cached(config_path: Path, member: str, turn1_prompt_tokens: int) -> int:
    """Turn 2's prompt starts with turn 1's prompt; the whole blocks of it are cached on the session's replica.
    Turn 1 generated too few tokens to complete another block (asserted), so this is exact."""
    block = block_tokens(config_path, member)
    assert turn1_prompt_tokens % block + TURN1_MAX_TOKENS < block, "test prompt length must leave room"
    return block * (turn1_prompt_tokens // block)


def node_url(node: str) -> str:
    return f"http://{node}"


@pytest.mark.parametrize("argv, message", [
    (["fleet"], "give either `up --replicas N` or `--worker-urls"),
    (["fleet", "up", "--worker-urls", "http://127.0.0.1:1"], "give either"),
    (["fleet", "up", "--replicas", "0"], "--replicas must be >= 1"),
])
def test_fleet_command_line_errors(argv, message, capsys):
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err


def test_fleet_refuses_busy_ports(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        assert cli_main(["fleet", "up", "--replicas", "1", "--port", str(port - 1)]) == 2   # port = replica 1's
    err = capsys.readouterr().err
    assert "are in use" in err and str(port) in err


def test_models_through_the_front_list_the_family(fleet):
    models = client_for(fleet["front"]).models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-s", "tiny-m", "tiny-l"]


def test_ten_sessions_stick_to_one_replica_and_turn_two_hits_its_cache(fleet):
    client = client_for(fleet["front"])
    replicas = fleet["plan"]["replicas"]
    before = {url: replica_requests(url) for url in replicas}
    served: dict[str, int] = {url: 0 for url in replicas}
    sessions = {}
    for i in range(10):
        messages = [{"role": "user", "content": f"Session {i}: {TOPIC}."}]
        first, node, moved = chat(client, f"sticky-{i}", messages, TURN1_MAX_TOKENS)
        assert moved is None and first.usage.prompt_tokens_details.cached_tokens == 0
        sessions[f"sticky-{i}"] = (messages, first, node)
        served[node_url(node)] += 1
    for session, (messages, first, node) in sessions.items():
        messages = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                               {"role": "user", "content": "And if it rains?"}]
        second, node2, moved = chat(client, session, messages, 4)
        served[node_url(node2)] += 1
        print(session, node, node2, first.usage.prompt_tokens, second.usage.prompt_tokens_details.cached_tokens)
        assert node2 == node and moved is None, f"{session} moved from {node} to {node2}"
        assert second.model == first.model                      # the replica keeps the session on its member
        assert second.usage.prompt_tokens_details.cached_tokens == \
            expected_turn2_cached(fleet["config"], first.model, first.usage.prompt_tokens)
    # Each replica's own counters agree with the node headers: 20 requests, each counted once where it ran.
    after = {url: replica_requests(url) for url in replicas}
    assert {url: after[url] - before[url] for url in replicas} == served
    assert sum(served.values()) == 20


def test_user_field_is_the_session_and_cache_salt_survives_the_gateway(fleet):
    client = client_for(fleet["front"])
    messages = [{"role": "user", "content": f"Salted: {TOPIC}, and what to eat on the way."}]
    first, node, _ = chat(client, None, messages, 4, user="alice", extra_body={"cache_salt": "tenant-a"})
    again, node2, _ = chat(client, None, messages, 4, user="alice", extra_body={"cache_salt": "tenant-a"})
    other, node3, _ = chat(client, None, messages, 4, user="alice", extra_body={"cache_salt": "tenant-b"})
    assert node == node2 == node3                                # `user` pinned all three to one replica
    assert again.usage.prompt_tokens_details.cached_tokens > 0   # same salt: shared cache
    # Another salt must not see tenant-a's pages: without the front carrying cache_salt past the gateway
    # (which drops it from chat bodies), this would be a cache hit.
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_fleet_in_front_of_replicas_started_elsewhere(fleet, tmp_path):
    """`mfs fleet --worker-urls`: gateways and front only; stopping it leaves the replicas it did not start."""
    replicas = fleet["plan"]["replicas"]
    port = free_port_block(5)                          # front, 2 gateways, 2 metrics endpoints
    log_dir = tmp_path / "logs"
    with (tmp_path / "out").open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.serve.cli", "fleet", "--worker-urls", *replicas,
                                 "--port", str(port), "--log-dir", str(log_dir)],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: (log_dir / "fleet.json").exists() or proc.poll() is not None, 120, "fleet.json")
        front = json.loads((log_dir / "fleet.json").read_text())["front"]
        client = client_for(front)
        messages = [{"role": "user", "content": f"Elsewhere: {TOPIC}."}]
        first, node, _ = chat(client, "elsewhere", messages, TURN1_MAX_TOKENS)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And if it rains?"}]
        second, node2, _ = chat(client, "elsewhere", messages, 4)
        assert node2 == node and second.usage.prompt_tokens_details.cached_tokens == \
            expected_turn2_cached(fleet["config"], first.model, first.usage.prompt_tokens)
        assert wait_for(lambda: httpx.get(front + "/health", timeout=5).json()["healthy_workers"]
                        == {"cache_aware": 2, "sticky": 2}, 30, "both replicas healthy")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert all(httpx.get(url + "/health", timeout=5).status_code == 200 for url in replicas)


def test_replica_lost_mid_run_later_requests_answered_and_it_comes_back(fleet):
    client = client_for(fleet["front"])
    replicas = fleet["plan"]["replicas"]
    sessions = {}
    for i in range(6):
        messages = [{"role": "user", "content": f"Trip {i}: {TOPIC}."}]
        first, node, _ = chat(client, f"fault-{i}", messages, TURN1_MAX_TOKENS)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And if it rains?"}]
        sessions[f"fault-{i}"] = (messages, first, node)
    victim = sessions["fault-0"][2]
    survivor = next(url for url in replicas if url != node_url(victim)).removeprefix("http://")
    on_victim = [s for s, (_, _, node) in sessions.items() if node == victim]
    on_survivor = [s for s in sessions if s not in on_victim]

    # Two requests in flight on the victim: a stream (first chunk read) and a long non-streaming one.
    probe = [{"role": "user", "content": "Probe: count slowly from one to one hundred."}]
    stream = client.chat.completions.create(model="tiny", messages=probe, max_tokens=900, temperature=0, stream=True,
                                            extra_headers={"X-Session-ID": on_victim[0]},
                                            extra_body={"ignore_eos": True})
    assert stream.response.headers["x-mfs-node"] == victim
    chunks = iter(stream)
    next(chunks)
    outcome: dict = {}

    def long_request() -> None:
        try:
            outcome["result"] = chat(client, on_victim[0], probe, 300, extra_body={"ignore_eos": True})
        except Exception as exc:  # recorded and asserted below
            outcome["error"] = exc
    worker = threading.Thread(target=long_request, daemon=True)
    worker.start()
    running = lambda: sum(httpx.get(node_url(victim) + "/v1/stats", timeout=5).json()["running"].values()) >= 2
    wait_for(running, 30, "both probes running on the victim")
    os.killpg(fleet["plan"]["pids"][f"replica-{replicas.index(node_url(victim)) + 1}"], signal.SIGKILL)
    killed_s = time.monotonic()

    with pytest.raises(openai.APIError, match="node serving this request was lost"):
        for _ in chunks:                                      # bounded: 900 tokens at most, 120 s client timeout
            pass
    print(f"stream failed {time.monotonic() - killed_s:.2f} s after the kill")
    worker.join(timeout=120)
    assert not worker.is_alive(), "the in-flight non-streaming request hung"
    assert "error" not in outcome, f"in-flight non-streaming request: {outcome.get('error')!r}"
    answer, node, moved = outcome["result"]     # the gateway retried it on the survivor: a cold, complete answer
    assert (node, moved) == (survivor, victim) and answer.usage.completion_tokens == 300
    assert answer.usage.prompt_tokens_details.cached_tokens == 0

    def health() -> dict:
        return httpx.get(fleet["front"] + "/health", timeout=5).json()
    down = wait_for(lambda: (h := health())["healthy_workers"] == {"cache_aware": 1, "sticky": 1} and h, 30,
                    "the gateways to take the victim out")
    for gateway in down["gateways"].values():
        assert {w["url"]: w["healthy"] for w in gateway["workers"]} == {node_url(victim): False,
                                                                         node_url(survivor): True}

    # Every later request is answered by the survivor; moved sessions start cold there and are reported.
    for session, (messages, first, node) in sessions.items():
        second, node2, moved = chat(client, session, messages, 4)
        cached = second.usage.prompt_tokens_details.cached_tokens
        print(session, node, "->", node2, "moved from", moved, "cached", cached)
        assert node2 == survivor
        if session in on_survivor:
            assert moved is None
            assert cached == expected_turn2_cached(fleet["config"], first.model, first.usage.prompt_tokens)
        else:
            assert cached == 0
            assert moved == (None if session == on_victim[0] else victim)   # fault-0 was reported on the probe

    up = wait_for(lambda: (h := health())["healthy_workers"] == {"cache_aware": 2, "sticky": 2} and h,
                  RESTART_DELAY_S + 180, "the restarted replica to be taken back")
    print(f"victim back {time.monotonic() - killed_s:.1f} s after the kill")
    assert all(w["healthy"] for g in up["gateways"].values() for w in g["workers"])
    # The sticky gateway keeps a session's first replica first: a moved session returns to the restarted
    # (cold) node, and the front reports that move too.
    messages, _, _ = sessions[on_victim[-1]]
    back, node3, moved = chat(client, on_victim[-1], messages, 4)
    assert (node3, moved) == (victim, survivor) and back.usage.prompt_tokens_details.cached_tokens == 0
    metrics = httpx.get(fleet["front"] + "/metrics", timeout=5).text
    assert "mfs_fleet_lost_streams_total 1.0" in metrics


def test_streams_pass_through_and_a_client_that_leaves_frees_its_pages(fleet):
    front, client = fleet["front"], client_for(fleet["front"])
    prompt = "Streaming: a short note about rivers, bridges and the people who cross them every day."
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                                            extra_headers={"X-Session-ID": "stream-1"}))
    assert chunks[-1].usage.completion_tokens == 12               # complete, no error event appended

    def cancelled(node: str) -> float:
        text = httpx.get(node_url(node) + "/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("mfs_requests_total{") and 'outcome="cancelled"' in line)

    def idle(node: str) -> bool:
        stats = httpx.get(node_url(node) + "/v1/stats", timeout=5).json()
        return stats["pages"]["by_state"]["used"] == 0 and not any(stats["running"].values()) \
            and not any(stats["waiting"].values())
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 900, "ignore_eos": True}
    node = chat(client, "leaver", [{"role": "user", "content": "Where am I?"}], 1)[1]    # the session's replica
    before = cancelled(node)
    with httpx.stream("POST", front + "/v1/completions", json={**body, "stream": True},
                      headers={"X-Session-ID": "leaver"}, timeout=60) as response:
        assert response.headers["x-mfs-node"] == node
        lines = response.iter_lines()
        for _ in range(40):                          # 20 tokens of 900 (one blank line after each event)
            next(lines)
    # The client left mid-answer: the front closes its upstream, the gateway its, the replica aborts the request.
    wait_for(lambda: cancelled(node) == before + 1 and idle(node), 30, "the left stream to be cancelled")
    # A non-streamed request whose client gives up (read timeout) is cancelled down to the replica too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(front + "/v1/completions", json=body, headers={"X-Session-ID": "leaver"}, timeout=1.5)
    wait_for(lambda: cancelled(node) == before + 2 and idle(node), 30, "the abandoned request to be cancelled")
