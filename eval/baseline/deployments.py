"""Separate deployments of the family's members: each member its own server, taking turns on a shared device.

The baselines (eval/systems.py) run the core's own Scheduler with these policy objects in place of MFS's
(Deployments is all three), so every generic scheduler policy is the same as MFS's by construction:
- placement: nothing is refused that some member's slice can hold: a request whose routed member's slice cannot
  hold it goes to the smallest larger member that can (else the largest smaller one), as a load balancer that
  knows each deployment's limits would send it; the RouteDecision says so (rerouted_from) and it is counted.
  An escalation whose target slice cannot hold the request is not made (that server would refuse it).
- running cap: each deployment has its own batch cap (scheduler.max_running_requests).
- step members: the deployments take turns on the device: one step runs one deployment's batch, with its own
  step token budget, round robin over the deployments with work (separate processes time-slice one
  accelerator; none sees the others' batches). Each on devices of its own (the simulator's per-member
  placement), each steps on its own timeline: the node asks for a plan per free device.
- sessions: kept on the member that served their first turn while its slice holds them (the core's
  router.sticky_sessions, set by eval/systems.py: a front balancer's session affinity), or per turn (the
  baseline_per_turn variant and baseline_legacy route every turn on its complexity alone).
- memory: a static slice per deployment (comparison.static_split), or one pool every deployment draws pages
  from as it needs them (elastic: KV memory mapped on demand, as kvcached gives co-located engines). With one
  pool the core's admission sees every deployment's reserved decode demand: more coordination than separate
  engines on elastic memory have, so that baseline is, if anything, favoured.
The rest (no KV shared across members, cold handovers, routing blind to other members' caches and load, each
server drafting with its own draft copy when it speculates: baseline_spec, baseline_elastic_spec) is
configuration: eval/systems.py DEPLOYMENTS.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from functools import partial

from eval.composition import scheduler_policies
from orchestrator.core.complexity import ComplexityEstimator
from orchestrator.core.config import MFSConfig
from orchestrator.core.errors import InvalidRequestError
from orchestrator.core.escalation import escalation_target
from orchestrator.core.events import EventLog, Stats
from orchestrator.core.family import FamilySpec
from orchestrator.core.kv_cache import KVCacheManager
from orchestrator.core.page_pool import PagePool
from orchestrator.core.placement import check_fits, misfit
from orchestrator.core.request_queue import RunningSet
from orchestrator.core.scheduler import Scheduler
from orchestrator.core.sequence import Sequence
from orchestrator.core.tiers import TieredStore
from orchestrator.core.types import MemberName, Request, RouteDecision


class Deployments:
    """Placement, running cap and step members of separate per-member servers (on one device or one each)."""

    def __init__(self, family: FamilySpec, config: MFSConfig, pool: PagePool, kv: KVCacheManager,
                 elastic: bool = False) -> None:
        if (pool.members_sharing(family.serving_names[0]) is None) != elastic:
            raise ValueError("separate deployments need a static split of the pool (each deployment's slice), "
                             "and elastic ones none (one pool)")
        self.family = family
        self.kv = kv
        self.names = family.serving_names       # one deployment per member requests go to
        self.capacity_pages: dict[str, int] = {m: pool.num_available_pages_total(m) for m in self.names}
        self.member_cap = config.scheduler.max_running_requests
        self._turn = -1                 # index of the deployment that ran the last step
        self.num_reroutes = 0
        self.num_escalations_skipped = 0

    # ------------------------------------------------------------------ placement
    def holds(self, member: str, request: Request) -> bool:
        """The member's slice can hold the request whole and its context the prompt."""
        return misfit(self.family, self.kv, self.capacity_pages, member, request) is None

    def placement(self, routed: str, request: Request) -> str | None:
        """The routed member if it holds the request, else the smallest larger member that does, else the
        largest smaller one; None when no deployment can."""
        names = self.names
        index = names.index(routed)
        for name in [*names[index:], *reversed(names[:index])]:
            if self.holds(name, request):
                return name
        return None

    def check_fits(self, request: Request) -> None:
        if request.pinned_member is not None:
            check_fits(self.family, self.kv, self.capacity_pages, request)
            return
        if not any(self.holds(name, request) for name in self.names):
            needed_tokens = len(request.prompt_token_ids) + request.sampling.max_tokens
            sizes = ", ".join(f"{n} {self.kv.pages_for_tokens(n, needed_tokens)}/{self.capacity_pages[n]}"
                              for n in self.names)
            raise InvalidRequestError(f"no deployment can hold the request ({needed_tokens} tokens; pages "
                                      f"needed/slice: {sizes})", param="max_tokens")

    def place(self, decision: RouteDecision, request: Request) -> RouteDecision:
        if request.pinned_member is not None:
            return decision
        member = self.placement(decision.member, request)
        if member is None or member == decision.member:
            return decision
        self.num_reroutes += 1
        return dataclasses.replace(decision, member=MemberName(member), rerouted_from=decision.member,
                                   reason=f"re-routed {decision.member}->{member} (slice too small); "
                                          f"{decision.reason}")

    def warms_up(self, member: str) -> bool:
        return True                     # the deployments run without warm-up (eval/systems.py DEPLOYMENTS)

    def accepts_escalation(self, seq: Sequence) -> bool:
        target = escalation_target(self.family, seq.member, pinned=seq.request.pinned_member is not None)
        if target is not None and not self.holds(target, seq.request):
            seq.monitor = None          # that deployment would refuse it: stay, and stop watching
            self.num_escalations_skipped += 1
            return False
        return True

    # ------------------------------------------------------------------ per-deployment caps and turns
    def has_room(self, seq: Sequence, running: RunningSet) -> bool:
        return running.num_on(seq.member) < self.member_cap

    def select(self, running: Iterable[Sequence]) -> list[Sequence]:
        """One deployment per step (the next with running requests after the last one served, among those the
        step's scope holds), in admission order; the others' requests keep their pages and wait for their turn.
        Deployments on devices of their own each get plans of their own (the scope: that one), so they never
        wait for each other."""
        names = self.names
        busy = {s.member for s in running}
        if not busy:
            return []
        for offset in range(1, len(names) + 1):
            index = (self._turn + offset) % len(names)
            if names[index] in busy:
                self._turn = index
                break
        chosen = names[self._turn]
        return [s for s in running if s.member == chosen]


def deployments_scheduler(family: FamilySpec, config: MFSConfig, pool: PagePool, kv: KVCacheManager,
                          estimator: ComplexityEstimator, tiers: TieredStore | None = None,
                          events: EventLog | None = None, stats: Stats | None = None, *,
                          elastic: bool = False) -> Scheduler:
    """The core's Scheduler with Deployments' policies (EngineCore's scheduler_factory signature)."""
    deployments = Deployments(family, config, pool, kv, elastic=elastic)
    return Scheduler(family, config, pool, kv, estimator, tiers, events, stats,
                     policies=scheduler_policies(family, config, placement=deployments, running_cap=deployments,
                                                 step_members=deployments))


# system name -> its scheduler factory (module-level partials: they pickle into the engine process)
DEPLOYMENT_SCHEDULERS = {
    "baseline": deployments_scheduler,
    "baseline_elastic": partial(deployments_scheduler, elastic=True),
    "baseline_per_turn": deployments_scheduler,
    "baseline_legacy": deployments_scheduler,
    "baseline_spec": deployments_scheduler,
    "baseline_elastic_spec": partial(deployments_scheduler, elastic=True),
}
