"""Preemption: a slot for every decode's next token, the victim order (chosen by name), swap or recompute."""
from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from orchestrator.core.events import EventKind
from orchestrator.core.parts import SchedulerParts
from orchestrator.core.reservation import Reservation
from orchestrator.core.sequence import Sequence
from orchestrator.core.types import RequestState, StepPlan


class PriorityProgress:
    """Warm-ups and lower priorities (larger numbers) first; a fresh request before an escalated one (it already
    paid for a handover and a user is watching it stream); then the least progress (fewest generated tokens),
    then the cheapest recompute (fewest computed tokens), then the youngest."""

    name: ClassVar[str] = "priority_progress"

    @staticmethod
    def key(s: Sequence) -> tuple:
        return (not s.is_warmup, -s.request.priority, s.num_escalations > 0, s.num_generated,
                s.num_computed_tokens, -s.admit_order)


class Youngest:
    """The most recently admitted first (what a single-model server does)."""

    name: ClassVar[str] = "youngest"

    @staticmethod
    def key(s: Sequence) -> tuple:
        return (-s.admit_order,)


# scheduler.victim_order -> sort key over running requests: the smallest key is preempted first
VICTIM_ORDERS: dict[str, Callable[[Sequence], tuple]] = {o.name: o.key for o in (PriorityProgress, Youngest)}


class Preemption:
    def __init__(self, parts: SchedulerParts, reservation: Reservation, release_pins: Callable[[str], bool],
                 forget: Callable[[Sequence], None]) -> None:
        self.config, self.pool, self.kv, self.tiers = parts.config, parts.pool, parts.kv, parts.tiers
        self.running, self.waiting, self.events, self.stats = parts.running, parts.waiting, parts.events, parts.stats
        self.reservation, self.release_pins, self.forget = reservation, release_pins, forget
        self.scope = parts.scope
        self.victim_key = VICTIM_ORDERS[self.config.scheduler.victim_order]

    def ensure_decode_slots(self, plan: StepPlan, now_s: float) -> bool:
        """Every decoding request in the step's scope gets a page slot for its next token; when pages are short,
        escalation pins go first, then victims in scheduler.victim_order among the requests sharing its pages.
        Returns whether anything was preempted."""
        preempted, members = False, self.scope.members
        running = self.running
        grow = self.kv.grow
        shares_pages = self.reservation.shares_pages
        for seq in running.snapshot():
            if seq.request_id not in running or not seq.is_decoding():
                continue
            if members is not None and seq.member not in members:
                continue
            kv = seq.kv
            assert kv is not None       # a running request holds pages
            if grow(kv, len(seq.token_ids) + 1):
                continue   # next step's slot is reserved too, off the critical path; no preemption for it
            while not grow(kv, len(seq.token_ids)):
                if self.release_pins(seq.member):
                    continue   # waiting escalations' pinned pages go before any running request's
                victim = min((s for s in running if shares_pages(s, seq.member)
                              and (members is None or s.member in members)), key=self.victim_key)
                self.preempt(victim, now_s, plan)
                preempted = True
                if victim is seq:
                    break
        running.changed()               # tables grew
        return preempted

    def preempt(self, seq: Sequence, now_s: float, plan: StepPlan | None = None) -> None:
        """Pages go back (full blocks stay cached), the request waits at the queue front and resumes identically.
        Swap: when the host tier has room, its full blocks are copied there now (plan.page_saves), so its resume
        reloads them even if the arena evicts them meanwhile; recompute: they last as long as the arena keeps
        them. The last, partial block is recomputed either way."""
        kind = "recompute"
        host = self.tiers.host if self.tiers is not None else None
        if (plan is not None and seq.kv is not None and host is not None and self.config.scheduler.swap_preempted
                and not seq.is_warmup):
            keyed = [(p, k) for p in seq.kv.all_pages() if (k := self.pool.key_of(p)) is not None]
            if keyed and len(keyed) * self.config.pool.page_bytes <= host.room_bytes(keyed[0][1]):
                plan.page_saves.extend(keyed)
                kind = "swap"
        seq.drop_pages(self.kv)
        self.running.remove(seq)
        if seq.is_warmup:
            self.forget(seq)
            return
        seq.state = RequestState.PREEMPTED
        seq.count_query = False
        self.waiting.push(seq, front=True)
        self.stats.on_preemption(kind)
        self.events.emit(EventKind.PREEMPT, now_s, seq.request_id, seq.member, preemption=kind)
