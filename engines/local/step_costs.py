"""MeasuredStepCosts: the local engine's estimate of what a step would cost, fitted on its own measured steps.

Speculation's draft length weighs a step's time against the tokens its drafts should give
(orchestrator/core/speculation.py, DraftLength), so it needs the price of steps it has not run: the same batch
with k drafts. The simulator reads a cost model; the local engine has none for the machine it happens to run on,
so it learns one: a step's seconds as a linear function of its forwards' shapes (orchestrator.core.types
ForwardShape, the shapes speculation prices), fitted on the steps it runs: a ridge regression over the last WINDOW
steps, solved again every REFIT steps, so that it follows the machine as it warms up, throttles or shares its
cores. Its error (the fit's residual, relative to the mean step) is the margin a draft length must beat: a CPU's
steps vary from one to the next, and a saving smaller than that variation is not one the fit can see.

Features, per member: forwards, rows (decodes, verify rows, prefill tokens), rows x context (in thousands of
tokens: the attention's reads); a draft forward counts apart (a draft runs as a forward of its own, where the
step's member batches may share one merged forward in a nested family); and one per step. Before MIN_STEPS steps
there is no estimate (None): the core then drafts nothing, rather than guessing. A drafting member's own batch that
rode in its drafts' catch-up forward (engines/local/executor.py) is one forward, not two: the fit reads the forwards
the engine ran (`ride`), and prices a step the way the engine would run it (`riders_of`). A shape the window has not
seen (drafts, before any step drafted) is priced at nothing extra by the ridge, so the core tries it, and the
steps that follow price it; once the window has forgotten it, it is tried again.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np

from orchestrator.core.types import ForwardShape

MIN_STEPS = 32          # steps measured before the fit gives an estimate
WINDOW = 256            # the steps the fit reads (the latest)
REFIT = 16              # steps between two solves
RIDGE = 1e-6            # the penalty on every coefficient but the step's own: keeps unseen shapes at 0


def ride(forwards: Sequence[ForwardShape], riders: Collection[str]) -> list[ForwardShape]:
    """The forwards as run when each member in `riders` had its own batch ride in its first draft forward."""
    if not riders:
        return list(forwards)
    own = {f.member: f for f in forwards if not f.is_draft and f.member in riders}
    out: list[ForwardShape] = []
    rode: set[str] = set()
    for f in forwards:
        rider = own.get(f.member) if f.is_draft and f.member not in rode else None
        if rider is not None:
            f = ForwardShape(f.member, f.decode_contexts + rider.decode_contexts, f.verifies + rider.verifies,
                             f.prefills + rider.prefills, True)
            rode.add(f.member)
        out.append(f)
    return [f for f in out if f.is_draft or f.member not in rode]


class MeasuredStepCosts:
    PER_MEMBER = 5      # forwards, rows, rows x context, draft forwards, draft rows

    def __init__(self, member_names: Sequence[str],
                 riders_of: Callable[[Sequence[ForwardShape]], Collection[str]] | None = None) -> None:
        """riders_of: the members whose own batch would ride in their drafts' forward in a step of these forwards."""
        self.riders_of = riders_of
        self._index = {name: i for i, name in enumerate(member_names)}
        self._size = 1 + self.PER_MEMBER * len(member_names)
        self._x = np.zeros((WINDOW, self._size))
        self._y = np.zeros(WINDOW)
        self._theta = np.zeros(self._size)
        self._error = 0.0
        self.num_steps = 0

    def features(self, forwards: Sequence[ForwardShape]) -> np.ndarray:
        x = np.zeros(self._size)
        x[0] = 1.0
        for forward in forwards:
            base = 1 + self.PER_MEMBER * self._index[forward.member]
            rows = len(forward.decode_contexts) + sum(r for r, _ in forward.verifies) + sum(n for n, _ in forward.prefills)
            if forward.is_draft:
                x[base + 3] += 1.0
                x[base + 4] += rows
                continue
            reads = (sum(forward.decode_contexts) + sum(r * (b + r) for r, b in forward.verifies)
                     + sum(n * (b + n) for n, b in forward.prefills))
            x[base] += 1.0
            x[base + 1] += rows
            x[base + 2] += reads / 1024.0
        return x

    def observe(self, forwards: Sequence[ForwardShape], seconds: float) -> None:
        """One measured step; every REFIT steps the fit is solved again over the window."""
        slot = self.num_steps % WINDOW
        self._x[slot] = self.features(forwards)
        self._y[slot] = seconds
        self.num_steps += 1
        if self.num_steps >= MIN_STEPS and self.num_steps % REFIT == 0:
            self._solve()

    def _solve(self) -> None:
        n = min(self.num_steps, WINDOW)
        x, y = self._x[:n], self._y[:n]
        penalty = np.full(self._size, RIDGE)
        penalty[0] = 0.0
        self._theta = np.linalg.solve(x.T @ x + np.diag(penalty), x.T @ y)
        mean = float(y.mean())
        self._error = float(np.sqrt(np.mean((x @ self._theta - y) ** 2))) / mean if mean > 0 else 0.0

    def estimate_step_s(self, forwards: Sequence[ForwardShape]) -> float | None:
        """The fitted seconds of a step of these forwards (never below 0); None before MIN_STEPS steps."""
        if self.num_steps < MIN_STEPS:
            return None
        if self.riders_of is not None:
            forwards = ride(forwards, self.riders_of(forwards))
        return max(float(self.features(forwards) @ self._theta), 0.0)

    def estimate_error(self) -> float:
        """The fit's root-mean-square residual over its window, relative to the window's mean step (0 before the
        first fit)."""
        return self._error
