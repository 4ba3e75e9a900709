"""The servers a serving bench compares, as processes: how each is started (`mfs serve`, vLLM's OpenAI server),
waited for, read from outside (the engine's loop timers, process CPU and scheduler times) and stopped."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_DIR = REPO / "engines" / "families" / "tiny"
MODEL = "tiny-l"


@dataclass(slots=True)
class ServerSpec:
    name: str
    argv: list[str]
    env: dict[str, str | None]          # over the caller's environment; None removes a variable
    cwd: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mfs_spec(port: int, extra: list[str], tree: Path = REPO, name: str = "mfs") -> ServerSpec:
    """`mfs serve` from a source tree (this one, or another checkout for a before/after pair)."""
    argv = [sys.executable, "-m", "orchestrator.serve.cli", "serve", "--family", str(tree / "engines/families/tiny"),
            "--port", str(port), "--log-level", "warning", *extra]
    return ServerSpec(name, argv, {"PYTHONPATH": str(tree)}, tree)


def vllm_spec(port: int, python: Path, extra: list[str]) -> ServerSpec:
    # The tiny-l directory holds the checkpoint and the tokenizer files side by side, as vLLM needs.
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(TINY_DIR / MODEL),
            "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "1024",
            "--port", str(port), "--disable-uvicorn-access-log", *extra]
    return ServerSpec("vllm", argv, {"VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONPATH": ""}, REPO)


async def wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
            try:
                async with session.get(base_url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s")


async def engine_timers(base_url: str) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(base_url + "/v1/stats") as resp:
            return (await resp.json()).get("engine", {}).get("timers", {}) if resp.status == 200 else {}


def timer_delta(before: dict, after: dict, duration_s: float) -> dict:
    """Loop timers accumulated over the load: shares of the wall time and per-step means."""
    if not after:
        return {}
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = max(1, int(delta.get("steps", 0)))
    out = {"steps": int(delta.get("steps", 0)), "wall_s": duration_s,
           "computed_tokens_per_step": delta.get("computed_tokens", 0) / steps}
    for key, value in delta.items():
        if key.endswith("_s") and key != "wall_s":
            out[key[:-2] + "_share"] = value / duration_s
            out[key[:-2] + "_ms_per_step"] = 1000 * value / steps
    return out


def process_cpu_s(pid: int) -> dict[str, float]:
    """user+system CPU seconds of the server process ("server") and each child process (by name: vLLM titles
    its processes; MFS's engine process is "engine-core"), summed per name. Empty without psutil."""
    try:
        import psutil
    except ImportError:
        return {}
    out: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [("server", root)] + [(_label(p), p) for p in root.children(recursive=True)]
        for label, proc in procs:
            times = proc.cpu_times()
            out[label] = out.get(label, 0.0) + times.user + times.system
    except psutil.Error:
        pass
    return out


def _label(proc) -> str:
    try:
        cmdline = " ".join(proc.cmdline())
    except Exception:
        return "child"
    if "multiprocessing.spawn" in cmdline or "multiprocessing.forkserver" in cmdline:
        return "engine-core" if "resource_tracker" not in cmdline else "resource-tracker"
    if "resource_tracker" in cmdline:
        return "resource-tracker"
    return proc.name() or "child"


def process_sched_s(pid: int) -> dict[str, tuple[float, float]]:
    """Per process of the server's tree (labelled as in process_cpu_s): (seconds on a CPU, seconds runnable but
    waiting for one) summed over its threads, from /proc/PID/task/*/schedstat. The waiting share is what the
    other work on a shared machine took from it. Empty without psutil or /proc."""
    try:
        import psutil
        root = psutil.Process(pid)
        procs = [("server", root)] + [(_label(p), p) for p in root.children(recursive=True)]
    except Exception:
        return {}
    out: dict[str, tuple[float, float]] = {}
    for label, proc in procs:
        run_ns = wait_ns = 0
        try:
            for task in Path(f"/proc/{proc.pid}/task").iterdir():
                fields = (task / "schedstat").read_text().split()
                run_ns, wait_ns = run_ns + int(fields[0]), wait_ns + int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
        prev = out.get(label, (0.0, 0.0))
        out[label] = (prev[0] + run_ns / 1e9, prev[1] + wait_ns / 1e9)
    return out


@dataclass(slots=True)
class Server:
    spec: ServerSpec
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def launch(spec: ServerSpec, port: int, log_dir: Path) -> Server:
    log_path = log_dir / f"{spec.name}.log"
    with log_path.open("w") as log_file:
        env = {k: v for k, v in {**os.environ, **spec.env}.items() if v is not None}
        proc = subprocess.Popen(spec.argv, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=spec.cwd,
                                start_new_session=True)
    return Server(spec, port, proc, log_path)


def shut_down(server: Server) -> None:
    if server.proc.poll() is not None:
        return
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()


async def sse_events(lines) -> AsyncIterator[dict]:
    """The JSON events of a streamed OpenAI response (aiohttp's resp.content), up to `data: [DONE]`."""
    import orjson

    async for line in lines:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            return
        yield orjson.loads(payload)
