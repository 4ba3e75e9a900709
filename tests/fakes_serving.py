"""A fake ServingEngine (deterministic tokens, asyncio delays, scripted failures) and a real-uvicorn test server."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from eval.bench.servers import free_port, wait_ready
from orchestrator.core.errors import MFSError
from orchestrator.core.types import (
    FinishReason,
    MemberName,
    MemberSpan,
    Profile,
    Request,
    RequestId,
    RequestOutput,
    RouteDecision,
)

REPO = Path(__file__).resolve().parent.parent
FAKE_TEXT = " the quick brown fox jumps over the lazy dog. STOP here and the dog sleeps."
BLOCK_TOKENS = 16                       # the fake's prefix-cache granularity


def family_dir() -> Path:
    """The shipped tiny family (committed with the repo): tests never skip for lack of it."""
    return REPO / "engines" / "families" / "tiny"


@dataclass(slots=True)
class FakeServingEngine:
    """Implements orchestrator.core.engine_api.ServingEngine without a model.

    Emits the tokens of FAKE_TEXT (cycled) one per `token_delay_s`; routes to the smallest member
    (quality profile: the largest), escalates to the next member after `escalate_after` tokens if set;
    reports cached prompt tokens = longest prefix shared with an earlier prompt, in whole blocks.
    """

    family_name: str
    member_names: list[str]
    text_token_ids: list[int]
    token_delay_s: float = 0.002
    ready: bool = True
    fail_with: MFSError | None = None            # raised by generate() at admission (QueueFull, Unavailable)
    escalate_after: int | None = None
    eos_after: int | None = None                 # finish with "stop" after this many tokens
    started: bool = False
    stopped: bool = False
    aborted: list[str] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    _live: dict[str, bool] = field(default_factory=dict)       # request_id -> abort flag
    _prompts: list[tuple[int, ...]] = field(default_factory=list)
    _counters: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        m = self.member_names
        self._counters = {
            "requests": {x: {"finished": 0, "cancelled": 0, "failed": 0, "rejected": 0} for x in m},
            "prefix_query_tokens": {x: 0 for x in m},
            "prefix_hit_tokens": {x: {"arena": 0, "host": 0, "disk": 0} for x in m},
            "escalations": {}, "preemptions": 0, "evictions": 0, "offloads": {"host": 0, "disk": 0},
            "warmups": {"issued": 0, "hit": 0},
            "generated_tokens": {x: 0 for x in m}, "prompt_tokens": {x: 0 for x in m},
        }

    async def start(self) -> None:
        self.started = True

    async def stop(self, grace_s: float = 5.0) -> None:
        deadline = time.monotonic() + grace_s
        while self._live and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for rid in list(self._live):
            self._live[rid] = True
        self.stopped = True

    def is_ready(self) -> bool:
        return self.ready

    def abort(self, request_id: RequestId, finish_reason=None) -> None:
        self.aborted.append(request_id)
        if request_id in self._live:
            self._live[request_id] = True

    def _cached_tokens(self, prompt: list[int]) -> int:
        best = 0
        for old in self._prompts:
            n = 0
            for a, b in zip(old, prompt):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        self._prompts.append(tuple(prompt))
        return min(best, len(prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        member = request.pinned_member or MemberName(
            self.member_names[-1] if request.profile is Profile.QUALITY else self.member_names[0])
        if self.fail_with is not None:
            self._counters["requests"][member]["rejected"] += 1
            raise self.fail_with
        self.requests.append(request)
        rid = request.request_id
        self._live[rid] = False
        cached = self._cached_tokens(request.prompt_token_ids)
        c = self._counters
        c["prefix_query_tokens"][member] += len(request.prompt_token_ids)
        c["prefix_hit_tokens"][member]["arena"] += cached
        c["prompt_tokens"][member] += len(request.prompt_token_ids)
        route = RouteDecision(request_id=rid, member=member, reason="fake: smallest member", scores={member: 1.0},
                              components={}, matched_prefix_tokens={member: cached}, complexity=0.1)
        spans: list[MemberSpan] = []
        sp = request.sampling
        outcome = "cancelled"
        try:
            for i in range(sp.max_tokens):
                await asyncio.sleep(self.token_delay_s)
                if self._live.get(rid):
                    yield RequestOutput(rid, [], [], [], member, finished=True,
                                        finish_reason=FinishReason.CANCELLED, num_prompt_tokens=len(request.prompt_token_ids),
                                        num_cached_prompt_tokens=cached, spans=tuple(spans))
                    return
                if self.escalate_after is not None and i == self.escalate_after and not request.pinned_member:
                    nxt = self.member_names[min(self.member_names.index(member) + 1, len(self.member_names) - 1)]
                    c["escalations"][f"{member}->{nxt}"] = c["escalations"].get(f"{member}->{nxt}", 0) + 1
                    member = MemberName(nxt)
                token = self.text_token_ids[i % len(self.text_token_ids)]
                if spans and spans[-1].member == member:
                    spans[-1] = MemberSpan(member, spans[-1].num_tokens + 1)
                else:
                    spans.append(MemberSpan(member, 1))
                c["generated_tokens"][member] += 1
                top = tuple((token + k, -0.5 - k) for k in range(sp.num_top_logprobs))
                eos = self.eos_after is not None and i + 1 >= self.eos_after and not sp.ignore_eos
                last = i + 1 == sp.max_tokens or eos
                if last:
                    outcome = "finished"   # the consumer may close us right after this yield
                yield RequestOutput(
                    rid, [token], [-0.5], [top], member, finished=last,
                    finish_reason=(FinishReason.STOP if eos else FinishReason.LENGTH) if last else None,
                    num_prompt_tokens=len(request.prompt_token_ids), num_cached_prompt_tokens=cached,
                    spans=tuple(spans), route=route if i == 0 else None)
                if last:
                    return
        finally:
            c["requests"][member][outcome] += 1
            self._live.pop(rid, None)

    def stats(self) -> dict[str, Any]:
        running = {m: 0 for m in self.member_names}
        for req in self.requests:
            if req.request_id in self._live:
                running[req.pinned_member or self.member_names[0]] += 1
        used = 2 * sum(running.values())
        total = 256
        cached = min(total - used, len(self._prompts))
        by_member = {m: {"used": 0, "cached": 0, "host": 0, "disk": 0} for m in self.member_names}
        by_member[self.member_names[0]].update(used=used, cached=cached)
        return {
            "time_s": time.monotonic(), "family": self.family_name, "members": list(self.member_names),
            "pages": {"total": total, "page_bytes": 16384,
                      "by_state": {"free": total - used - cached, "used": used, "cached": cached, "host": 0, "disk": 0},
                      "by_member": by_member},
            "queue_depth": 0, "running": running, "waiting": {m: 0 for m in self.member_names},
            "counters": self._counters, "recent_routes": [],
        }


# ----------------------------------------------------------------------------- a real server in a thread
@contextlib.contextmanager
def serve_in_thread(app, timeout_s: float = 15.0, settings=None) -> Iterator[str]:
    """Runs `app` under a real uvicorn server on a free loopback port; yields its base URL. With `settings` (a
    ServerSettings), uvicorn runs as `mfs serve` configures it (server.server_config: the request head's limits)."""
    port = free_port()
    if settings is not None:
        from orchestrator.serve.server import server_config
        config = server_config(app, settings, "127.0.0.1", port, "warning")
        config.timeout_graceful_shutdown = 2
    else:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)


def start_process(cmd: list[str], log_path: Path) -> subprocess.Popen:
    """A server process for an end-to-end test, in its own process group (children go with it)."""
    log = open(log_path, "wb")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = 300.0) -> None:
    """Polls url/health until 200 (eval.bench.servers.wait_ready); fails with the server's log otherwise."""
    try:
        asyncio.run(wait_ready(url, proc, timeout_s))
    except RuntimeError as exc:
        raise AssertionError(f"{exc}\n{log_path.read_text()}") from None


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM to the whole group (the graceful path under test), SIGKILL if it hangs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
