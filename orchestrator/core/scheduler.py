"""One scheduler for the whole family: intake and routing; per step preemption, admission, batches and the update
(the sampled tokens back into their requests). schedule(now) -> StepPlan -> update(plan, sampled, now) -> outputs.

It composes policy objects: reservation and victim order chosen by name in the config, the rest given by its
builder (SchedulerPolicies). `scope` (parts.StepScope) says which members a plan may touch. Pure: the clock is
passed in.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.core.admission import Admission, RunningCap
from orchestrator.core.batching import BatchFormer, StepMembers
from orchestrator.core.complexity import ComplexityEstimator
from orchestrator.core.config import MFSConfig
from orchestrator.core.errors import InvalidRequestError, QueueFullError
from orchestrator.core.events import EventKind, EventLog, Stats
from orchestrator.core.family import FamilySpec
from orchestrator.core.handover import Handover, HandoverRules
from orchestrator.core.kv_cache import KVCacheManager
from orchestrator.core.lifecycle import Lifecycle
from orchestrator.core.member_turns import MemberTurns, member_turns_for
from orchestrator.core.page_pool import PagePool
from orchestrator.core.parts import SchedulerParts, StepScope
from orchestrator.core.placement import Placement, SharedPoolPlacement
from orchestrator.core.preemption import Preemption
from orchestrator.core.request_queue import RunningSet, WaitingQueue
from orchestrator.core.reservation import RESERVATIONS
from orchestrator.core.router import Router, SessionHomes
from orchestrator.core.routing_inputs import RoutingInputs
from orchestrator.core.sequence import Sequence
from orchestrator.core.snapshot import pages_state
from orchestrator.core.draft_length import StepCost
from orchestrator.core.speculation import Speculation
from orchestrator.core.tiers import TieredStore
from orchestrator.core.types import (FinishReason, PageId, Request, RequestId, RequestOutput, RouteDecision,
                                     SampledToken, StepPlan)


@dataclass(slots=True)
class SchedulerPolicies:
    """Policies given by whoever builds the scheduler (eval composes its compared systems from these); None takes
    MFS's own."""

    placement: Placement | None = None
    running_cap: RunningCap | None = None
    step_members: StepMembers | None = None
    router: Router | None = None
    handover: HandoverRules | None = None
    private_drafts: bool = False                 # each member's server drafts with its own draft copy
    # eval's ablations of member turns: forwards priced by weight bytes only; a riding draft member in every step
    turns_by_weights: bool = False
    draft_member_every_step: bool = False


class Scheduler:
    def __init__(self, family: FamilySpec, config: MFSConfig, pool: PagePool, kv: KVCacheManager,
                 estimator: ComplexityEstimator, tiers: TieredStore | None = None,
                 events: EventLog | None = None, stats: Stats | None = None,
                 policies: SchedulerPolicies | None = None):
        self.family = family
        self.config = config
        self.pool = pool
        self.kv = kv
        self.tiers = tiers
        policies = policies or SchedulerPolicies()
        self.estimator = estimator
        self.events = events if events is not None else EventLog()   # an empty log is falsy (__len__)
        self.stats = stats if stats is not None else Stats()
        self.running = RunningSet()
        self.waiting = WaitingQueue()
        self.capacity_pages: dict[str, int] = {m.name: pool.num_available_pages_total(m.name) for m in family.members}
        self.scope = StepScope()
        parts = SchedulerParts(family, config, pool, kv, tiers, self.running, self.waiting, self.capacity_pages,
                               self.events, self.stats, self.scope)
        self.placement = policies.placement or SharedPoolPlacement(family, kv, self.capacity_pages)
        self.reservation = RESERVATIONS[config.scheduler.decode_reservation](parts)
        self.handover = Handover(parts, self.reservation, self.placement, policies.handover or HandoverRules())
        self.lifecycle = Lifecycle(parts, self.handover.rates)
        sticky = config.router.sticky_sessions
        homes = SessionHomes() if (sticky if sticky is not None else not family.is_nested()) else None
        self.routing = RoutingInputs(family, kv, self.running, self.waiting, self.reservation, self.lifecycle.sessions,
                                     self.handover.rates, policies.router or Router(family, config.router), homes,
                                     self.placement)
        self.speculation = Speculation(parts, self.reservation.shares_pages, private=policies.private_drafts)
        self.preemption = Preemption(parts, self.reservation, self._release_pins_then_drafts, self.lifecycle.forget)
        self.admission = Admission(parts, self.reservation, self.handover, self.lifecycle.forget, policies.running_cap,
                                   self.speculation)
        step_members = policies.step_members
        if step_members is None:
            step_members = member_turns_for(family, config, self.speculation.rides, policies.private_drafts,
                                            policies.draft_member_every_step)
        self.batches = BatchFormer(config.scheduler, self.stats, step_members, self.scope)
        self._turns_by_weights = policies.turns_by_weights
        # member -> (tokens per block, EOS ids, context tokens): what _append_token reads for every token
        self._token_rules = {m.name: (kv.tokens_per_block(m.name), frozenset(m.eos_token_ids), m.context_tokens)
                             for m in family.members}

    def use_step_cost(self, estimate: StepCost | None, error: Callable[[], float] | None = None) -> None:
        """The executor's step-cost estimate (None: none): speculation's draft length, and member turns' forward
        costs (unless they are priced by weight bytes alone)."""
        self.speculation.use_step_cost(estimate, error)
        turns = self.batches.step_members
        if isinstance(turns, MemberTurns) and not self._turns_by_weights:
            turns.use_step_cost(estimate)

    # ------------------------------------------------------------------ intake
    def num_waiting(self) -> int:
        return self.waiting.num_waiting()

    def has_work(self) -> bool:
        """Whether a plan (for the members in scope) has anything to do."""
        members = self.scope.members
        if members is None:
            return bool(self.running or self.waiting or self.lifecycle.aborts)
        return (any(s.member in members for s in self.running) or any(s.member in members for s in self.waiting)
                or self.lifecycle.has_plannable_aborts())

    def add_request(self, request: Request, now_s: float) -> RouteDecision:
        """Validates against the family and the pool, routes, queues. Raises InvalidRequestError/QueueFullError."""
        if request.request_id in self.lifecycle.by_id:
            raise InvalidRequestError(f"duplicate request id {request.request_id}", param="request_id")
        if not request.prompt_token_ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if request.pinned_member is not None and request.pinned_member not in self.family.serving_names:
            why = "only drafts" if request.pinned_member in self.family.member_names else "is unknown"
            raise InvalidRequestError(f"member {request.pinned_member} {why}; requests go to "
                                      f"{', '.join(self.family.serving_names)}", param="model")
        self.placement.check_fits(request)
        if self.num_waiting() >= self.config.scheduler.max_queue:
            self.stats.on_request_done(request.pinned_member or "all", "rejected")
            raise QueueFullError(f"queue full ({self.config.scheduler.max_queue} waiting requests)")
        complexity = self.complexity_of(request)
        hashes_by_block: dict[int, list[bytes]] = {}
        decision = self.routing.route(request, complexity, hashes_by_block)
        seq = Sequence(request=request, member=decision.member, token_ids=list(request.prompt_token_ids),
                       num_prompt_tokens=len(request.prompt_token_ids), route=decision, complexity=complexity)
        seq.hashes = hashes_by_block.get(self.kv.tokens_per_block(seq.member), [])
        self.handover.watch(seq)
        self.lifecycle.register(seq)
        self.waiting.push(seq)
        self.stats.record_route(decision)
        self.events.emit(EventKind.ROUTE, now_s, request.request_id, decision.member, reason=decision.reason)
        warm = self.handover.warm_up(seq, now_s)
        if warm is not None:
            self.lifecycle.register(warm)
            self.waiting.push(warm)
        return decision

    def complexity_of(self, request: Request) -> float:
        """The request's complexity as routing reads it: the caller's hint, else the estimator's score."""
        if request.complexity_hint is not None:
            return request.complexity_hint
        return self.estimator.score(request.prompt_token_ids)

    def abort(self, request_id: RequestId, reason: str | None = None,
              finish_reason: FinishReason | None = None) -> None:
        """Ends a request at the next schedule(); finish_reason STOP (a stop string found at the edge) counts as
        finished, anything else as cancelled. Aborting twice is harmless."""
        self.lifecycle.aborts.append((request_id, reason, finish_reason))

    def _release_pins_then_drafts(self, member: str) -> bool:
        """What a decode short of pages gives up before any request is preempted: escalation pins, then drafts."""
        return self.handover.release_pins(member) or self.speculation.release_drafts(member)

    # ------------------------------------------------------------------ schedule
    def schedule(self, now_s: float) -> tuple[StepPlan, list[RequestOutput]]:
        """Plans one step for the members in `scope` (all, unless narrowed: a plan then touches only their requests,
        never one in a step in flight on another device). Also returns outputs produced without running anything
        (cancellations)."""
        plan = StepPlan(released_requests=self.lifecycle.take_released())
        self.waiting.tick()
        members = self.scope.members
        planned = self.family.member_names if members is None else members
        outputs = self.lifecycle.process_aborts(now_s)
        self.lifecycle.age_idle_sessions(now_s)
        preempted = self.preemption.ensure_decode_slots(plan, now_s)
        if preempted:
            self.reservation.ratio.on_shortage()    # hysteresis: a step that preempted admits nobody
        else:
            self.reservation.ratio.on_step()
            self.admission.admit(plan, now_s)
        self.batches.build(plan, self.running)
        self.speculation.plan(plan)
        self.routing.observe_schedule(planned, now_s, busy=bool(plan.batches))
        evictions = self.pool.take_evictions()
        if evictions:
            self.stats.on_eviction(len(evictions))
            self.events.emit(EventKind.EVICT, now_s, None, None, num_pages=len(evictions))
            if self.tiers is not None:
                plan.page_saves.extend(evictions)
        return plan, outputs

    def drop_failed_loads(self, plan: StepPlan, failed_pages: list[PageId], now_s: float) -> StepPlan:
        """A tier block failed its checksum: forget it and recompute the affected requests."""
        failed = set(failed_pages)
        for page in failed:
            self.pool.drop_key(page)
        affected = {seq.request_id for seq in self.running
                    if (seq.kv is not None and failed.intersection(seq.kv.all_pages()))
                    or (seq.draft is not None and failed.intersection(seq.draft.kv.all_pages()))}
        for request_id in affected:
            seq = self.running.get(request_id)
            assert seq is not None
            self.preemption.preempt(seq, now_s)
        plan.page_loads = [load for load in plan.page_loads if load[0] not in failed]
        for batch in plan.batches:
            batch.chunks = [c for c in batch.chunks if c.request_id not in affected]
        plan.batches = [b for b in plan.batches if b.chunks]
        return plan

    # ------------------------------------------------------------------ update
    def update(self, plan: StepPlan, sampled: list[SampledToken], now_s: float) -> list[RequestOutput]:
        try:
            running = self.running
            for batch in plan.batches:
                for chunk in batch.chunks:
                    seq = running.get(chunk.request_id)
                    if seq is None:
                        continue
                    seq.computed_to(chunk.start_pos + len(chunk.token_ids), self.kv)
                    if seq.is_warmup and seq.num_computed_tokens >= len(seq.token_ids):
                        self.lifecycle.finish(seq, now_s, outcome=None)
            accepted = self.speculation.verified(plan, sampled)
            outputs: list[RequestOutput] = []
            generated: dict[str, int] = {}      # member -> tokens this step: one stats call per member, not per token
            # A verify returns several tokens of one request in a row: its output comes after the last of them.
            following = [token.request_id for token in sampled[1:]] + [None]
            for token, next_id in zip(sampled, following):
                seq = running.get(token.request_id)
                if seq is None:
                    continue                        # ended, or escalated among this step's tokens: the rest is dropped
                generated[seq.member] = generated.get(seq.member, 0) + 1
                output = self._append_token(seq, token, now_s, last=next_id != token.request_id)
                if output is not None:
                    outputs.append(output)
            for member, n in generated.items():
                self.stats.on_tokens(member, generated_tokens=n)
            if accepted is not None:
                self.speculation.advance(plan, accepted)
            return outputs
        finally:
            self.running.changed()      # tokens and computed positions moved

    def _append_token(self, seq: Sequence, token: SampledToken, now_s: float,
                      last: bool = True) -> RequestOutput | None:
        """One sampled token into its request (the caller counts it in the stats); `last`: its request's last token
        of the step, after which its output is due."""
        seq.append_token(token.token_id, token.logprob, token.top_logprobs)
        block_tokens, eos, context_tokens = self._token_rules[seq.member]
        if (len(seq.hashes) + 1) * block_tokens <= len(seq.token_ids):
            seq.hashes = self.kv.block_hashes(seq.member, seq.token_ids, seq.request.cache_salt, known=seq.hashes)
        reason = seq.stop_reason(token.token_id, eos, context_tokens)
        if reason is not None:
            seq.finish_reason = reason
            return self.lifecycle.finish(seq, now_s, outcome="finished")
        if seq.monitor is not None and seq.monitor.observe(token.top1_prob, token.top_logprobs):
            self.handover.escalate(seq, now_s)
            return self.lifecycle.emit(seq)
        return self.lifecycle.emit(seq) if last else None

    # ------------------------------------------------------------------ stats
    def snapshot(self, now_s: float) -> dict:
        loads = self.routing.loads()
        return self.stats.snapshot(time_s=now_s, family=self.family.name, members=self.family.member_names,
                                   pages=pages_state(self.family, self.pool, self.tiers, self.config.pool.page_bytes),
                                   queue_depth=self.num_waiting(),
                                   running={n: l.num_running for n, l in loads.items()},
                                   waiting={n: l.num_waiting for n, l in loads.items()},
                                   serving=self.family.serving_names)
