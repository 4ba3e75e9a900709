"""One serving node in virtual time: the core exactly as LocalServing assembles it (pool, KV cache manager,
tiers, scheduler, router, escalation), with the SimExecutor in the engine's place.

LocalServing's engine thread runs schedule -> tier copies -> execute -> update back to back; here the same
calls run as two events: at the step's start schedule, the tier copies (LocalServing's own _copy_tiers) and
execute (which says how long the step takes); at its end update, whose outputs go to the driver. Requests that
arrive meanwhile are added to the scheduler at their arrival time, as the real loop adds them between steps.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eval.simulate.clock import EventQueue, VirtualClock
from eval.simulate.executor import SimExecutor
from orchestrator.core.config import MFSConfig
from orchestrator.core.family import FamilySpec
from orchestrator.core.types import Request, RequestOutput, StepPlan

# Nothing runnable although work is queued (e.g. the only waiting request needs pages a finishing one still
# holds): the real loop waits 10 ms for a wake-up; so does the simulated one.
IDLE_RETRY_S = 0.01


class SimNode:
    def __init__(self, name: str, config: MFSConfig, family: FamilySpec | None, clock: VirtualClock,
                 events: EventQueue, make_executor: Callable[[FamilySpec, int, int], SimExecutor],
                 on_output: Callable[[RequestOutput, float], None], scheduler_factory=None) -> None:
        from orchestrator.serve.serving import LocalServing

        self.name = name
        self.clock = clock
        self.events = events
        self.on_output = on_output
        # LocalServing builds the core (and loads the family as the bench does when none is given); it is never
        # started: no thread, no asyncio. Its executor is set once the pool size is known.
        self.serving = LocalServing(config, family=family, clock=clock, scheduler_factory=scheduler_factory)
        self.family = self.serving.family
        self.scheduler = self.serving.scheduler
        self.executor = make_executor(self.family, self.serving.pool.num_pages, config.pool.page_bytes)
        self.executor.attach_clock(clock)       # it sees the idle gaps between its steps
        self.scheduler.speculation.use_step_cost(self.executor.estimate_step_s)   # the draft length's prices
        self.serving._executor = self.executor
        self.busy = False
        self.num_in_flight = 0          # requests submitted and not finished (the front router's load)

    # ------------------------------------------------------------------ requests
    def submit(self, request: Request) -> None:
        """Adds the request now (raises the scheduler's InvalidRequestError / QueueFullError at once)."""
        self.scheduler.add_request(request, self.clock())
        self.num_in_flight += 1
        self._wake()

    def _wake(self) -> None:
        if not self.busy:
            self.busy = True
            self.events.push(self.clock(), self._start_step)

    # ------------------------------------------------------------------ steps
    def _start_step(self) -> None:
        now = self.clock()
        plan, outputs = self.scheduler.schedule(now)
        self._deliver(outputs, now)
        plan = self.serving._copy_tiers(plan)
        if not plan.batches:
            if plan.released_requests:
                self.executor.release(plan.released_requests)
            if self.scheduler.has_work():
                self.events.push(now + IDLE_RETRY_S, self._start_step)
            else:
                self.busy = False
            return
        sampled = self.executor.execute(plan)
        self.events.push(now + self.executor.last_step_s, lambda: self._finish_step(plan, sampled))

    def _finish_step(self, plan: StepPlan, sampled: list) -> None:
        now = self.clock()
        outputs = self.scheduler.update(plan, sampled, now)
        self.serving.num_steps += 1
        self._deliver(outputs, now)
        if self.scheduler.has_work():
            self._start_step()
        else:
            self.busy = False

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            if out.finished:
                self.num_in_flight -= 1
            self.on_output(out, now)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        return self.scheduler.snapshot(self.clock())
