"""Escalation in the scheduler: the handover to a larger member, warm-up prefills, and the pins on the source pages."""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.core.escalation import (ConfidenceMonitor, EscalationRates, escalation_target, handover_target,
                                          in_warmup_band)
from orchestrator.core.events import EventKind
from orchestrator.core.kv_cache import KVCacheManager
from orchestrator.core.parts import SchedulerParts
from orchestrator.core.placement import Placement
from orchestrator.core.request_queue import WARMUP_PRIORITY, RunningSet
from orchestrator.core.reservation import Reservation
from orchestrator.core.sequence import Sequence
from orchestrator.core.types import MemberName, Request, RequestId


@dataclass(frozen=True, slots=True)
class HandoverRules:
    """What an escalation's target gets from its source: MFS's defaults, or none of it (separate servers: cold)."""

    warmup: bool = True                 # prefill likely escalations on the next member while it is idle
    reuse_shared_layers: bool = True    # nested family: the target starts at the source's exit depth
    cold: bool = False                  # the target gets no cache from the source

    @property
    def warm(self) -> bool:
        """The target may reuse the source's shared layers (and the source keeps its pages until then)."""
        return self.reuse_shared_layers and not self.cold


def release_pin(seq: Sequence, kv: KVCacheManager, running: RunningSet) -> bool:
    """Gives up the source pages an escalated request kept; True if it held any. Pages it shared with running
    requests may become theirs alone, so the running set's reservation is recomputed."""
    if seq.pinned_kv is None:
        return False
    kv.release(seq.pinned_kv)
    seq.pinned_kv = None
    running.changed()
    return True


class Handover:
    def __init__(self, parts: SchedulerParts, reservation: Reservation, placement: Placement,
                 rules: HandoverRules) -> None:
        self.family, self.config, self.kv, self.running, self.waiting = (parts.family, parts.config, parts.kv,
                                                                         parts.running, parts.waiting)
        self.events, self.stats = parts.events, parts.stats
        self.reservation, self.placement, self.rules = reservation, placement, rules
        self.rates = EscalationRates()        # per member: how often its requests escalate out

    def can_escalate(self, seq: Sequence) -> bool:
        return (self.config.escalation.enabled and not seq.is_warmup and seq.request.pinned_member is None
                and escalation_target(self.family, seq.member, pinned=False) is not None)

    def watch(self, seq: Sequence) -> None:
        """A new request that may escalate gets a confidence monitor."""
        if self.can_escalate(seq):
            seq.monitor = ConfidenceMonitor(self.config.escalation)

    def warm_up(self, seq: Sequence, now_s: float) -> Sequence | None:
        """A warm-up prefill of a likely escalation's prompt on the next member while the engine is idle, where
        the placement says it would be read; None when not worth it. The caller queues it."""
        cfg = self.config.escalation
        if not (self.rules.warmup and cfg.enabled and seq.monitor is not None
                and in_warmup_band(cfg, seq.complexity)):
            return None
        target = escalation_target(self.family, seq.member, pinned=False)
        if target is None or not self.placement.warms_up(target):
            return None
        if (self.running.num_on(target) or any(s.member == target for s in self.waiting)
                or len(self.running) > cfg.warmup_max_running):
            return None
        warm = Request(request_id=RequestId(f"{seq.request_id}#warmup"), prompt_token_ids=seq.request.prompt_token_ids,
                       sampling=seq.request.sampling, arrival_s=now_s, cache_salt=seq.request.cache_salt,
                       priority=WARMUP_PRIORITY)
        warm_seq = Sequence(request=warm, member=MemberName(target), token_ids=list(warm.prompt_token_ids),
                            num_prompt_tokens=len(warm.prompt_token_ids), is_warmup=True, count_query=False)
        seq.warmup_member = MemberName(target)
        self.stats.on_warmup(issued=True, hit=False)
        self.events.emit(EventKind.WARMUP, now_s, seq.request_id, target)
        return warm_seq

    def escalate(self, seq: Sequence, now_s: float) -> None:
        """Hands the request to the next larger member; its full blocks stay cached, so the target prefills only
        what its prefix match (and a nested family's shared layers) does not find."""
        if not self.placement.accepts_escalation(seq):
            self.stats.on_escalation_refused()
            return
        target = handover_target(self.family, seq.member, seq.request.pinned_member is not None, len(seq.token_ids))
        if target is None:
            return
        if seq.roll_back_for_handover():
            seq.hashes = seq.hashes[:len(seq.token_ids) // self.kv.tokens_per_block(seq.member)]
        source = seq.member
        if self.rules.warm:
            # Keep the source's pages until the target admits the request: under pressure they would
            # otherwise be evicted before the handover reuses them.
            seq.pinned_kv, seq.kv = seq.kv, None
        seq.drop_pages(self.kv)
        self.running.remove(seq)
        seq.num_escalations += 1
        if self.kv.tokens_per_block(target) != self.kv.tokens_per_block(source):
            seq.hashes = []
        seq.member = MemberName(target)
        seq.count_query = True
        monitor = seq.monitor
        assert monitor is not None      # escalation comes from the monitor
        monitor.reset()
        if not self.can_escalate(seq):
            seq.monitor = None
        self.waiting.push(seq, front=True)
        self.rates.record(source, escalated=True)
        self.stats.on_escalation(source, target)
        self.events.emit(EventKind.ESCALATE, now_s, seq.request_id, target, source=source,
                         num_generated=seq.num_generated)

    def release_pins(self, member: str) -> bool:
        """Gives up the escalation pins in `member`'s pool; True if any were held."""
        released = False
        for seq in self.waiting:
            if seq.pinned_kv is not None and self.reservation.shares_pages(seq, member):
                released = release_pin(seq, self.kv, self.running) or released
        return released
