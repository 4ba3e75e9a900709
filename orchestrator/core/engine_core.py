"""EngineCore: the family on one StepExecutor (page pool, KV cache manager, tiers, scheduler) and its step loop.

It knows the StepExecutor protocol, never a model, and hands each RequestOutput to the sink its request
registered. Its constructor is how every runner assembles it, so the core behaves the same behind each. A step
is two halves, begin_step and finish_step: a real loop (`run`) calls them back to back, the simulator runs them as
two events in virtual time. `lock` guards the scheduler only for the pure planning and bookkeeping calls, never
while the model runs, so other threads wait at most one planning call.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.core.complexity import ComplexityEstimator
from orchestrator.core.config import ConfigError, MFSConfig
from orchestrator.core.engine_api import StepExecutor
from orchestrator.core.errors import EngineUnavailableError, InvalidRequestError, MFSError, RequestFault
from orchestrator.core.events import EventKind, EventLog, Stats
from orchestrator.core.family import FamilySpec, dtype_bytes, load_family
from orchestrator.core.kv_cache import KVCacheManager
from orchestrator.core.kv_layout import records_residuals
from orchestrator.core.page_pool import PagePool
from orchestrator.core.scheduler import Scheduler
from orchestrator.core.step_timers import StepTimers
from orchestrator.core.host_tier import HostTier
from orchestrator.core.tiers import DiskTier, TieredStore
from orchestrator.core.types import (FinishReason, Request, RequestId, RequestOutput, RouteDecision,
                                     SampledToken, StepPlan)

# A request's destination: every RequestOutput in order, or one MFSError when the engine failed the request.
# Called on the engine thread; it must not block or raise (hand the item to another thread's queue).
Sink = Callable[[RequestOutput | MFSError], None]
# Builds the scheduler from the pieces EngineCore made (Scheduler's own signature): eval's baselines pass one.
SchedulerFactory = Callable[..., Scheduler]
# Builds the executor once the arena's size is known: (family, num_pages, page_bytes) -> StepExecutor.
ExecutorFactory = Callable[[FamilySpec, int, int], StepExecutor]
# The complexity estimator routing scores prompts with, or how to make it from the family (the edge's tokenizer).
EstimatorSource = ComplexityEstimator | Callable[[FamilySpec], ComplexityEstimator]
# The host/disk tiers, or how to make them from the config and the family (None: the ones the config asks for).
TiersSource = TieredStore | Callable[[MFSConfig, FamilySpec], TieredStore | None]
# The page ledger from the config and the family (eval's static split); None: one pool every member shares.
PoolSource = Callable[[MFSConfig, FamilySpec], PagePool]
IDLE_WAIT_S = 0.05          # an idle loop re-checks this often even without a wake-up
NOT_RUNNABLE_WAIT_S = 0.01  # work exists but nothing ran (e.g. waiting for pages): do not spin
UNHEALTHY_AFTER_FAILED_STEPS = 3   # this many failed steps in a row: the server reports itself unhealthy


def with_disk_tier(config: MFSConfig, host: HostTier | None) -> TieredStore | None:
    """`host` beside the disk tier the pool config asks for (None when neither is there)."""
    pool = config.pool
    disk = None
    if pool.disk_tier_mb > 0:
        # the page geometry and KV dtype go into every file: a restart with others finds no page of the wrong shape
        disk = DiskTier(Path(pool.disk_dir), int(pool.disk_tier_mb * 2**20), page_bytes=pool.page_bytes,
                        dtype=config.engine.dtype, mac_key=_disk_key(pool.disk_key_file))
    return TieredStore(host, disk) if host is not None or disk is not None else None


def _disk_key(path: str | None) -> bytes | None:
    """pool.disk_key_file's secret (surrounding whitespace stripped), or None when unset."""
    if path is None:
        return None
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"config key 'pool.disk_key_file': cannot read {path}: {exc.strerror}") from None
    if not key:
        raise ConfigError(f"config key 'pool.disk_key_file': {path} is empty")
    return key


@dataclass(slots=True)
class Step:
    """One step between its two halves: what begin_step planned and ran, for finish_step (and the caller)."""

    plan: StepPlan
    sampled: list[SampledToken] | None = None   # None: nothing ran (the plan had no batches)
    num_outputs: int = 0                        # outputs scheduling produced (cancellations, timeouts)
    began_s: float = 0.0                        # the step clock at each phase (StepTimers)
    scheduled_s: float = 0.0
    executing_s: float = 0.0
    executed_s: float = 0.0

    @property
    def ran(self) -> bool:
        return self.sampled is not None


class EngineCore:
    """Pool, KV manager, tiers and scheduler for one family on one executor; steps them and routes outputs."""

    def __init__(self, config: MFSConfig, family: FamilySpec | None = None, *, clock: Callable[[], float],
                 estimator: EstimatorSource, make_executor: ExecutorFactory | None = None,
                 scheduler_factory: SchedulerFactory | None = None,
                 tiers: TiersSource | None = None, step_clock: Callable[[], float] | None = None,
                 cpu_clock: Callable[[], float] | None = None, pool: PoolSource | None = None,
                 warm_handover: bool = True):
        """The core for `config`, as every runner assembles it. family: None loads config.family. make_executor:
        None when the runner attaches one to `executor` before stepping (LocalServing loads the model when it
        starts). warm_handover: whether escalations may reuse the source's shared layers (residual pages are
        written only then). The other sources: see their types above; None takes MFS's own."""
        family = family if family is not None else load_family(config.family)
        if not isinstance(estimator, ComplexityEstimator):
            estimator = estimator(family)
        self.config, self.family, self.clock = config, family, clock
        self.pool = (pool(config, family) if pool is not None
                     else PagePool(config.num_arena_pages(), config.pool.member_limits, family.member_names))
        if tiers is None:       # the host/disk tiers the pool config asks for (None when both are off)
            host_mb = config.pool.host_tier_mb
            self.tiers = with_disk_tier(config, HostTier(int(host_mb * 2**20)) if host_mb > 0 else None)
        else:
            self.tiers = tiers if isinstance(tiers, TieredStore) else tiers(config, family)
        self.kv = KVCacheManager(family, self.pool, config.pool.page_bytes, dtype_bytes(config.engine.dtype),
                                 self.tiers, record_residuals=records_residuals(config, warm_handover))
        self.events = EventLog()
        self.stats_counters = Stats()
        self.scheduler = (scheduler_factory or Scheduler)(family, config, self.pool, self.kv, estimator, self.tiers,
                                                          self.events, self.stats_counters)
        self.executor: StepExecutor | None = None      # attached by make_executor, or later by the runner
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.num_steps = 0
        self.last_error: str | None = None
        # the real-time loop's liveness, read by the server's health: failed steps in a row, and when it last went round
        self.failed_steps = 0
        self.last_tick_s: float | None = None
        self._sinks: dict[RequestId, Sink] = {}
        # called once after each delivery of a step's outputs: a runner that batches its sinks' hand-overs flushes
        self.on_delivered: Callable[[], None] | None = None
        self.step_clock = step_clock                   # a fine wall clock: fills `timers` (None: not timed)
        self.cpu_clock = cpu_clock                     # the engine thread's CPU clock (execute_cpu_s)
        self.timers = StepTimers()
        if make_executor is not None:
            self.attach_executor(make_executor(family, self.pool.num_pages, config.pool.page_bytes))

    def attach_executor(self, executor: StepExecutor) -> None:
        """The executor the steps run on; its `step_costs` (an engine_api.StepCostEstimator), where it offers one,
        prices speculation's draft length (and member turns' forwards)."""
        self.executor = executor
        step_costs = getattr(executor, "step_costs", None)
        if step_costs is None:
            self.scheduler.use_step_cost(None)
        else:
            self.scheduler.use_step_cost(step_costs.estimate_step_s, step_costs.estimate_error)

    # ------------------------------------------------------------------ any thread
    def add_request(self, request: Request, sink: Sink) -> RouteDecision:
        """Queues the request; its outputs go to sink. Raises InvalidRequest/QueueFull at once (nothing queued)."""
        return self._enqueue(request.request_id, sink, lambda: self.scheduler.add_request(request, self.clock()))

    def detach(self, request_id: RequestId) -> None:
        """The caller stops listening (its outputs are dropped from now on); abort() ends the request."""
        self._sinks.pop(request_id, None)

    def _enqueue(self, request_id: RequestId, sink: Sink, add: Callable[[], Any]) -> Any:
        """add() under the lock, the request's sink claimed first (given back if add raises). A live request's id is
        refused before its sink could be replaced (its outputs would go astray)."""
        if request_id in self._sinks:
            raise InvalidRequestError(f"duplicate request id {request_id}", param="request_id")
        self._sinks[request_id] = sink
        try:
            with self.lock:
                added = add()
        except BaseException:
            self._sinks.pop(request_id, None)
            raise
        self.wake.set()
        return added

    def abort(self, request_id: RequestId, reason: str | None = None,
              finish_reason: FinishReason | None = None) -> None:
        """Ends a request at the next step and returns its pages (see Scheduler.abort)."""
        with self.lock:
            self.scheduler.abort(request_id, reason, finish_reason=finish_reason)
        self.wake.set()

    def abort_all(self, reason: str) -> None:
        with self.lock:
            for request_id in list(self._sinks):
                self.scheduler.abort(request_id, reason)
        self.wake.set()

    def has_work(self) -> bool:
        with self.lock:
            return self.scheduler.has_work()

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return self.scheduler.snapshot(self.clock())

    # ------------------------------------------------------------------ engine thread
    def run(self, is_running: Callable[[], bool], on_step_error: Callable[[Exception], None] | None = None) -> None:
        """The engine loop: steps while there is work, sleeps on `wake` otherwise, until is_running() is False.
        A failed step fails the requests it had (each sink gets an MFSError), never the loop."""
        while is_running():
            if self.has_work():
                self.step_or_fail(on_step_error)
            else:
                self.last_tick_s = self.clock()
                self.wake.wait(IDLE_WAIT_S)
                self.wake.clear()

    def step_or_fail(self, on_step_error: Callable[[Exception], None] | None = None) -> None:
        """One step of a real-time loop; if it raises (a fault no request is known to cause), every listened-to
        request fails, never the loop. Only a step that ran ends a run of failed ones. A step that could run nothing
        (e.g. waiting for pages) waits for a wake-up: no spin."""
        try:
            step = self.step()
        except Exception as exc:
            self.last_error, self.failed_steps = f"{type(exc).__name__}: {exc}", self.failed_steps + 1
            self.last_tick_s = self.clock()
            if on_step_error is not None:
                on_step_error(exc)
            message = f"engine step failed: {self.last_error}"       # the server's fault, not the requests': 503
            self.fail({request_id: EngineUnavailableError(message) for request_id in list(self._sinks)})
            return
        self.failed_steps = 0 if step.ran else self.failed_steps
        self.last_tick_s = self.clock()
        if not step.ran and step.num_outputs == 0:     # no progress: wait for a wake-up instead of spinning
            self.wake.wait(NOT_RUNNABLE_WAIT_S)
            self.wake.clear()

    def step(self) -> Step:
        """One whole step: both halves back to back."""
        step = self.begin_step()
        if step.ran:
            self.finish_step(step)
        return step

    def begin_step(self) -> Step:
        """The step's first half: schedule, deliver what scheduling produced, tier copies, execute. When the plan
        has no batch nothing runs (step.ran is False) and the requests it released are released here."""
        tick, cpu = self.step_clock or float, self.cpu_clock or float     # float() is 0.0: not timed
        began = tick()
        with self.lock:
            plan, outputs = self.scheduler.schedule(self.clock())
        scheduled = tick()
        self.deliver(outputs)
        plan = self.copy_tiers(plan)
        step = Step(plan, num_outputs=len(outputs), began_s=began, scheduled_s=scheduled)
        if not plan.batches:
            if plan.released_requests:   # execute() releases them itself when it runs
                self.executor.release(plan.released_requests)
            return step
        step.executing_s, cpu_began = tick(), cpu()
        try:
            step.sampled = self.executor.execute(plan)
        except RequestFault as fault:       # some requests' own work failed: they fail alone, the others go on
            step.sampled = fault.sampled
            self.fail(fault.errors)
        step.executed_s = tick()
        self.timers.execute_cpu_s += cpu() - cpu_began
        self.num_steps += 1
        return step

    def finish_step(self, step: Step) -> None:
        """The step's second half: the sampled tokens into their requests (update), and their outputs delivered."""
        assert step.sampled is not None, "finish_step of a step that ran nothing"
        tick = self.step_clock or float
        with self.lock:
            outputs = self.scheduler.update(step.plan, step.sampled, self.clock())
        updated = tick()
        self.deliver(outputs)
        if self.step_clock is not None:
            self.timers.record(step.began_s, step.scheduled_s, step.executing_s, step.executed_s, updated, tick())
            self.timers.computed_tokens += sum(len(c.token_ids) for b in step.plan.batches for c in b.chunks)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            sink = self._sinks.pop(output.request_id, None) if output.finished else self._sinks.get(output.request_id)
            if sink is not None:
                sink(output)
        if outputs and self.on_delivered is not None:
            self.on_delivered()

    def fail(self, errors: dict[RequestId, MFSError]) -> None:
        """Aborts these requests (pages return at the next step) and tells each sink its error."""
        with self.lock:
            for request_id, error in errors.items():
                self.scheduler.abort(request_id, error.message)
        for request_id, error in errors.items():
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink(error)
        self.wake.set()
        if self.on_delivered is not None:
            self.on_delivered()

    def copy_tiers(self, plan: StepPlan) -> StepPlan:
        """Saves evicted pages to the host/disk tiers, then loads tier hits into their fresh pages (in that order: a
        page can be evicted and reloaded in one step), before the step overwrites them. A load that fails (missing,
        or a disk block that failed its checksum) is dropped and its requests recompute."""
        if self.tiers is None:
            return plan
        now = self.clock()
        stored = [tier for page, key in plan.page_saves
                  if (tier := self.tiers.put(key, self.executor.read_page(page))) is not None]
        failed = []
        for page, key, _tier in plan.page_loads:
            found = self.tiers.get(key)
            if found is None:
                failed.append(page)
            else:
                self.executor.write_page(page, found[0])
        for tier in stored:
            self.stats_counters.on_offload(tier.value, 1)
        if plan.page_saves:
            self.events.emit(EventKind.OFFLOAD, now, None, None, num_pages=len(plan.page_saves))
        if plan.page_loads:
            self.events.emit(EventKind.LOAD, now, None, None, num_pages=len(plan.page_loads) - len(failed))
        if failed:
            with self.lock:
                plan = self.scheduler.drop_failed_loads(plan, failed, now)
        return plan


def drain(core: EngineCore, max_steps: int, step: Callable[[], object] | None = None) -> int:
    """Steps `core` until it has no work; returns the steps taken. Raises RuntimeError when work remains after
    max_steps. step: what one step is (default core.step; a test harness moves its clock around it)."""
    one_step = step or core.step
    for taken in range(max_steps):
        if not core.has_work():
            return taken
        one_step()
    if core.has_work():
        raise RuntimeError(f"work remains after {max_steps} steps")
    return max_steps
