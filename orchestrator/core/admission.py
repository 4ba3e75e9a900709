"""Admission: which waiting requests join the running batch this step, and the pages each one attaches."""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import Protocol

from orchestrator.core.events import EventKind
from orchestrator.core.handover import Handover, release_pin
from orchestrator.core.parts import SchedulerParts
from orchestrator.core.request_queue import RunningSet
from orchestrator.core.reservation import Reservation
from orchestrator.core.sequence import Sequence
from orchestrator.core.speculation import Speculation
from orchestrator.core.types import RequestState, StepPlan


class RunningCap(Protocol):
    def has_room(self, seq: Sequence, running: RunningSet) -> bool: ...


class MaxRunning:
    """One batch for the family: at most scheduler.max_running_requests requests run at once."""

    def __init__(self, max_running_requests: int) -> None:
        self.max_running_requests = max_running_requests

    def has_room(self, seq: Sequence, running: RunningSet) -> bool:
        return len(running) < self.max_running_requests


class Admission:
    def __init__(self, parts: SchedulerParts, reservation: Reservation, handover: Handover,
                 forget: Callable[[Sequence], None], running_cap: RunningCap | None = None,
                 speculation: Speculation | None = None) -> None:
        self.family, self.config, self.kv, self.capacity_pages = (parts.family, parts.config, parts.kv,
                                                                  parts.capacity_pages)
        self.running, self.waiting, self.events, self.stats = parts.running, parts.waiting, parts.events, parts.stats
        self.reservation, self.handover, self.forget = reservation, handover, forget
        self.running_cap = running_cap or MaxRunning(self.config.scheduler.max_running_requests)
        self.speculation = speculation
        self.scope = parts.scope
        self._admit_counter = itertools.count()

    def admit(self, plan: StepPlan, now_s: float) -> None:
        """FCFS within a priority with per-member head-of-line blocking, except that a request waiting
        scheduler.aging_steps or longer has its pages held: later requests in its pool are admitted only beside
        them (no starvation). Requests outside the step's scope wait untouched, their aged ones still holding."""
        aging, members = self.config.scheduler.aging_steps, self.scope.members
        held: dict[frozenset[str] | None, int] = {}    # scope -> pages held for aged requests
        blocked: set[str] = set()                  # members whose head did not fit this step
        waiting, step = self.waiting, self.waiting.step
        for priority in waiting.priorities():
            queue = waiting.take(priority)
            kept: deque[Sequence] = deque()
            while queue:
                seq = queue.popleft()
                scope = self.reservation.scope_of(seq.member)
                aged = aging is not None and step - seq.enqueued_step >= aging
                if members is not None and seq.member not in members:
                    if aged:
                        held[scope] = held.get(scope, 0) + self.reservation.demand_pages(seq)
                    kept.append(seq)
                    continue
                if (not self.running_cap.has_room(seq, self.running) or seq.member in blocked
                        or not self._admit_or_free_drafts(seq, plan, now_s, held.get(scope, 0))):
                    if seq.is_warmup:
                        self.forget(seq)   # a warm-up that cannot run now is worthless later
                        continue
                    blocked.add(seq.member)
                    if aged:
                        held[scope] = held.get(scope, 0) + self.reservation.demand_pages(seq)
                    if aged and not seq.held:
                        seq.held = True
                        self.events.emit(EventKind.HOLD, now_s, seq.request_id, seq.member,
                                         waited_steps=step - seq.enqueued_step)
                    kept.append(seq)
            waiting.put_back(priority, kept)
        if not self.running and waiting:
            # Nothing runs, so nothing will free pages: escalation pins must not keep the queue stuck.
            for name in self.family.member_names:
                self.handover.release_pins(name)

    def _admit_or_free_drafts(self, seq: Sequence, plan: StepPlan, now_s: float, held_pages: int) -> bool:
        """try_admit, and once more after the running drafts in its pool are given back (pages for a waiting
        request come before a draft's, which only speeds a request up)."""
        if self.try_admit(seq, plan, now_s, held_pages):
            return True
        return (not seq.is_warmup and self.speculation is not None
                and self.speculation.release_drafts(seq.member) and self.try_admit(seq, plan, now_s, held_pages))

    def try_admit(self, seq: Sequence, plan: StepPlan, now_s: float, held_pages: int = 0) -> bool:
        if seq.is_warmup and self.running.num_on(seq.member):
            return False
        # Hashes chain per block size: extend what routing or an earlier member computed.
        seq.hashes = self.kv.block_hashes(seq.member, seq.token_ids, seq.request.cache_salt, known=seq.hashes)
        allow_shared = self.handover.rules.warm
        match = self.kv.match(seq.member, seq.hashes, len(seq.token_ids), allow_shared=allow_shared)
        if match.num_shared_blocks:
            # A handover holds a residual input page per shared block to its end: if its whole length would then
            # exceed the pool, it recomputes the lower layers instead (else it would preempt itself).
            longest = len(seq.token_ids) + max(0, seq.request.sampling.max_tokens - seq.num_generated)
            if (self.kv.pages_for_tokens(seq.member, longest) + match.num_shared_blocks
                    > self.capacity_pages[seq.member]):
                match = self.kv.match(seq.member, seq.hashes, len(seq.token_ids), allow_shared=False)
        # Alone, a request always fits (intake checked its whole length): it never waits for a reserve.
        shares_pages = self.reservation.shares_pages
        reserve_pages = 0
        if any(shares_pages(s, seq.member) for s in self.running):
            reserve_pages = self.reservation.reserve_beside_running(seq, match, held_pages)
        if not seq.held:
            reserve_pages += held_pages   # an aged request's pages are not for later arrivals
        # Warm-ups never evict: they use idle memory only.
        attached = self.kv.attach(seq.member, match, seq.hashes, len(seq.token_ids),
                                  reserve_pages=reserve_pages, evict=not seq.is_warmup)
        if attached is None:
            return False
        seq.kv, loads = attached
        plan.page_loads.extend(loads)
        if self.speculation is not None:
            self.speculation.attach(seq, reserve_pages + self.reservation.draft_decode_pages(seq), plan.page_loads)
        seq.num_computed_tokens = match.num_full_tokens
        seq.shared_until_tokens = match.num_full_tokens + match.num_shared_tokens
        seq.shared_depth = match.shared_depth
        seq.state = RequestState.RUNNING
        seq.admit_order = next(self._admit_counter)
        self.running.add(seq)
        self.reservation.admitted(seq)
        release_pin(seq, self.kv, self.running)     # the target holds what it reuses now
        seq.held = False
        if seq.num_admissions == 0 and not seq.is_warmup:
            self.stats.on_queue_wait(seq.member, now_s - seq.request.arrival_s)
        seq.num_admissions += 1
        if seq.num_cached_prompt_tokens is None:
            seq.num_cached_prompt_tokens = min(match.num_full_tokens, seq.num_prompt_tokens)
        if seq.count_query:
            tiers = {t.value: n * match.tokens_per_block for t, n in match.tier_blocks.items()}
            self.stats.on_prefix_query(seq.member, len(seq.token_ids), tiers)
            seq.count_query = False
            if seq.warmup_member == seq.member:
                # The first admission on the warmed member: a prefix hit there is the warm-up paying off.
                self.stats.on_warmup(issued=False, hit=match.num_full_blocks > 0)
                seq.warmup_member = None
        self.events.emit(EventKind.ADMIT, now_s, seq.request_id, seq.member, cached_tokens=match.num_full_tokens,
                         shared_tokens=match.num_shared_tokens, loads=len(loads))
        return True
