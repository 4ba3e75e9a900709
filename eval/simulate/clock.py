"""Virtual time: a clock that only moves when the event loop moves it, and a deterministic event queue.

Events at the same time run in the order they were pushed (a sequence number breaks ties), so a
simulation is a pure function of its inputs.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class VirtualClock:
    """Seconds since the start of the replay. Callable, so it stands wherever the core takes a clock."""

    __slots__ = ("now_s",)

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance_to(self, time_s: float) -> None:
        if time_s < self.now_s:
            raise ValueError(f"virtual time cannot go back: {time_s} < {self.now_s}")
        self.now_s = time_s


class EventQueue:
    """A min-heap of (time, action); run() pops in time order, advancing the clock to each event."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        # (time_s, push sequence number, action): plain tuples compare in C (the sequence number is unique, so
        # the action is never compared); the heap is pushed and popped for every simulated step.
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.num_events = 0

    def push(self, time_s: float, action: Callable[[], None]) -> None:
        if time_s < self.clock.now_s:
            raise ValueError(f"event scheduled in the past: {time_s} < {self.clock.now_s}")
        heapq.heappush(self._heap, (time_s, next(self._seq), action))

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until_s: float | None = None) -> None:
        """Runs events in order until none is left (or the next is later than until_s)."""
        heap, clock, pop = self._heap, self.clock, heapq.heappop
        while heap:
            if until_s is not None and heap[0][0] > until_s:
                return
            time_s, _, action = pop(heap)
            clock.advance_to(time_s)
            self.num_events += 1
            action()
