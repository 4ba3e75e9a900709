"""A real engine's step times: execute() wrapped with a timer. The step profile of a bench replay
(eval/validate/step_profile.py), the measured cost model's serving-loop gap (eval/simulate/measure.py) and the
validation's (eval/validate/bench_vs_sim.py) all time steps this one way."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepTiming:
    seconds: float
    seqs_by_member: dict[str, int]     # member -> chunks (requests) in the step
    tokens: int                        # tokens computed in the step (prefill chunks count every token)
    start_s: float = 0.0               # perf_counter at the start of execute()

    @property
    def is_decode_only(self) -> bool:
        return self.tokens == sum(self.seqs_by_member.values())


def timed(execute, timings: list[StepTiming]):
    """execute() wrapped so that every call appends its StepTiming."""
    def run(plan):
        started = time.perf_counter()
        sampled = execute(plan)
        batches = [b for b in plan.batches if b.chunks]
        timings.append(StepTiming(time.perf_counter() - started, {b.member: len(b.chunks) for b in batches},
                                  sum(len(c.token_ids) for b in batches for c in b.chunks), started))
        return sampled
    return run


# Two steps closer than this ran back to back (the engine had work): the gap between them is what the
# serving loop costs per step outside execute() (scheduling, tier copies, streaming, the GIL).
BACK_TO_BACK_S = 0.02
