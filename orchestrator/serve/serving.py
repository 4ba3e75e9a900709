"""LocalServing: the whole family on one local engine, driven by one scheduler in one engine thread.

The engine thread runs schedule -> tier copies -> execute -> update; asyncio callers get per-request
streams of RequestOutput. Scheduler state is guarded by one lock held only for the pure planning
and bookkeeping calls, never while the model runs.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.core.complexity import ComplexityEstimator
from orchestrator.core.config import MFSConfig
from orchestrator.core.engine_api import StepExecutor
from orchestrator.core.errors import EngineUnavailableError, MFSError
from orchestrator.core.events import EventKind, EventLog, Stats
from orchestrator.core.family import FamilySpec, dtype_bytes, load_family
from orchestrator.core.kv_cache import KVCacheManager
from orchestrator.core.page_pool import PagePool, split_pages
from orchestrator.core.scheduler import Scheduler
from orchestrator.core.tiers import DiskTier, HostTier, TieredStore
from orchestrator.serve.output_stream import StreamTable
from orchestrator.serve.tokenizer import FamilyTokenizer
from orchestrator.core.types import FinishReason, PageId, Request, RequestId, RequestOutput, StepPlan

log = logging.getLogger("mfs.serving")
_IDLE_WAIT_S = 0.05
_ROLE_MARKERS = ("<|user|>", "<|assistant|>", "<|system|>", "<|im_start|>", "<|start_header_id|>")


def build_serving_engine(config: MFSConfig):
    """The ServingEngine the config asks for: the local engine, or Triton-backed orchestration."""
    if config.engine.kind == "triton":
        from orchestrator.serve.triton_serving import TritonServing

        return TritonServing(config)
    if config.engine.process == "separate":
        from orchestrator.serve.engine_process import ProcessServing

        return ProcessServing(config)
    return LocalServing(config)


def build_estimator(tokenizer: FamilyTokenizer) -> ComplexityEstimator:
    vocab = [tokenizer.token_text(i) for i in range(tokenizer.vocab_size)]
    roles = [i for i, text in enumerate(vocab) if text in _ROLE_MARKERS]
    return ComplexityEstimator(vocab, role_token_ids=roles)


def build_tiers(config: MFSConfig) -> TieredStore | None:
    host = HostTier(int(config.pool.host_tier_mb * 2**20)) if config.pool.host_tier_mb > 0 else None
    disk = DiskTier(Path(config.pool.disk_dir), int(config.pool.disk_tier_mb * 2**20)) if config.pool.disk_tier_mb > 0 else None
    return TieredStore(host, disk) if host is not None or disk is not None else None


class LocalServing:
    def __init__(self, config: MFSConfig, family: FamilySpec | None = None,
                 executor: StepExecutor | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.family = family or load_family(config.family, per_member_lineage=not config.pool.cross_member_sharing)
        self.family_name = self.family.name
        self.member_names = self.family.member_names
        self.tokenizer = FamilyTokenizer(self.family.members[0].checkpoint_dir)
        self.clock = clock
        num_pages = config.num_arena_pages()
        partitions = split_pages(num_pages, config.pool.static_split) if config.pool.static_split else None
        self.pool = PagePool(num_pages, partitions, limits=config.pool.member_limits, members=self.member_names)
        self.tiers = build_tiers(config)
        esc = config.escalation
        self.kv = KVCacheManager(self.family, self.pool, config.pool.page_bytes, dtype_bytes(config.engine.dtype),
                                 self.tiers, record_residuals=esc.enabled and esc.reuse_shared_layers and not esc.cold_handover)
        self.events = EventLog()
        self.stats_counters = Stats()
        self.scheduler = Scheduler(self.family, config, self.pool, self.kv, build_estimator(self.tokenizer),
                                   self.tiers, self.events, self.stats_counters)
        self._executor = executor
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams = StreamTable()
        self._thread: threading.Thread | None = None
        self._running = False
        self._accepting = False
        self._ready = False
        self._last_error: str | None = None
        self.num_steps = 0
        self.timers = LoopTimers()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._thread is not None:
            return
        if self._executor is None:
            self._executor = await asyncio.to_thread(self._make_executor)
        self._running = True
        self._accepting = True
        self._thread = threading.Thread(target=self._engine_loop, name="mfs-engine", daemon=True)
        self._thread.start()
        self._ready = True

    def _make_executor(self) -> StepExecutor:
        from engines.local.executor import LocalExecutor

        cfg = self.config
        return LocalExecutor(self.family, num_pages=self.pool.num_pages, page_bytes=cfg.pool.page_bytes,
                             dtype=cfg.engine.dtype, device=_device(cfg.engine.device),
                             num_threads=engine_threads(cfg.engine.num_threads))

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stops accepting; lets in-flight requests finish for up to grace_s, then cancels the rest."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self._has_work():
            await asyncio.sleep(0.05)
        with self._lock:
            for request_id in self._streams.ids():
                self.scheduler.abort(request_id, "server shutting down")
        self._wake.set()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and self._has_work():
            await asyncio.sleep(0.02)
        self._running = False
        self._ready = False
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
            self._thread = None

    def _has_work(self) -> bool:
        with self._lock:
            return self.scheduler.has_work()

    def is_ready(self) -> bool:
        return self._ready

    # ------------------------------------------------------------------ requests
    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        if not self._accepting:
            raise EngineUnavailableError("engine is not accepting requests (starting or shutting down)")
        request_id = request.request_id
        stream = self._streams.open(request_id)
        try:
            with self._lock:
                self.scheduler.add_request(request, self.clock())   # raises InvalidRequest/QueueFull at once
        except BaseException:
            self._streams.close(request_id)
            raise
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.close(request_id)
            if not finished:
                self.abort(request_id)   # client went away: pages return at the next step

    def abort(self, request_id: RequestId, finish_reason: FinishReason | None = None) -> None:
        with self._lock:
            self.scheduler.abort(request_id, finish_reason=finish_reason)
        self._wake.set()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            snapshot = self.scheduler.snapshot(self.clock())
        snapshot["engine"] = {"kind": "local", "steps": self.num_steps, "last_error": self._last_error,
                              "ready": self._ready, "timers": self.timers.to_dict()}
        return snapshot

    # ------------------------------------------------------------------ engine thread
    def _engine_loop(self) -> None:
        while self._running:
            with self._lock:
                has_work = self.scheduler.has_work()
            if not has_work:
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                self._step()
            except Exception as exc:  # a failed step fails its requests, never the server
                log.exception("engine step failed")
                self._last_error = f"{type(exc).__name__}: {exc}"
                self._fail_running(exc)

    def _step(self) -> None:
        timers = self.timers
        began = time.perf_counter()
        with self._lock:
            plan, outputs = self.scheduler.schedule(self.clock())
        scheduled = time.perf_counter()
        self._deliver(outputs)
        plan = self._copy_tiers(plan)
        if not plan.batches:
            if plan.released_requests:   # execute() releases them itself when it runs
                self._executor.release(plan.released_requests)
            if not outputs:
                self._wake.wait(0.01)   # nothing runnable yet (e.g. waiting for pages): do not spin
                self._wake.clear()
            return
        executing = time.perf_counter()
        sampled = self._executor.execute(plan)
        executed = time.perf_counter()
        self.num_steps += 1
        with self._lock:
            outputs = self.scheduler.update(plan, sampled, self.clock())
        updated = time.perf_counter()
        self._deliver(outputs)
        timers.record(began, scheduled, executing, executed, updated, time.perf_counter())

    def _copy_tiers(self, plan: StepPlan) -> StepPlan:
        """Saves evicted pages to the host/disk tiers and loads tier hits, before the step overwrites them."""
        if self.tiers is None:
            return plan
        now = self.clock()
        stored, failed = copy_tier_pages(plan, self.tiers, self._executor)
        for tier in stored:
            self.stats_counters.on_offload(tier.value, 1)
        if plan.page_saves:
            self.events.emit(EventKind.OFFLOAD, now, None, None, num_pages=len(plan.page_saves))
        if plan.page_loads:
            self.events.emit(EventKind.LOAD, now, None, None, num_pages=len(plan.page_loads) - len(failed))
        if failed:
            with self._lock:
                plan = self.scheduler.drop_failed_loads(plan, failed, now)
        return plan

    def _fail_running(self, exc: Exception) -> None:
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        request_ids = self._streams.ids()
        with self._lock:
            for request_id in request_ids:
                self.scheduler.abort(request_id, message)
        self._streams.dispatch_threadsafe([(request_id, MFSError(message)) for request_id in request_ids])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """All of a step's outputs in one hand-over to the event loop (not one wake-up per request)."""
        if outputs:
            self._streams.dispatch_threadsafe([(output.request_id, output) for output in outputs])


@dataclass(slots=True)
class LoopTimers:
    """Cumulative wall time of the engine loop's phases over the steps that ran a model (for the serving bench
    and the profile in docs/BENCHMARKS.md): read as deltas of /v1/stats between two moments."""

    steps: int = 0
    schedule_s: float = 0.0          # scheduler.schedule under the lock
    prepare_s: float = 0.0           # delivering schedule's outputs, tier copies
    execute_s: float = 0.0           # the model: executor.execute
    update_s: float = 0.0            # scheduler.update under the lock
    deliver_s: float = 0.0           # handing the step's outputs to the streams
    between_steps_s: float = 0.0     # end of one execute to the start of the next: everything that is not the model
    _last_executed: float | None = None

    def record(self, began: float, scheduled: float, executing: float, executed: float, updated: float,
               delivered: float) -> None:
        self.steps += 1
        self.schedule_s += scheduled - began
        self.prepare_s += executing - scheduled
        self.execute_s += executed - executing
        self.update_s += updated - executed
        self.deliver_s += delivered - updated
        if self._last_executed is not None and executing - self._last_executed < 1.0:   # not across idle
            self.between_steps_s += executing - self._last_executed
        self._last_executed = executed

    def to_dict(self) -> dict[str, float]:
        return {"steps": self.steps, "schedule_s": self.schedule_s, "prepare_s": self.prepare_s,
                "execute_s": self.execute_s, "update_s": self.update_s, "deliver_s": self.deliver_s,
                "between_steps_s": self.between_steps_s}


def copy_tier_pages(plan: StepPlan, tiers: TieredStore, executor: StepExecutor) -> tuple[list, list[PageId]]:
    """Copies evicted pages out to the tiers, then tier hits into their fresh pages (in that order: a
    page can be evicted and reloaded in one step). Returns the tiers that stored each saved page and
    the pages whose load failed (missing, or a disk block that failed its checksum)."""
    stored = [tier for page, key in plan.page_saves
              if (tier := tiers.put(key, executor.read_page(page))) is not None]
    failed = []
    for page, key, _tier in plan.page_loads:
        found = tiers.get(key)
        if found is None:
            failed.append(page)
        else:
            executor.write_page(page, found[0])
    return stored, failed


def engine_threads(configured: int | None) -> int:
    """Intra-op threads for the engine: the configured count, else every available core but one. The server's
    event loop (HTTP, streaming, the bench client) runs in this process too: when the engine's parallel regions
    take every core, each step waits for a worker the event loop has pre-empted. On the 2-core VM that made the
    default bench's decode steps 2.2x slower (11.3 vs 5.0 ms, docs/BENCHMARKS.md 5.0)."""
    if configured is not None:
        return configured
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:          # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def _device(name: str) -> str:
    if name != "auto":
        return name
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"
