"""Independent deployments (the benchmark's baseline): each member runs as its own server on a fixed slice
of the pages, the way an operator runs one vLLM per model on a shared device.

What differs from the shared scheduler (scheduler.independent_deployments, with pool.static_split):
- Nothing is refused that some member's slice can hold: a request whose routed member's slice cannot hold
  it goes to the smallest larger member that can (else the largest smaller one), as a load balancer that
  knows each deployment's limits would send it; the RouteDecision says `reroute:...` and it is counted.
- An escalation whose target slice cannot hold the request is not made (that server would refuse it).
- Each deployment has its own batch cap (scheduler.max_running_requests) and its own step token budget
  (scheduler.max_batch_tokens).
- The deployments take turns on the device: one step runs one deployment's batch, round robin over the
  deployments with work (separate processes time-slice one accelerator; none sees the others' batches).
Pure core: no torch, no I/O.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

from orchestrator.core.errors import InvalidRequestError
from orchestrator.core.scheduler import Scheduler
from orchestrator.core.escalation import escalation_target
from orchestrator.core.sequence import Sequence
from orchestrator.core.types import MemberName, Request, RouteDecision, StepPlan

REROUTE_REASON = "reroute"      # RouteDecision.reason prefix (eval/metrics_calc.py counts it)


class DeploymentsScheduler(Scheduler):
    def __init__(self, family, config, pool, kv, estimator, tiers=None, events=None, stats=None):
        if config.pool.static_split is None:
            raise ValueError("independent deployments need pool.static_split (each deployment's slice)")
        self._member_cap = config.scheduler.max_running_requests
        # The shared scheduler's global cap must never bind before the per-deployment caps do.
        total_cap = self._member_cap * len(family.members)
        config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler,
                                                                           max_running_requests=total_cap))
        super().__init__(family, config, pool, kv, estimator, tiers, events, stats)
        self._turn = -1                 # index of the deployment that ran the last step
        self.num_reroutes = 0
        self.num_escalations_skipped = 0

    # ------------------------------------------------------------------ what fits where
    def _needed_tokens(self, request: Request) -> int:
        return len(request.prompt_token_ids) + request.sampling.max_tokens

    def holds(self, member: str, request: Request) -> bool:
        """The member's slice can hold the request whole and its context the prompt."""
        spec = self.family.member(member)
        return (len(request.prompt_token_ids) < spec.context_tokens
                and self.kv.pages_for_tokens(member, self._needed_tokens(request)) <= self._capacity_pages[member])

    def placement(self, routed: str, request: Request) -> str | None:
        """The routed member if it holds the request, else the smallest larger member that does, else the
        largest smaller one; None when no deployment can."""
        names = list(self.family.member_names)
        index = names.index(routed)
        for name in [*names[index:], *reversed(names[:index])]:
            if self.holds(name, request):
                return name
        return None

    def _check_fits(self, request: Request) -> None:
        if request.pinned_member is not None:
            super()._check_fits(request)
            return
        if not any(self.holds(name, request) for name in self.family.member_names):
            needed = self._needed_tokens(request)
            sizes = ", ".join(f"{n} {self.kv.pages_for_tokens(n, needed)}/{self._capacity_pages[n]}"
                              for n in self.family.member_names)
            raise InvalidRequestError(f"no deployment can hold the request ({needed} tokens; pages needed/slice: "
                                      f"{sizes})", param="max_tokens")

    def _route(self, request: Request, complexity: float, now_s: float,
               by_block_size: dict[int, list[bytes]] | None = None) -> RouteDecision:
        decision = super()._route(request, complexity, now_s, by_block_size)
        if request.pinned_member is not None:
            return decision
        member = self.placement(decision.member, request)
        if member is None or member == decision.member:
            return decision
        self.num_reroutes += 1
        return dataclasses.replace(decision, member=MemberName(member),
                                   reason=f"{REROUTE_REASON}:{decision.member}->{member} (slice too small); "
                                          f"{decision.reason}")

    def _escalate(self, seq: Sequence, now_s: float) -> None:
        target = escalation_target(self.family, seq.member, pinned=seq.request.pinned_member is not None)
        if target is not None and not self.holds(target, seq.request):
            seq.monitor = None          # that deployment would refuse it: stay, and stop watching
            self.num_escalations_skipped += 1
            return
        super()._escalate(seq, now_s)

    # ------------------------------------------------------------------ per-deployment caps and turns
    def _try_admit(self, seq: Sequence, plan: StepPlan, now_s: float, held_pages: int = 0) -> bool:
        running_here = sum(1 for s in self._running.values() if s.member == seq.member)
        if running_here >= self._member_cap:
            return False
        return super()._try_admit(seq, plan, now_s, held_pages)

    def _build_batches(self, plan: StepPlan) -> None:
        """One deployment per step (the next with running requests after the last one served), with its
        own token budget; the others' requests keep their pages and wait for their turn."""
        names = list(self.family.member_names)
        busy = {s.member for s in self._running.values()}
        if not busy:
            plan.batches = []
            return
        for offset in range(1, len(names) + 1):
            index = (self._turn + offset) % len(names)
            if names[index] in busy:
                self._turn = index
                break
        chosen = names[self._turn]
        # The base batch builder sees the chosen deployment only, in admission order (the running dict's own
        # order), through a filtered copy: the running dict itself is never reordered.
        running = self._running
        self._running = OrderedDict((rid, s) for rid, s in running.items() if s.member == chosen)
        try:
            super()._build_batches(plan)
        finally:
            self._running = running
