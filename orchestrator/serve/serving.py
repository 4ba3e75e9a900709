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
from orchestrator.core.deployments import DeploymentsScheduler
from orchestrator.core.scheduler import Scheduler
from orchestrator.core.tiers import DiskTier, HostTier, TieredStore
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
        scheduler_class = DeploymentsScheduler if config.scheduler.independent_deployments else Scheduler
        self.scheduler = scheduler_class(self.family, config, self.pool, self.kv, build_estimator(self.tokenizer),
                                         self.tiers, self.events, self.stats_counters)
        self._executor = executor
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[RequestId, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._running = False
        self._accepting = False
        self._ready = False
        self._last_error: str | None = None
        self.num_steps = 0

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
            for request_id in list(self._streams):
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
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = (asyncio.get_running_loop(), queue)
        try:
            with self._lock:
                self.scheduler.add_request(request, self.clock())   # raises InvalidRequest/QueueFull at once
        except BaseException:
            self._streams.pop(request.request_id, None)
            raise
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self.abort(request.request_id)   # client went away: pages return at the next step

    def abort(self, request_id: RequestId, finish_reason: FinishReason | None = None) -> None:
        with self._lock:
            self.scheduler.abort(request_id, finish_reason=finish_reason)
        self._wake.set()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            snapshot = self.scheduler.snapshot(self.clock())
        snapshot["engine"] = {"kind": "local", "steps": self.num_steps, "last_error": self._last_error,
                              "ready": self._ready}
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
        with self._lock:
            plan, outputs = self.scheduler.schedule(self.clock())
        self._deliver(outputs)
        plan = self._copy_tiers(plan)
        if not plan.batches:
            if plan.released_requests:   # execute() releases them itself when it runs
                self._executor.release(plan.released_requests)
            if not outputs:
                self._wake.wait(0.01)   # nothing runnable yet (e.g. waiting for pages): do not spin
                self._wake.clear()
            return
        sampled = self._executor.execute(plan)
        self.num_steps += 1
        with self._lock:
            outputs = self.scheduler.update(plan, sampled, self.clock())
        self._deliver(outputs)

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
        with self._lock:
            for request_id in list(self._streams):
                self.scheduler.abort(request_id, message)
        for request_id in list(self._streams):
            self._push(request_id, MFSError(message))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._push(output.request_id, output)

    def _push(self, request_id: RequestId, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:
            self._streams.pop(request_id, None)   # the caller's loop is gone


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
