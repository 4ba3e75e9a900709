"""LocalServing: the whole family on one local engine, behind the ServingEngine interface of the HTTP edge.

A thin async adapter over the core's EngineCore (engine.process: thread): the core is built by EngineCore(...),
its executor by local_engine.local_executor when the engine starts; this module adds the engine thread, per-request
asyncio streams of RequestOutput (output_stream) and start/stop with a grace period.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from orchestrator.core.config import MFSConfig
from orchestrator.core.engine_core import UNHEALTHY_AFTER_FAILED_STEPS, EngineCore
from orchestrator.core.errors import EngineUnavailableError
from orchestrator.core.family import FamilySpec, load_family
from orchestrator.core.types import FinishReason, Request, RequestId, RequestOutput
from orchestrator.serve.local_engine import engine_stats, local_executor
from orchestrator.serve.output_stream import Item, StepOutputs, StreamTarget, hand_to_loops
from orchestrator.serve.tokenizer import complexity_estimator, family_tokenizer

log = logging.getLogger("mfs.serving")


class LocalServing:
    def __init__(self, config: MFSConfig, family: FamilySpec | None = None,
                 clock: Callable[[], float] = time.monotonic, **core_parts: Any):
        """core_parts: EngineCore's own keywords (scheduler_factory, tiers, ...: eval's compared systems)."""
        self.config = config
        self.family = family or load_family(config.family)
        self.family_name = self.family.name
        self.member_names = self.family.member_names
        self.tokenizer = family_tokenizer(self.family)
        self.core = EngineCore(config, self.family, clock=clock, estimator=complexity_estimator(self.tokenizer),
                               step_clock=time.perf_counter, **core_parts,
                               cpu_clock=time.thread_time)
        self._outputs: StepOutputs[StreamTarget] = StepOutputs(self._hand_over)
        self.core.on_delivered = self._outputs.flush      # one event-loop wake-up per step, not per request
        self._thread: threading.Thread | None = None
        self._running = False
        self._accepting = False
        self._ready = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._thread is not None:
            return
        if self.core.executor is None:
            self.core.attach_executor(await asyncio.to_thread(local_executor, self.config, self.family,
                                                              self.core.pool.num_pages))
        self._running = True
        self._accepting = True
        self._thread = threading.Thread(target=self.core.run, args=(self._is_running, self._log_step_error),
                                        name="mfs-engine", daemon=True)
        self._thread.start()
        self._ready = True

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
        return self._ready and self.health_problem() is None

    def health_problem(self) -> str | None:
        """Why /health must say 503 while the engine thread runs: its steps keep failing, or it has work and its
        loop has not gone round for engine.stall_timeout_s (a step that hangs)."""
        core = self.core
        if not self._ready:
            return None
        if core.failed_steps >= UNHEALTHY_AFTER_FAILED_STEPS:
            return f"{core.failed_steps} engine steps failed in a row; the last: {core.last_error}"
        timeout_s = self.config.engine.stall_timeout_s
        if core.last_tick_s is not None and core.has_work() and core.clock() - core.last_tick_s > timeout_s:
            return (f"the engine has made no progress for {core.clock() - core.last_tick_s:.0f} s with work "
                    f"waiting (engine.stall_timeout_s {timeout_s:g})")
        return None

    # ------------------------------------------------------------------ requests
    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        if not self._accepting:
            raise EngineUnavailableError("engine is not accepting requests (starting or shutting down)")
        request_id = request.request_id
        target = StreamTarget.here(request_id)
        self.core.add_request(request, self._outputs.sink(target))   # raises InvalidRequest/QueueFull
        try:
            async with aclosing(target.stream.until_finished(lambda: self.abort(request_id))) as items:
                async for item in items:   # a client gone early aborts: its pages return at the next step
                    yield item
        finally:
            self.core.detach(request_id)

    def _hand_over(self, items: list[tuple[StreamTarget, Item]]) -> None:
        for request_id in hand_to_loops(items):      # a caller's loop is gone: nobody reads those streams
            self.core.detach(request_id)

    def abort(self, request_id: RequestId, finish_reason: FinishReason | None = None) -> None:
        self.core.abort(request_id, finish_reason=finish_reason)

    def stats(self) -> dict[str, Any]:
        return engine_stats(self.core, ready=self._ready, process="thread")
