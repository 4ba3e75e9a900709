"""One serving node in virtual time: the core exactly as every runner assembles it (EngineCore.build: pool, KV
cache manager, tiers, scheduler, router, escalation), with the SimExecutor in the engine's place.

The real loop runs a step's two halves back to back (EngineCore.step); here they run as two events: at the
step's start begin_step (schedule, tier copies, execute, which says how long the step takes), at its end
finish_step (update), whose outputs go to the driver. Requests that arrive meanwhile are added at their arrival
time, as the real loop adds them between steps.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eval.simulate.clock import EventQueue, VirtualClock
from eval.simulate.executor import SimExecutor
from orchestrator.core.config import MFSConfig
from orchestrator.core.engine_core import EngineCore, Step
from orchestrator.core.errors import MFSError
from orchestrator.core.family import FamilySpec
from orchestrator.core.types import Request, RequestOutput

# Nothing runnable although work is queued (e.g. the only waiting request needs pages a finishing one still
# holds): the real loop waits 10 ms for a wake-up; so does the simulated one.
IDLE_RETRY_S = 0.01


class SimNode:
    def __init__(self, name: str, config: MFSConfig, family: FamilySpec | None, clock: VirtualClock,
                 events: EventQueue, make_executor: Callable[[FamilySpec, int, int], SimExecutor],
                 on_output: Callable[[RequestOutput, float], None], scheduler_factory=None) -> None:
        from orchestrator.serve.tokenizer import family_estimator

        self.name = name
        self.clock = clock
        self.events = events
        self.on_output = on_output
        # The family is loaded as the bench loads it when none is given; routing scores prompts with the
        # tokenizer's estimator, as serving does. No thread, no asyncio: this node steps the core itself.
        self.core = EngineCore.build(config, family, clock=clock, estimator=family_estimator,
                                     make_executor=make_executor, scheduler_factory=scheduler_factory)
        self.family = self.core.family
        self.scheduler = self.core.scheduler
        executor = self.core.executor
        assert isinstance(executor, SimExecutor)
        self.executor = executor
        self.executor.attach_clock(clock)       # it sees the idle gaps between its steps
        self.busy = False
        self.num_in_flight = 0          # requests submitted and not finished (the front router's load)

    # ------------------------------------------------------------------ requests
    def submit(self, request: Request) -> None:
        """Adds the request now (raises the scheduler's InvalidRequestError / QueueFullError at once)."""
        self.core.add_request(request, self._deliver)
        self.num_in_flight += 1
        self._wake()

    def _wake(self) -> None:
        if not self.busy:
            self.busy = True
            self.events.push(self.clock(), self._start_step)

    # ------------------------------------------------------------------ steps
    def _start_step(self) -> None:
        now = self.clock()
        step = self.core.begin_step()
        if not step.ran:
            if self.scheduler.has_work():
                self.events.push(now + IDLE_RETRY_S, self._start_step)
            else:
                self.busy = False
            return
        self.events.push(now + self.executor.last_step_s, lambda: self._finish_step(step))

    def _finish_step(self, step: Step) -> None:
        self.core.finish_step(step)
        if self.scheduler.has_work():
            self._start_step()
        else:
            self.busy = False

    def _deliver(self, out: RequestOutput | MFSError) -> None:
        """Every request's sink: the driver gets each output at the node's time (a step never fails here: an
        error raises out of the event loop instead)."""
        assert isinstance(out, RequestOutput)
        if out.finished:
            self.num_in_flight -= 1
        self.on_output(out, self.clock())

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        return self.scheduler.snapshot(self.clock())
