"""The scheduler's request containers: waiting requests by priority (FCFS within one), running ones in order."""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator

from orchestrator.core.sequence import Sequence
from orchestrator.core.types import RequestId, RequestState

WARMUP_PRIORITY = 100          # warm-up prefills run only when nothing else waits


class WaitingQueue:
    """Waiting requests: one FCFS deque per priority (a smaller number is served first), and the step count
    that ages them."""

    __slots__ = ("_queues", "step")

    def __init__(self) -> None:
        self._queues: dict[int, deque[Sequence]] = {}
        self.step = 0                   # schedule() calls so far: the aging clock

    def tick(self) -> None:
        self.step += 1

    def push(self, seq: Sequence, front: bool = False) -> None:
        """Queues `seq` (a preempted request keeps its state) at its priority's back, or front (resumes first)."""
        seq.state = RequestState.WAITING if seq.state is not RequestState.PREEMPTED else seq.state
        seq.enqueued_step = self.step
        queue = self._queues.setdefault(seq.request.priority, deque())
        if front:
            queue.appendleft(seq)
        else:
            queue.append(seq)

    def __iter__(self) -> Iterator[Sequence]:
        for queue in self._queues.values():
            yield from queue

    def __bool__(self) -> bool:
        return any(self._queues.values())

    def num_waiting(self) -> int:
        """Waiting requests, warm-ups not counted."""
        return sum(len(q) for p, q in self._queues.items() if p < WARMUP_PRIORITY)

    def priorities(self) -> list[int]:
        return sorted(self._queues)

    def take(self, priority: int) -> deque[Sequence]:
        """The priority's queue, emptied here: the admission pass gives back what stays (put_back)."""
        queue = self._queues[priority]
        self._queues[priority] = deque()
        return queue

    def put_back(self, priority: int, kept: deque[Sequence]) -> None:
        self._queues[priority] = kept

    def remove(self, seq: Sequence) -> None:
        """Drops a waiting request (cancel while waiting: rare, and the queues are bounded)."""
        for queue in self._queues.values():
            if seq in queue:
                queue.remove(seq)
                return


class RunningSet:
    """Running requests in admission order, and a version that moves whenever they or their pages change:
    what the reservation caches is valid for one version only."""

    __slots__ = ("_seqs", "version")

    def __init__(self) -> None:
        self._seqs: OrderedDict[RequestId, Sequence] = OrderedDict()
        self.version = 0

    def add(self, seq: Sequence) -> None:
        self._seqs[seq.request_id] = seq
        self.version += 1

    def remove(self, seq: Sequence) -> None:
        del self._seqs[seq.request_id]
        self.version += 1

    def changed(self) -> None:
        """Running requests' tokens or pages changed in place (a step's tokens, grown tables, released pins)."""
        self.version += 1

    def get(self, request_id: RequestId) -> Sequence | None:
        return self._seqs.get(request_id)

    def __contains__(self, request_id: RequestId) -> bool:
        return request_id in self._seqs

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs.values())

    def __len__(self) -> int:
        return len(self._seqs)

    def snapshot(self) -> list[Sequence]:
        """A copy to iterate while the set changes (preemption)."""
        return list(self._seqs.values())

    def num_on(self, member: str) -> int:
        return sum(1 for s in self._seqs.values() if s.member == member)
