"""The local engine as the edge runs it: the LocalExecutor a config asks for (device, threads, parallel forwards)
and the engine block of its stats.

LocalServing (engine.process: thread) and the engine process (engine.process: separate) both assemble their core
with EngineCore and make its executor here; the step measurer times the same executor.
"""
from __future__ import annotations

import os
from typing import Any

from orchestrator.core.config import MFSConfig
from orchestrator.core.engine_api import StepExecutor
from orchestrator.core.engine_core import EngineCore, ExecutorFactory
from orchestrator.core.family import FamilySpec


def local_executor(config: MFSConfig, family: FamilySpec, num_pages: int, own_process: bool = False) -> StepExecutor:
    """The LocalExecutor for `config` over an arena of num_pages. own_process: the engine runs in a process of its
    own (engine.process: separate), not beside an event loop; that decides parallel_forwards' default."""
    from engines.local.executor import executor_from_config

    device = _device(config.engine.device)
    threads = engine_threads(config.engine.num_threads)
    return executor_from_config(config, family, num_pages, config.pool.page_bytes, device=device, num_threads=threads,
                                parallel_forwards=parallel_forwards(config.developer.parallel_forwards, device, threads,
                                                                    own_process))


def local_executor_factory(config: MFSConfig, own_process: bool = False) -> ExecutorFactory:
    """local_executor as EngineCore's make_executor (the arena's size comes from the core)."""
    def make(family: FamilySpec, num_pages: int, _page_bytes: int) -> StepExecutor:
        return local_executor(config, family, num_pages, own_process)
    return make


def engine_stats(core: EngineCore, *, ready: bool, process: str) -> dict[str, Any]:
    """The core's stats snapshot with the engine block (/v1/stats, /metrics): steps, last error, phase timers."""
    snapshot = core.snapshot()
    snapshot["engine"] = {"kind": "local", "steps": core.num_steps, "last_error": core.last_error, "ready": ready,
                          "process": process, "timers": core.timers.to_dict()}
    return snapshot


def engine_threads(configured: int | None) -> int:
    """Intra-op threads for the engine: the configured count, else every available core but one. The server's
    event loop (HTTP, streaming, the bench client) runs in this process too: when the engine's parallel regions
    take every core, each step waits for a worker the event loop has pre-empted. On 2 cores that made the default
    bench's decode steps 2.2x slower (11.3 vs 5.0 ms as measured)."""
    if configured is not None:
        return configured
    return max(1, available_cores() - 1)


def available_cores() -> int:
    """Cores this process may run on (its affinity mask; the machine's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # not on Linux
        return os.cpu_count() or 1


def parallel_forwards(configured: int | None, device: str, threads: int, own_process: bool) -> int:
    """developer.parallel_forwards, or its default: 2 for a CPU engine with one intra-op thread in a process of its
    own on a machine with a second core (the core the HTTP edge barely uses: 1.00-1.09x vLLM-CPU against
    0.87-0.95x with 1, earlier measurements in git history); 1 beside an event loop, where the second thread would
    fight it for the core (as measured: 2-2.5x slower steps), on CUDA, or with more intra-op threads."""
    if configured is not None:
        return configured
    return 2 if own_process and device == "cpu" and threads == 1 and available_cores() >= 2 else 1


def _device(name: str) -> str:
    if name != "auto":
        return name
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"
