"""A REAL tritonserver (nvidia-pytriton) serving the tiny family's python-backend repository, driven by TritonServing
(in a child process behind ProcessServing, as `mfs serve --engine triton` runs it, and in process for escalation).

Checks: greedy tokens equal the local engine's; per-request KV reuse and KV block metrics arrive; killing Triton
fails in-flight requests with EngineUnavailableError and turns is_ready() False; `mfs triton-up` on the same
ports brings it back, TritonServing reconnects, and SIGTERM stops triton-up cleanly.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from contextlib import aclosing

import pytest

from eval.composition import core_parts, load_system_config
from orchestrator.core.errors import EngineUnavailableError
from orchestrator.core.types import FinishReason
from tests.fakes_serving import start_process, stop_process
from tests.triton_helpers import (REPO_ROOT, build_python_repo, collect, family_dir, free_ports, make_request,
                                  wait_until)

FAMILY = family_dir()
pytestmark = [
    pytest.mark.triton,
]
PROMPTS = {
    "walk": "I am planning a long walk along the river this weekend with two friends and a dog. "
            "What should we pack, and where should we stop for lunch?",
    "code": "Write a python function that returns the sum of the squares of a list of numbers, and explain it.",
}
MAX_TOKENS = 10
# Every window looks unconfident (threshold above 1) and routing picks tiny-s: s -> m -> l after 4 tokens each.
# The local engine runs without warm-ups (the Triton path has none): eval's composition of that switch.
ESCALATING = {"escalation.threshold": 1.01, "escalation.min_tokens": 4, "escalation.window_tokens": 4,
              "router.complexity_thresholds": [0.99, 0.995]}
ESCALATION_PROMPT = "Explain how a bicycle gear works and why a lower gear makes climbing a hill easier."
ESCALATION_MODES = ("keep", "rollback")


def _config(**overrides):
    # Same arena geometry as the repository's models (16 KiB pages, float32) so greedy tokens can match.
    return load_system_config({"family": str(FAMILY), "pool.num_pages": 2048, "pool.host_tier_mb": 0.0,
                               "engine.device": "cpu", "engine.num_threads": 1, **overrides})


async def _local_tokens(prompts: dict[str, list[int]], members: list[str]) -> dict[tuple[str, str], list[int]]:
    from orchestrator.serve.serving import LocalServing

    local = LocalServing(_config(**{"escalation.enabled": False}))
    await local.start()
    try:
        return {(name, m): (await collect(local, make_request(f"local-{name}-{m}", ids, MAX_TOKENS, m)))[0]
                for name, ids in prompts.items() for m in members}
    finally:
        await local.stop(1.0)


def _escalating_request(request_id: str, prompt: list[int]):
    request = make_request(request_id, prompt, 16)   # no member: routed, so it may escalate
    request.sampling = dataclasses.replace(request.sampling, ignore_eos=True)   # 16 tokens whatever they are
    return request


async def _local_escalations(prompt: list[int]) -> dict[str, tuple[list[int], list]]:
    """Tokens and member spans of one escalating request on the local engine, per on_escalate mode."""
    from orchestrator.serve.serving import LocalServing

    answers = {}
    for mode in ESCALATION_MODES:
        config = _config(**ESCALATING, **{"escalation.on_escalate": mode, "comparison.warmup": False})
        local = LocalServing(config, **core_parts(config))
        await local.start()
        try:
            tokens, outputs = await collect(local, _escalating_request(f"local-esc-{mode}", prompt))
            answers[mode] = (tokens, [(s.member, s.num_tokens) for s in outputs[-1].spans])
        finally:
            await local.stop(1.0)
    return answers


async def _triton_escalations(server, prompt: list[int]) -> dict[str, tuple[list[int], list]]:
    """The same escalating request through TritonServing (its own config) in front of the running Triton."""
    from orchestrator.serve.triton_serving import TritonServing

    answers = {}
    for mode in ESCALATION_MODES:
        serving = TritonServing(_config(**ESCALATING, **{"escalation.on_escalate": mode}), url=server.grpc_url,
                                metrics_url=server.metrics_url, probe_interval_s=0.2)
        await serving.start()
        try:
            assert await _wait(serving.is_ready, 30)
            tokens, outputs = await collect(serving, _escalating_request(f"t-esc-{mode}", prompt))
            answers[mode] = (tokens, [(s.member, s.num_tokens) for s in outputs[-1].spans])
            assert serving.stats()["counters"]["escalations"]["tiny-s->tiny-m"] == 1
            # Read as the HTTP edge reads (stop at the finished output, close the generator): the request
            # counts as finished, not cancelled, and its tokens reach the stats and the prefix estimate.
            before = serving.stats()["counters"]
            async with aclosing(serving.generate(make_request(f"t-edge-{mode}", prompt, 4, "tiny-s"))) as outs:
                async for out in outs:
                    if out.finished:
                        break
            after = serving.stats()["counters"]
            assert after["requests"]["tiny-s"]["finished"] == before["requests"]["tiny-s"]["finished"] + 1
            assert after["requests"]["tiny-s"]["cancelled"] == before["requests"]["tiny-s"]["cancelled"] == 0
            assert after["generated_tokens"]["tiny-s"] == before["generated_tokens"]["tiny-s"] + 4
        finally:
            await serving.stop(1.0)
    return answers


def _start_triton_up(repo, ports, log_path) -> subprocess.Popen:
    grpc_port, http_port, metrics_port = ports
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.serve.cli", "triton-up", "--repo", str(repo), "--grpc-port", str(grpc_port),
         "--http-port", str(http_port), "--metrics-port", str(metrics_port), "--exit-timeout-s", "2",
         "--log", str(log_path)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


async def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.1)
    return predicate()


def test_triton_serves_like_local_fails_fast_and_reconnects(tmp_path):
    from engines.triton.server_process import TritonProcess
    from orchestrator.serve.engine_process import ProcessServing
    from orchestrator.serve.factory import build_serving_engine

    started = time.monotonic()
    repo = build_python_repo(FAMILY, tmp_path / "build")
    ports = free_ports(3)
    server = TritonProcess(repo=repo, grpc_port=ports[0], http_port=ports[1], metrics_port=ports[2],
                           exit_timeout_s=2, log_path=tmp_path / "triton-1.log")
    triton_up: subprocess.Popen | None = None
    try:
        server.start()
        # What `mfs serve --engine triton` builds: TritonServing in a child process behind ProcessServing, so
        # every check below goes through the pipe.
        serving = build_serving_engine(_config(**{"engine.kind": "triton", "engine.triton_url": server.grpc_url,
                                                  "engine.triton_metrics_url": server.metrics_url}))
        assert isinstance(serving, ProcessServing)
        prompts = {name: serving.tokenizer.encode(text) for name, text in PROMPTS.items()}
        members = serving.member_names
        local = asyncio.run(_local_tokens(prompts, members))      # while Triton's stubs load
        escalation_prompt = serving.tokenizer.encode(ESCALATION_PROMPT)
        local_escalations = asyncio.run(_local_escalations(escalation_prompt))
        server.wait_ready(timeout_s=300)
        print(f"triton ready after {time.monotonic() - started:.1f} s")
        # Escalation over Triton goes through the core's rules (stop, confidence, rollback, hold-back, spans):
        # the same tokens and the same member spans as the local engine, in both on_escalate modes.
        triton_escalations = asyncio.run(_triton_escalations(server, escalation_prompt))
        assert local_escalations["keep"][1] == [("tiny-s", 4), ("tiny-m", 4), ("tiny-l", 8)]
        assert local_escalations["rollback"][1] == [("tiny-l", 16)]   # each window rolled back before it was sent
        assert triton_escalations == local_escalations
        triton_up = asyncio.run(_scenario(serving, server, prompts, members, local, repo, ports, tmp_path))
        # SIGTERM: triton-up stops Triton (short exit timeout) and exits 0, leaving no process behind.
        triton_up.send_signal(signal.SIGTERM)
        assert triton_up.wait(timeout=30) == 0, triton_up.stdout.read()
        with pytest.raises(ProcessLookupError):
            os.killpg(triton_up.pid, 0)
        print(f"whole scenario: {time.monotonic() - started:.1f} s")
    finally:
        server.stop()
        if triton_up is not None and triton_up.poll() is None:
            os.killpg(triton_up.pid, signal.SIGKILL)
            triton_up.wait()


async def _scenario(serving, server, prompts, members, local, repo, ports, tmp_path) -> subprocess.Popen:
    await serving.start()
    assert await _wait(serving.is_ready, 30), "TritonServing never saw Triton ready"
    engine = serving.stats()["engine"]
    assert (engine["kind"], engine["process"]) == ("triton", "separate")
    assert engine["tokens_per_block"] == {m: 16 for m in members}
    try:
        # 1. Greedy tokens through Triton equal the local engine's, member by member.
        for name, ids in prompts.items():
            for member in members:
                tokens, outputs = await collect(serving, make_request(f"t-{name}-{member}", ids, MAX_TOKENS, member))
                assert tokens == local[(name, member)], (name, member)
                assert outputs[-1].finished and outputs[-1].spans[0].member == member
        # 2. The same prompt again: Triton's model reports reused blocks (exact, from the engine).
        ids = prompts["walk"]
        _, outputs = await collect(serving, make_request("t-again", ids, 4, members[0]))
        assert outputs[0].num_cached_prompt_tokens == 16 * ((len(ids) - 1) // 16) > 0
        # 3. Routed (unpinned) request: the router decides, the stats record it.
        tokens, outputs = await collect(serving, make_request("t-routed", ids, 6))
        assert outputs[0].route is not None and outputs[-1].finished
        await asyncio.sleep(1.5)   # one metrics poll
        stats = serving.stats()
        assert stats["recent_routes"][-1]["request_id"] == "t-routed"
        assert all(stats["engine"]["kv_block_metrics"][m]["max"] > 0 for m in members)
        assert stats["counters"]["prefix_hit_tokens"][members[0]]["arena"] > 0

        # 4. abort() ends a request at its next token with finish reason CANCELLED.
        outputs = []
        async for out in serving.generate(make_request("t-aborted", ids, 200, members[0])):
            outputs.append(out)
            if len(outputs) == 1:
                serving.abort("t-aborted")
        assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.CANCELLED
        assert sum(len(o.new_token_ids) for o in outputs) < 200

        # 5. Kill Triton mid-request: the stream fails with EngineUnavailableError, readiness drops.
        long_request = make_request("t-killed", ids, 400, members[-1])
        first_token = asyncio.Event()

        async def consume():
            async for out in serving.generate(long_request):
                if out.new_token_ids:
                    first_token.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first_token.wait(), 60)
        killed_at = time.monotonic()
        await asyncio.to_thread(server.kill)
        with pytest.raises(EngineUnavailableError):
            await asyncio.wait_for(task, 15)
        assert await _wait(lambda: not serving.is_ready(), 5)
        print(f"failure seen after {time.monotonic() - killed_at:.2f} s")
        with pytest.raises(EngineUnavailableError):
            await collect(serving, make_request("t-down", ids, 2, members[0]))

        # 6. `mfs triton-up` on the same ports: TritonServing reconnects and serves the same tokens again.
        triton_up = _start_triton_up(repo, ports, tmp_path / "triton-2.log")
        restarted_at = time.monotonic()
        assert await _wait(serving.is_ready, 300), "no reconnect after Triton came back"
        print(f"reconnected {time.monotonic() - restarted_at:.1f} s after restart")
        tokens, _ = await collect(serving, make_request("t-back", prompts["code"], MAX_TOKENS, members[1]))
        assert tokens == local[("code", members[1])]
        assert serving.stats()["engine"]["reconnects"] == 1
        return triton_up
    finally:
        await serving.stop(1.0)


def _serve(port: int, config_path, log_path, *extra: str) -> subprocess.Popen:
    return start_process([sys.executable, "-m", "orchestrator.serve.cli", "serve", "--config", str(config_path), "--port",
                          str(port), "--grace-s", "2", "--log-level", "warning", *extra], log_path)


def test_mfs_serve_over_triton_answers_like_mfs_serve_local(tmp_path):
    """The issue's CI check: `mfs serve --engine triton` in front of a real tritonserver and
    `mfs serve --engine local` give the same greedy tokens to the official openai client."""
    import httpx
    import yaml
    from openai import OpenAI

    from engines.triton.server_process import TritonProcess

    repo = build_python_repo(FAMILY, tmp_path / "build")
    grpc_port, http_port, metrics_port, triton_api, local_api = free_ports(5)
    config = {"family": str(FAMILY), "pool": {"num_pages": 2048, "host_tier_mb": 0.0},
              "escalation": {"enabled": False},
              "engine": {"device": "cpu", "num_threads": 1, "triton_url": f"127.0.0.1:{grpc_port}",
                         "triton_metrics_url": f"http://127.0.0.1:{metrics_port}/metrics"}}
    config_path = tmp_path / "mfs.yaml"
    config_path.write_text(yaml.safe_dump(config))
    triton = TritonProcess(repo=repo, grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port,
                           exit_timeout_s=2, log_path=tmp_path / "triton.log")
    servers: list[subprocess.Popen] = []
    try:
        triton.start()
        servers.append(_serve(local_api, config_path, tmp_path / "serve-local.log", "--engine", "local"))
        triton.wait_ready(timeout_s=300)
        servers.append(_serve(triton_api, config_path, tmp_path / "serve-triton.log", "--engine", "triton"))
        for port in (local_api, triton_api):
            ok = wait_until(lambda: _healthy(httpx, port), timeout_s=180)
            assert ok, (tmp_path / "serve-triton.log").read_text()[-2000:]
        answers = {}
        for port in (local_api, triton_api):
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60)
            texts = []
            for member, text in zip(("tiny-s", "tiny-m", "tiny-l"), list(PROMPTS.values()) * 2):
                reply = client.completions.create(model=member, prompt=text, max_tokens=MAX_TOKENS, temperature=0)
                assert reply.model == member and reply.usage.completion_tokens >= 1
                texts.append(reply.choices[0].text)
            chat = client.chat.completions.create(model="tiny-m", max_tokens=MAX_TOKENS, temperature=0,
                                                  messages=[{"role": "user", "content": PROMPTS["walk"]}])
            texts.append(chat.choices[0].message.content)
            answers[port] = texts
        assert answers[triton_api] == answers[local_api]
        assert any(answers[local_api])
    finally:
        for process in servers:
            stop_process(process)
        triton.stop()


def _healthy(httpx, port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
