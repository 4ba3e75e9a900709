"""StepTimers: the engine loop's cumulative wall time per phase of a step (what /v1/stats reports)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class StepTimers:
    """Cumulative wall time of the loop's phases over the steps that ran a model, from the step clock the runner
    passes in (the serving bench reads deltas of these through /v1/stats)."""

    steps: int = 0
    schedule_s: float = 0.0          # scheduler.schedule under the lock
    prepare_s: float = 0.0           # delivering schedule's outputs, tier copies
    execute_s: float = 0.0           # the model: executor.execute
    update_s: float = 0.0            # scheduler.update under the lock
    deliver_s: float = 0.0           # handing the step's outputs to the sinks
    between_steps_s: float = 0.0     # end of one execute to the start of the next: all that is not the model
    execute_cpu_s: float = 0.0       # CPU time of the engine thread in execute (wall minus waiting for a core)
    computed_tokens: int = 0         # tokens the model computed (prefill chunks count every token)
    last_executed_s: float | None = None

    def record(self, began: float, scheduled: float, executing: float, executed: float, updated: float,
               delivered: float) -> None:
        self.steps += 1
        self.schedule_s += scheduled - began
        self.prepare_s += executing - scheduled
        self.execute_s += executed - executing
        self.update_s += updated - executed
        self.deliver_s += delivered - updated
        if self.last_executed_s is not None and executing - self.last_executed_s < 1.0:   # not across idle time
            self.between_steps_s += executing - self.last_executed_s
        self.last_executed_s = executed

    def to_dict(self) -> dict[str, float]:
        """Every counter (what /v1/stats reports as engine.timers)."""
        return {name: value for name, value in asdict(self).items() if name != "last_executed_s"}
