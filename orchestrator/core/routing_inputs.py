"""What the router scores, gathered from the scheduler's state in one place: each serving member's matched prefix
(affinity), the session's last member, and each member's load (with reservation.py's expected delay and pool
pressure, priced by the member's measured step cost). `route` hands them to Router.route, then applies the
session's home and the placement. Pure: the clock is passed in.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from orchestrator.core.escalation import EscalationRates
from orchestrator.core.family import FamilySpec
from orchestrator.core.kv_cache import KVCacheManager
from orchestrator.core.placement import Placement
from orchestrator.core.request_queue import RunningSet, WaitingQueue
from orchestrator.core.reservation import Reservation
from orchestrator.core.router import MemberLoad, Router, SessionAffinity, SessionHomes
from orchestrator.core.types import Request, RouteDecision


class RoutingInputs:
    def __init__(self, family: FamilySpec, kv: KVCacheManager, running: RunningSet, waiting: WaitingQueue,
                 reservation: Reservation, sessions: SessionAffinity, rates: EscalationRates, router: Router,
                 homes: SessionHomes | None, placement: Placement) -> None:
        self.family, self.kv, self.running, self.waiting = family, kv, running, waiting
        self.reservation, self.sessions, self.rates = reservation, sessions, rates
        self.router, self.homes, self.placement = router, homes, placement
        # member -> EMA of the time between busy schedule() calls that planned it (what one step costs a waiting
        # request; members on devices of their own step at their own pace), and the time of its last busy one
        self.step_cost_s: dict[str, float] = {}
        self._last_busy_s: dict[str, float] = {}

    def observe_schedule(self, planned: Iterable[str], now_s: float, busy: bool) -> None:
        """A schedule() call at now_s planned these members; busy: its plan has batches."""
        for name in planned:
            last = self._last_busy_s.get(name)
            if last is not None:
                cost = self.step_cost_s.get(name)
                self.step_cost_s[name] = now_s - last if cost is None else 0.8 * cost + 0.2 * (now_s - last)
            if busy:
                self._last_busy_s[name] = now_s
            else:
                self._last_busy_s.pop(name, None)

    def matched_prefix_tokens(self, request: Request, by_block_size: dict[int, list[bytes]]) -> dict[str, int]:
        """Per serving member, the prompt tokens its cache holds; fills by_block_size with the prompt's hashes."""
        matched: dict[str, int] = {}
        if self.router.use_affinity and request.pinned_member is None:
            for name in self.family.serving_names:
                size = self.kv.tokens_per_block(name)
                if size not in by_block_size:
                    by_block_size[size] = self.kv.block_hashes(name, request.prompt_token_ids, request.cache_salt)
                matched[name] = self.kv.estimate_cached_tokens(name, by_block_size[size])
        return matched

    def loads(self, request: Request | None = None) -> dict[str, MemberLoad]:
        """Each member's load; with `request`, also its expected wait there and its pool's pressure."""
        running = {n: [0, 0] for n in self.family.member_names}
        waiting = {n: [0, 0] for n in self.family.member_names}
        for seq in self.running:
            running[seq.member][0] += 1
            running[seq.member][1] += len(seq.token_ids)
        for seq in self.waiting:
            waiting[seq.member][0] += 1
            waiting[seq.member][1] += len(seq.token_ids)
        extra: dict[str, dict[str, float]] = {n: {} for n in running}
        if request is not None:
            for name in running:
                extra[name] = self.reservation.delay_and_pressure(name, request, self.step_cost_s.get(name))
        return {n: MemberLoad(running[n][0], waiting[n][0], running[n][1], waiting[n][1],
                              escalation_rate=self.rates.rate(n), **extra[n]) for n in running}

    def route(self, request: Request, complexity: float,
              by_block_size: dict[int, list[bytes]] | None = None) -> RouteDecision:
        """Routes, then places; fills by_block_size with the prompt's block hashes so admission can reuse them."""
        matched = self.matched_prefix_tokens(request, {} if by_block_size is None else by_block_size)
        session_member = self.sessions.get(request.session_id) if request.session_id else None
        decision = self.router.route(request, complexity=complexity, matched_prefix_tokens=matched,
                                     loads=self.loads(request), session_member=session_member)
        if self.homes is None:
            return self._settled(self.placement.place(decision, request))
        decision = self.placement.place(self.homes.keep(decision, request, self.placement.holds), request)
        self.homes.remember(request, decision.member)
        return self._settled(decision)

    def _settled(self, decision: RouteDecision) -> RouteDecision:
        """No downgrade where the home or the placement moved the request back up to at least the member it was
        downgraded from: the counters count only requests that run below the member routing chose."""
        down = decision.downgraded_from
        names = self.family.member_names
        if down is None or names.index(decision.member) < names.index(down):
            return decision
        return dataclasses.replace(decision, downgraded_from=None)
