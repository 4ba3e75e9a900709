"""One scheduler for the whole family: global queue, admission against the ledger, chunked prefill and
decode batches per member, preemption, escalation handover and warm-up. Pure: no torch, no I/O,
the clock is passed in.

Step shape: schedule(now) -> StepPlan (the engine runs it) -> update(plan, sampled, now) -> outputs.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque

from orchestrator.core.complexity import ComplexityEstimator
from orchestrator.core.config import MFSConfig
from orchestrator.core.demand import victim_key
from orchestrator.core.errors import InvalidRequestError, QueueFullError
from orchestrator.core.escalation import (ConfidenceMonitor, EscalationRates, escalation_target, handover_target,
                                          in_warmup_band)
from orchestrator.core.events import EventKind, EventLog, Stats, pages_block
from orchestrator.core.family import FamilySpec
from orchestrator.core.kv_cache import KVCacheManager
from orchestrator.core.page_pool import PagePool
from orchestrator.core.pool_demand import PoolDemand
from orchestrator.core.router import MemberLoad, Router, SessionAffinity
from orchestrator.core.sequence import Sequence
from orchestrator.core.tiers import TieredStore
from orchestrator.core.types import (FinishReason, MemberBatch, MemberName, PageId, Request, RequestId,
                                RequestOutput, RequestState, RouteDecision, SampledToken, SeqChunk, StepPlan)

WARMUP_PRIORITY = 100          # warm-up prefills run only when nothing else waits


class Scheduler:
    def __init__(self, family: FamilySpec, config: MFSConfig, pool: PagePool, kv: KVCacheManager,
                 estimator: ComplexityEstimator, tiers: TieredStore | None = None,
                 events: EventLog | None = None, stats: Stats | None = None):
        self.family = family
        self.config = config
        self.pool = pool
        self.kv = kv
        self.tiers = tiers
        self.router = Router(family, config.router)
        self.estimator = estimator
        self.events = events if events is not None else EventLog()   # an empty log is falsy (__len__)
        self.stats = stats if stats is not None else Stats()
        self._waiting: dict[int, deque[Sequence]] = {}          # priority -> FCFS queue
        self._running: OrderedDict[RequestId, Sequence] = OrderedDict()  # admission order
        self._by_id: dict[RequestId, Sequence] = {}
        self._aborts: list[tuple[RequestId, str | None, FinishReason | None]] = []
        self._released: list[RequestId] = []
        self._sessions = SessionAffinity()
        # session -> (last finish time, its pages and their keys): TTL ageing of idle sessions' cache
        self._session_pages: OrderedDict[str, tuple[float, list[tuple[PageId, object]]]] = OrderedDict()
        self._admit_counter = itertools.count()
        # (arrival_s, tie-break, seq) of every request added, popped lazily once it left _by_id: the oldest
        # tells whether any request can have timed out, without a pass over all of them every step.
        self._arrivals: list[tuple[float, int, Sequence]] = []
        self._arrival_counter = itertools.count()
        # member -> (tokens per block, EOS ids, context tokens): what _append_token reads for every token
        self._token_rules = {m.name: (kv.tokens_per_block(m.name), frozenset(m.eos_token_ids), m.context_tokens)
                             for m in family.members}
        # Most pages each member can ever hold (its slice, minus the other members' floors, under its ceiling):
        # a request needing more is refused at once rather than left waiting for room that never comes.
        self._capacity_pages: dict[str, int] = {m.name: pool.num_available_pages_total(m.name) for m in family.members}
        self._reserve_pages = {m.name: config.pool.decode_reserve_blocks * kv.pages_per_block(m.name)
                               for m in family.members}
        self.demand = PoolDemand(family, config, pool, kv, self._running, self._waiting, self._capacity_pages)
        self._step = 0                                   # schedule() calls so far: the aging clock
        self._victim_key = victim_key(config.scheduler.victim_order)
        self._step_cost_s: float | None = None          # EMA of the time between busy schedule() calls
        self._last_busy_schedule_s: float | None = None
        self.escalation_rates = EscalationRates()        # per member: how often its requests escalate out

    # ------------------------------------------------------------------ intake
    def num_waiting(self) -> int:
        return sum(len(q) for p, q in self._waiting.items() if p < WARMUP_PRIORITY)

    def has_work(self) -> bool:
        return bool(self._running or any(self._waiting.values()) or self._aborts)

    def add_request(self, request: Request, now_s: float) -> RouteDecision:
        """Validates against the family and the pool, routes, queues. Raises InvalidRequestError/QueueFullError."""
        if request.request_id in self._by_id:
            raise InvalidRequestError(f"duplicate request id {request.request_id}", param="request_id")
        if not request.prompt_token_ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if request.pinned_member is not None and request.pinned_member not in self.family.member_names:
            raise InvalidRequestError(f"unknown member {request.pinned_member}", param="model")
        self._check_fits(request)
        if self.num_waiting() >= self.config.scheduler.max_queue:
            self.stats.on_request_done(request.pinned_member or "all", "rejected")
            raise QueueFullError(f"queue full ({self.config.scheduler.max_queue} waiting requests)")
        complexity = (request.complexity_hint if request.complexity_hint is not None
                      else self.estimator.score(request.prompt_token_ids))
        hashes_by_block: dict[int, list[bytes]] = {}
        decision = self._route(request, complexity, now_s, hashes_by_block)
        seq = Sequence(request=request, member=decision.member, token_ids=list(request.prompt_token_ids),
                       num_prompt_tokens=len(request.prompt_token_ids), route=decision, complexity=complexity)
        seq.hashes = hashes_by_block.get(self.kv.tokens_per_block(seq.member), [])
        if self._can_escalate(seq):
            seq.monitor = ConfidenceMonitor(self.config.escalation)
        self._by_id[request.request_id] = seq
        heapq.heappush(self._arrivals, (request.arrival_s, next(self._arrival_counter), seq))
        self._enqueue(seq)
        self.stats.record_route(decision)
        self.events.emit(EventKind.ROUTE, now_s, request.request_id, decision.member, reason=decision.reason)
        self._maybe_warm_up(seq, now_s)
        return decision

    def _check_fits(self, request: Request) -> None:
        """Every member the request may run on (escalation included) can hold it whole; else InvalidRequestError."""
        needed = len(request.prompt_token_ids) + request.sampling.max_tokens
        candidates = [request.pinned_member] if request.pinned_member else self.family.member_names
        for name in candidates:
            member = self.family.member(name)
            if len(request.prompt_token_ids) >= member.context_tokens:
                raise InvalidRequestError(f"prompt has {len(request.prompt_token_ids)} tokens; member {name} "
                                          f"holds {member.context_tokens}", param="prompt")
            pages = self.kv.pages_for_tokens(name, needed)
            if pages > self._capacity_pages[name]:
                raise InvalidRequestError(f"request needs {pages} KV pages on {name}; the pool can give it "
                                          f"at most {self._capacity_pages[name]}", param="max_tokens")

    def abort(self, request_id: RequestId, reason: str | None = None,
              finish_reason: FinishReason | None = None) -> None:
        """Ends a request at the next schedule(); finish_reason STOP (a stop string found at the edge)
        counts as finished, anything else as cancelled. Aborting twice is harmless."""
        self._aborts.append((request_id, reason, finish_reason))

    def _route(self, request: Request, complexity: float, now_s: float,
               by_block_size: dict[int, list[bytes]] | None = None) -> RouteDecision:
        """Routes; fills by_block_size with the prompt's block hashes so admission can reuse them."""
        matched: dict[str, int] = {}
        by_block_size = {} if by_block_size is None else by_block_size
        if self.config.router.use_affinity and request.pinned_member is None:
            for name in self.family.member_names:
                size = self.kv.tokens_per_block(name)
                if size not in by_block_size:
                    by_block_size[size] = self.kv.block_hashes(name, request.prompt_token_ids, request.cache_salt)
                matched[name] = self.kv.estimate_cached_tokens(name, by_block_size[size])
        session_member = self._sessions.get(request.session_id) if request.session_id else None
        return self.router.route(request, complexity=complexity, matched_prefix_tokens=matched,
                                 loads=self.loads(request), session_member=session_member, now_s=now_s)

    def loads(self, request: Request | None = None) -> dict[str, MemberLoad]:
        """Each member's load; with `request`, also the expected wait before it could be admitted there
        (pages: the queue ahead in its pool and the running requests' demand; prefill budget; the
        measured step time) and its pool's pressure."""
        running = {n: [0, 0] for n in self.family.member_names}
        waiting = {n: [0, 0] for n in self.family.member_names}
        for seq in self._running.values():
            running[seq.member][0] += 1
            running[seq.member][1] += len(seq.token_ids)
        for queue in self._waiting.values():
            for seq in queue:
                waiting[seq.member][0] += 1
                waiting[seq.member][1] += len(seq.token_ids)
        extra: dict[str, dict[str, float]] = {n: {} for n in running}
        if request is not None:
            for name in running:
                extra[name] = self.demand.delay_and_pressure(name, request, self._step_cost_s)
        rates = self.escalation_rates
        return {n: MemberLoad(running[n][0], waiting[n][0], running[n][1], waiting[n][1],
                              escalation_rate=rates.rate(n), **extra[n]) for n in running}

    def reserved_pages(self, member: str) -> int:
        """Pages reserved for the running requests' remaining decode in `member`'s pool (pool_demand.py)."""
        return self.demand.reserved_pages(member)

    def _can_escalate(self, seq: Sequence) -> bool:
        return (self.config.escalation.enabled and not seq.is_warmup and seq.request.pinned_member is None
                and escalation_target(self.family, seq.member, pinned=False) is not None)

    def _maybe_warm_up(self, seq: Sequence, now_s: float) -> None:
        """Prefill a likely escalation's prompt on the next member while that member is idle."""
        cfg = self.config.escalation
        if not (cfg.warmup and cfg.enabled and seq.monitor is not None and in_warmup_band(cfg, seq.complexity)):
            return
        target = escalation_target(self.family, seq.member, pinned=False)
        if target is None:
            return
        load = self.loads()[target]
        # Members share the device: a warm-up is only free while the whole engine is lightly loaded.
        if load.num_running or load.num_waiting or len(self._running) > cfg.warmup_max_running:
            return
        warm = Request(request_id=RequestId(f"{seq.request_id}#warmup"), prompt_token_ids=seq.request.prompt_token_ids,
                       sampling=seq.request.sampling, arrival_s=now_s, cache_salt=seq.request.cache_salt,
                       priority=WARMUP_PRIORITY)
        warm_seq = Sequence(request=warm, member=MemberName(target), token_ids=list(warm.prompt_token_ids),
                            num_prompt_tokens=len(warm.prompt_token_ids), is_warmup=True, count_query=False)
        seq.warmup_member = MemberName(target)
        self._by_id[warm.request_id] = warm_seq
        self._enqueue(warm_seq)
        self.stats.on_warmup(issued=True, hit=False)
        self.events.emit(EventKind.WARMUP, now_s, seq.request_id, target)

    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        seq.state = RequestState.WAITING if seq.state is not RequestState.PREEMPTED else seq.state
        seq.enqueued_step = self._step
        queue = self._waiting.setdefault(seq.request.priority, deque())
        if front:
            queue.appendleft(seq)
        else:
            queue.append(seq)

    # ------------------------------------------------------------------ schedule
    def schedule(self, now_s: float) -> tuple[StepPlan, list[RequestOutput]]:
        """Plans one step. Also returns outputs produced without running anything (cancellations)."""
        plan = StepPlan(released_requests=self._released)
        self._released = []
        self._step += 1
        if self._last_busy_schedule_s is not None:
            # The time between two schedule() calls around a busy step: what one step costs a waiting request.
            elapsed = now_s - self._last_busy_schedule_s
            self._step_cost_s = elapsed if self._step_cost_s is None else 0.8 * self._step_cost_s + 0.2 * elapsed
        self.demand.clear()
        outputs = self._process_aborts(now_s)
        self._age_idle_sessions(now_s)
        preempted = self._ensure_decode_slots(plan, now_s)
        self.demand.clear()
        if preempted:
            self.demand.ratio.on_shortage()    # hysteresis: a step that preempted admits nobody
        else:
            self.demand.ratio.on_step()
            self._admit(plan, now_s)
        self._build_batches(plan)
        self.demand.clear()
        self._last_busy_schedule_s = now_s if plan.batches else None
        evictions = self.pool.take_evictions()
        if evictions:
            self.stats.on_eviction(len(evictions))
            self.events.emit(EventKind.EVICT, now_s, None, None, num_pages=len(evictions))
            if self.tiers is not None:
                plan.page_saves.extend(evictions)
        return plan, outputs

    def _age_idle_sessions(self, now_s: float) -> None:
        """Cached pages of a session idle for longer than session_ttl_s become the first to evict."""
        ttl = self.config.pool.session_ttl_s
        if ttl is None:
            return
        while self._session_pages:
            session, (last_s, pages) = next(iter(self._session_pages.items()))
            if now_s - last_s <= ttl:
                break
            del self._session_pages[session]
            for page, key in pages:
                if self.pool.is_cached(page) and self.pool.key_of(page) == key:
                    self.pool.demote(page)

    def _process_aborts(self, now_s: float) -> list[RequestOutput]:
        timeout = self.config.scheduler.request_timeout_s
        if timeout is not None and self._oldest_arrival_timed_out(now_s, timeout):
            for seq in list(self._by_id.values()):
                if not seq.is_warmup and now_s - seq.request.arrival_s > timeout:
                    self._aborts.append((seq.request_id, f"timed out after {timeout:.0f} s", None))
        outputs: list[RequestOutput] = []
        aborts, self._aborts = self._aborts, []
        for request_id, reason, finish_reason in aborts:
            aborted = self._by_id.get(request_id)
            if aborted is None:
                continue
            stopped = finish_reason is FinishReason.STOP
            aborted.finish_reason = FinishReason.STOP if stopped else FinishReason.CANCELLED
            aborted.error = reason
            output = self._finish(aborted, now_s, outcome="finished" if stopped else "cancelled")
            if output is not None:      # always: a final output is built whatever was sent before
                outputs.append(output)
            warm = self._by_id.get(RequestId(f"{request_id}#warmup"))
            if warm is not None:
                self._finish(warm, now_s, outcome=None)
        return outputs

    def _oldest_arrival_timed_out(self, now_s: float, timeout_s: float) -> bool:
        """Whether the earliest arrival among the requests still known has waited past the timeout (then
        some request has; if not, none has, as now - arrival only grows with older arrivals)."""
        arrivals = self._arrivals
        while arrivals and self._by_id.get(arrivals[0][2].request_id) is not arrivals[0][2]:
            heapq.heappop(arrivals)
        return bool(arrivals) and now_s - arrivals[0][0] > timeout_s

    def _ensure_decode_slots(self, plan: StepPlan, now_s: float) -> bool:
        """Every decoding request gets a page slot for its next token, reserved before the step runs;
        when pages are short, escalation pins are given up before a request would preempt itself, and
        victims are taken in scheduler.victim_order from the same pool (slice, under a static split).
        Returns whether anything was preempted."""
        preempted = False
        running = self._running
        preallocate, grow = self.config.scheduler.preallocate_blocks, self.kv.grow
        for seq in list(running.values()):
            if seq.request_id not in running or not seq.is_decoding():
                continue
            kv = seq.kv
            assert kv is not None       # a running request holds pages
            if preallocate and grow(kv, len(seq.token_ids) + 1):
                continue   # next step's slot is reserved too, off the critical path; no preemption for it
            while not grow(kv, len(seq.token_ids)):
                victim = min((s for s in self._running.values() if self.demand.in_partition(s, seq.member)),
                             key=self._victim_key)
                if victim is seq and self._release_pins(seq.member, now_s):
                    continue
                self._preempt(victim, now_s, plan)
                preempted = True
                if victim is seq:
                    break
        return preempted

    def _preempt(self, seq: Sequence, now_s: float, plan: StepPlan | None = None) -> None:
        """Pages go back (full blocks stay cached under their keys), the request waits at the queue front
        and resumes identically. Swap: when the host tier has room for the victim's full blocks they
        are copied there now (plan.page_saves), so its resume reloads them instead of recomputing even
        if the arena evicts them meanwhile; recompute: they stay only as long as the arena keeps them.
        The last, partial block is recomputed either way."""
        kind = "recompute"
        host = self.tiers.host if self.tiers is not None else None
        if (plan is not None and seq.kv is not None and host is not None and self.config.scheduler.swap_preempted
                and not seq.is_warmup):
            keyed = [(p, k) for p in seq.kv.all_pages() if (k := self.pool.key_of(p)) is not None]
            if keyed and len(keyed) * self.config.pool.page_bytes <= host.capacity_bytes - host.bytes_used:
                plan.page_saves.extend(keyed)
                kind = "swap"
        self._drop_kv(seq)
        del self._running[seq.request_id]
        if seq.is_warmup:
            self._forget(seq)
            return
        seq.state = RequestState.PREEMPTED
        seq.count_query = False
        self._enqueue(seq, front=True)
        self.stats.on_preemption(kind)
        self.events.emit(EventKind.PREEMPT, now_s, seq.request_id, seq.member, preemption=kind)

    def _release_pin(self, seq: Sequence) -> None:
        if seq.pinned_kv is not None:
            self.kv.release(seq.pinned_kv)
            seq.pinned_kv = None

    def _release_pins(self, member: str, now_s: float) -> bool:
        """Gives up the escalation pins in `member`'s pool; True if any were held."""
        released = False
        for queue in self._waiting.values():
            for seq in queue:
                if seq.pinned_kv is not None and self.demand.in_partition(seq, member):
                    self._release_pin(seq)
                    released = True
        return released

    def _drop_kv(self, seq: Sequence) -> None:
        if seq.kv is not None:
            self.kv.release(seq.kv)
            seq.kv = None
        seq.num_computed_tokens = 0
        seq.shared_until_tokens = 0
        seq.shared_depth = 0

    def _admit(self, plan: StepPlan, now_s: float) -> None:
        """FCFS within a priority with per-member head-of-line blocking (one member's full pool never blocks
        another), except that a request waiting scheduler.aging_steps or longer has its pages held: later
        requests in its pool are admitted only if they fit beside them (no starvation)."""
        held: dict[str | None, int] = {}
        blocked: set[str] = set()
        self._admit_pass(plan, now_s, held, blocked)
        if not self._running and any(self._waiting.values()):
            # Nothing runs, so nothing will free pages: escalation pins must not keep the queue stuck.
            for name in self.family.member_names:
                self._release_pins(name, now_s)

    def _admit_pass(self, plan: StepPlan, now_s: float, held: dict[str | None, int], blocked: set[str]) -> None:
        """One pass over the queues."""
        max_running = self.config.scheduler.max_running_requests
        aging = self.config.scheduler.aging_steps
        for priority in sorted(self._waiting):
            queue = self._waiting[priority]
            kept: deque[Sequence] = deque()
            while queue:
                seq = queue.popleft()
                part = self.demand.partition_of(seq.member)
                if (len(self._running) >= max_running or seq.member in blocked
                        or not self._try_admit(seq, plan, now_s, held.get(part, 0))):
                    if seq.is_warmup:
                        self._forget(seq)   # a warm-up that cannot run now is worthless later
                        continue
                    blocked.add(seq.member)
                    aged = aging is not None and self._step - seq.enqueued_step >= aging
                    if aged:
                        held[part] = held.get(part, 0) + self.demand.demand_pages(seq)
                    if aged and not seq.held:
                        seq.held = True
                        self.events.emit(EventKind.HOLD, now_s, seq.request_id, seq.member,
                                         waited_steps=self._step - seq.enqueued_step)
                    kept.append(seq)
            self._waiting[priority] = kept

    def _try_admit(self, seq: Sequence, plan: StepPlan, now_s: float, held_pages: int = 0) -> bool:
        if seq.is_warmup and self.loads()[seq.member].num_running:
            return False
        cfg = self.config.escalation
        # Hashes chain per block size: extend what routing or an earlier member computed.
        seq.hashes = self.kv.block_hashes(seq.member, seq.token_ids, seq.request.cache_salt, known=seq.hashes)
        allow_shared = cfg.reuse_shared_layers and not cfg.cold_handover
        match = self.kv.match(seq.member, seq.hashes, len(seq.token_ids), allow_shared=allow_shared)
        if match.num_shared_blocks:
            # A handover holds one residual input page per shared block to its end, beyond
            # pages_for_tokens: if its whole length would then exceed the pool, it recomputes the lower
            # layers instead (else alone, admitted without a reserve, it would preempt itself).
            longest = len(seq.token_ids) + max(0, seq.request.sampling.max_tokens - seq.num_generated)
            if (self.kv.pages_for_tokens(seq.member, longest) + match.num_shared_blocks
                    > self._capacity_pages[seq.member]):
                match = self.kv.match(seq.member, seq.hashes, len(seq.token_ids), allow_shared=False)
        # Headroom matters only when others share the pages: alone, a request always fits (add_request
        # checked its whole length against the capacity), so it must never wait for a reserve.
        shared_with_others = any(self.demand.in_partition(s, seq.member) for s in self._running.values())
        reserve = 0
        if shared_with_others and self.config.scheduler.decode_reservation != "block":
            # Beside every running request's remaining decode, with room for this one's own.
            own = max(0, self.demand.demand_pages(seq) - self.kv.pages_for_tokens(seq.member, len(seq.token_ids)))
            reserve = self._decode_reserve(seq, match, own + (0 if seq.held else held_pages)) + own
        elif shared_with_others:
            reserve = self._reserve_pages[seq.member]
        if not seq.held:
            reserve += held_pages   # an aged request's pages are not for later arrivals
        # Warm-ups never evict: they use idle memory only.
        attached = self.kv.attach(seq.member, match, seq.hashes, len(seq.token_ids),
                                  reserve_pages=reserve, evict=not seq.is_warmup)
        if attached is None:
            return False
        seq.kv, loads = attached
        plan.page_loads.extend(loads)
        seq.num_computed_tokens = match.num_full_tokens
        seq.shared_until_tokens = match.num_full_tokens + match.num_shared_tokens
        seq.shared_depth = match.shared_depth
        seq.state = RequestState.RUNNING
        seq.admit_order = next(self._admit_counter)
        self._running[seq.request_id] = seq
        self._release_pin(seq)     # the target holds what it reuses now
        seq.held = False
        if seq.num_admissions == 0 and not seq.is_warmup:
            self.stats.on_queue_wait(seq.member, now_s - seq.request.arrival_s)
        seq.num_admissions += 1
        self.demand.admitted(seq)
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

    def _decode_reserve(self, seq: Sequence, match, other_pages: int) -> int:
        """The pages reserved for the running requests' decode, as admission passes them to attach: the exact
        peak reservation (reserved_pages: O(running^2) at GPU scale), or its one-pass upper bound when even
        that bound leaves room for every page this request could take (all its pages and residual inputs,
        pinned hits included, plus other_pages): attach then admits exactly as it would with the exact one."""
        bound = self.demand.reserved_pages_bound(seq.member)
        blocks = -(-len(seq.token_ids) // self.kv.tokens_per_block(seq.member))
        pages = blocks * self.kv.pages_per_block(seq.member) + match.num_shared_blocks
        available = self.pool.counts()["free"] if seq.is_warmup else self.pool.num_available_pages(seq.member)
        if pages + bound + other_pages <= available:
            return bound     # the bound credits no returned pages, so prefix claims cannot push the peak above it
        # Its prefix hits on a running request's private pages take them off that request's return.
        claimed = (self.kv.arena_hits(seq.member, match, seq.hashes)
                   if match.num_full_blocks or match.num_shared_blocks else ())
        return self.demand.reserved_pages(seq.member, claimed)

    def _build_batches(self, plan: StepPlan) -> None:
        cfg = self.config.scheduler
        budget = cfg.max_batch_tokens
        chunk_limit = cfg.prefill_chunk_tokens
        if cfg.decode_step_token_budget is not None and any(s.is_decoding() for s in self._running.values()):
            # Stall-aware: while requests decode, prefill chunks fill the step only up to this budget,
            # so a long prompt costs the decoders a few slightly longer steps, not one very long one.
            budget = min(budget, cfg.decode_step_token_budget)
        batches: dict[str, list[SeqChunk]] = {}
        prefills = []
        for seq in self._running.values():
            if seq.is_decoding():
                pos = len(seq.token_ids) - 1
                batches.setdefault(seq.member, []).append(self._chunk(seq, pos, pos + 1, sample=True))
                budget -= 1
            else:
                prefills.append(seq)
        for seq in prefills:
            if budget <= 0:
                break
            start = seq.num_computed_tokens
            stop_at = seq.shared_until_tokens if start < seq.shared_until_tokens else len(seq.token_ids)
            end = min(stop_at, start + chunk_limit, start + budget)
            sample = end == len(seq.token_ids) and not seq.is_warmup
            batches.setdefault(seq.member, []).append(self._chunk(seq, start, end, sample=sample))
            budget -= end - start
        plan.batches = [MemberBatch(MemberName(m), chunks) for m, chunks in batches.items()]
        if batches:
            self.stats.on_member_steps(batches)

    def _chunk(self, seq: Sequence, start: int, end: int, sample: bool) -> SeqChunk:
        kv = seq.kv
        assert kv is not None
        blocks_needed = -(-end // kv.tokens_per_block)
        start_layer = seq.shared_depth if start < seq.shared_until_tokens else 0
        residual_in = None
        if start_layer:
            # The engine indexes residual pages by block from 0; blocks before the handover range
            # are never read, so any valid page pads them.
            first = min(kv.residual_in)
            residual_in = [kv.residual_in.get(b, kv.residual_in[first]) for b in range(blocks_needed)]
        tables, residual_out = kv.tables_upto(blocks_needed)
        return SeqChunk(request_id=seq.request_id, token_ids=seq.token_ids[start:end], start_pos=start,
                        block_tables=tables, sample=sample, sampling=seq.request.sampling, start_layer=start_layer,
                        residual_table=residual_in, residual_table_out=residual_out, num_generated=seq.num_generated)

    def drop_failed_loads(self, plan: StepPlan, failed_pages: list[PageId], now_s: float) -> StepPlan:
        """A tier block failed its checksum: forget it and recompute the affected requests."""
        failed = set(failed_pages)
        for page in failed:
            self.pool.drop_key(page)
        affected = {seq.request_id for seq in self._running.values()
                    if seq.kv is not None and failed.intersection(seq.kv.all_pages())}
        for request_id in affected:
            self._preempt(self._running[request_id], now_s)
        plan.page_loads = [load for load in plan.page_loads if load[0] not in failed]
        for batch in plan.batches:
            batch.chunks = [c for c in batch.chunks if c.request_id not in affected]
        plan.batches = [b for b in plan.batches if b.chunks]
        self.demand.clear()         # the running set changed outside schedule/update
        return plan

    # ------------------------------------------------------------------ update
    def update(self, plan: StepPlan, sampled: list[SampledToken], now_s: float) -> list[RequestOutput]:
        self.demand.clear()
        try:
            return self._update(plan, sampled, now_s)
        finally:
            self.demand.clear()

    def _update(self, plan: StepPlan, sampled: list[SampledToken], now_s: float) -> list[RequestOutput]:
        running = self._running
        for batch in plan.batches:
            for chunk in batch.chunks:
                seq = running.get(chunk.request_id)
                if seq is None:
                    continue
                computed = chunk.start_pos + len(chunk.token_ids)
                if computed > seq.num_computed_tokens:
                    seq.num_computed_tokens = computed
                kv = seq.kv
                assert kv is not None
                self.kv.register_full_blocks(kv, seq.hashes, seq.num_computed_tokens)
                if seq.is_warmup and seq.num_computed_tokens >= len(seq.token_ids):
                    self._finish(seq, now_s, outcome=None)
        outputs: list[RequestOutput] = []
        generated: dict[str, int] = {}          # member -> tokens this step: one stats call per member, not per token
        for token in sampled:
            seq = running.get(token.request_id)
            if seq is None:
                continue
            generated[seq.member] = generated.get(seq.member, 0) + 1
            output = self._append_token(seq, token, now_s)
            if output is not None:
                outputs.append(output)
        for member, n in generated.items():
            self.stats.on_tokens(member, generated_tokens=n)
        return outputs

    def _append_token(self, seq: Sequence, token: SampledToken, now_s: float) -> RequestOutput | None:
        """One sampled token into its request (the caller counts it in the stats)."""
        seq.append_token(token.token_id, token.logprob, token.top_logprobs)
        block_tokens, eos, context_tokens = self._token_rules[seq.member]
        if (len(seq.hashes) + 1) * block_tokens <= len(seq.token_ids):
            seq.hashes = self.kv.block_hashes(seq.member, seq.token_ids, seq.request.cache_salt, known=seq.hashes)
        reason = seq.stop_reason(token.token_id, eos, context_tokens)
        if reason is not None:
            seq.finish_reason = reason
            return self._finish(seq, now_s, outcome="finished")
        if seq.monitor is not None and seq.monitor.observe(token.top1_prob, token.top_logprobs):
            self._escalate(seq, now_s)
        return self._emit(seq)

    def _escalate(self, seq: Sequence, now_s: float) -> None:
        """Hand the request to the next larger member. Its full blocks stay cached under their keys,
        so the target's prefix match finds its own cache and (nested family) the shared lower layers
        and residuals; only the rest is prefilled there."""
        target = handover_target(self.family, seq.member, seq.request.pinned_member is not None, len(seq.token_ids))
        if target is None:
            return
        if seq.roll_back_for_handover():
            seq.hashes = seq.hashes[:len(seq.token_ids) // self.kv.tokens_per_block(seq.member)]
        source = seq.member
        cfg = self.config.escalation
        if cfg.reuse_shared_layers and not cfg.cold_handover:
            # Keep the source's pages until the target admits the request: under pressure they would
            # otherwise be evicted before the handover reuses them.
            seq.pinned_kv, seq.kv = seq.kv, None
        self._drop_kv(seq)
        del self._running[seq.request_id]
        seq.num_escalations += 1
        if self.kv.tokens_per_block(target) != self.kv.tokens_per_block(source):
            seq.hashes = []
        seq.member = MemberName(target)
        seq.count_query = True
        monitor = seq.monitor
        assert monitor is not None      # escalation comes from the monitor
        monitor.reset()
        if not self._can_escalate(seq):
            seq.monitor = None
        self._enqueue(seq, front=True)
        self.escalation_rates.record(source, escalated=True)
        self.stats.on_escalation(source, target)
        self.events.emit(EventKind.ESCALATE, now_s, seq.request_id, target, source=source,
                         num_generated=seq.num_generated)

    def _emit(self, seq: Sequence, final: bool = False) -> RequestOutput | None:
        return seq.next_output(seq.holdback_tokens(self.config.escalation), final=final)

    def _finish(self, seq: Sequence, now_s: float, outcome: str | None) -> RequestOutput | None:
        """Returns the pages (they stay cached) and produces the final output."""
        if seq.request_id in self._running:
            del self._running[seq.request_id]
        else:
            for queue in self._waiting.values():
                if seq in queue:
                    queue.remove(seq)   # rare path (cancel while waiting), queues are bounded
                    break
        session = seq.request.session_id
        if session and seq.kv is not None and self.config.pool.session_ttl_s is not None:
            pages = [(p, self.pool.key_of(p)) for p in seq.kv.all_pages()]
            self._session_pages[session] = (now_s, [(p, k) for p, k in pages if k is not None])
            self._session_pages.move_to_end(session)
        self._drop_kv(seq)
        self._release_pin(seq)
        self._forget(seq)
        seq.state = RequestState.CANCELLED if seq.finish_reason is FinishReason.CANCELLED else RequestState.FINISHED
        if outcome is None:
            return None
        self.stats.on_request_done(seq.member, outcome)
        if outcome == "finished" and seq.monitor is not None:
            self.escalation_rates.record(seq.member, escalated=False)   # it could have escalated and did not
        self.stats.on_tokens(seq.member, prompt_tokens=seq.num_prompt_tokens)
        if seq.request.session_id:
            self._sessions.record(seq.request.session_id, seq.member)
        kind = EventKind.CANCEL if outcome == "cancelled" else EventKind.FINISH
        self.events.emit(kind, now_s, seq.request_id, seq.member, reason=seq.finish_reason.value if seq.finish_reason else None)
        return self._emit(seq, final=True)

    def _forget(self, seq: Sequence) -> None:
        self._by_id.pop(seq.request_id, None)
        self._released.append(seq.request_id)

    # ------------------------------------------------------------------ stats
    def pages_snapshot(self) -> dict:
        """snapshot(...)["pages"] alone (the simulator samples it every half second of virtual time)."""
        return pages_block(self.family.member_names, self._pages_state())

    def snapshot(self, now_s: float) -> dict:
        pages = self._pages_state()
        loads = self.loads()
        return self.stats.snapshot(time_s=now_s, family=self.family.name, members=self.family.member_names,
                                   pages=pages, queue_depth=self.num_waiting(),
                                   running={n: l.num_running for n, l in loads.items()},
                                   waiting={n: l.num_waiting for n, l in loads.items()})

    def _pages_state(self) -> dict:
        counts = self.pool.counts()
        tier_counts = self.tiers.counts() if self.tiers is not None else {"host": 0, "disk": 0}
        by_member = {name: {"used": 0, "cached": 0, "host": 0, "disk": 0} for name in self.family.member_names}
        for name, states in self.pool.counts_by_member().items():
            if name in by_member:
                by_member[name].update(states)
        if self.tiers is not None:
            owner_of_lineage = {}
            for member in reversed(self.family.members):   # shared lineages count for the smallest member
                for lineage in (*member.layer_lineages, member.residual_lineage()):
                    owner_of_lineage[lineage] = member.name
            for lineage, tiers in self.tiers.counts_by_lineage().items():
                owner = owner_of_lineage.get(lineage)
                if owner is not None:
                    for tier, n in tiers.items():
                        by_member[owner][tier] += n
        return {"total": self.pool.num_pages, "page_bytes": self.config.pool.page_bytes,
                "by_state": {"free": counts["free"], "used": counts["used"], "cached": counts["cached"],
                             "host": tier_counts.get("host", 0), "disk": tier_counts.get("disk", 0)},
                "by_member": by_member}
