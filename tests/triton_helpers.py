"""Helpers for the Triton tests: the tiny family on disk, free ports, a python-backend repository, stream collection."""
from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

from orchestrator.core.types import MemberName, Request, RequestId, SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent


from tests.fakes_serving import family_dir  # noqa: E402  one definition of the shipped family



def free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def build_python_repo(family: Path, out: Path, kv_budget_gb: float = 0.03) -> Path:
    from build_scripts.build_engines import main as build_engines

    code = build_engines(["--family", str(family), "--out", str(out), "--backend", "python",
                          "--kv-budget-gb", str(kv_budget_gb)])
    assert code == 0, f"build-engines exited {code}"
    return out / "triton_repo"


def make_request(request_id: str, prompt: list[int], max_tokens: int, member: str | None = None) -> Request:
    return Request(request_id=RequestId(request_id), prompt_token_ids=list(prompt),
                   sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0), arrival_s=time.monotonic(),
                   pinned_member=None if member is None else MemberName(member))


async def collect(engine, request: Request) -> tuple[list[int], list]:
    """All tokens of one request and its outputs."""
    outputs = [out async for out in engine.generate(request)]
    return [t for out in outputs for t in out.new_token_ids], outputs


def wait_until(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()
