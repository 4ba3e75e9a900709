"""How requests end: the live-request registry, aborts and timeouts, finishing, and idle sessions' cache ageing."""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

from orchestrator.core.escalation import EscalationRates
from orchestrator.core.events import EventKind
from orchestrator.core.handover import release_pin
from orchestrator.core.parts import SchedulerParts
from orchestrator.core.router import SessionAffinity
from orchestrator.core.sequence import Sequence
from orchestrator.core.types import FinishReason, PageId, RequestId, RequestOutput, RequestState

MAX_AGED_SESSIONS = 1 << 16      # sessions whose idle pages pool.session_ttl_s tracks (as router.SessionHomes)


class Lifecycle:
    def __init__(self, parts: SchedulerParts, escalation_rates: EscalationRates) -> None:
        self.config, self.pool, self.kv, self.running, self.waiting = (parts.config, parts.pool, parts.kv,
                                                                       parts.running, parts.waiting)
        self.events, self.stats = parts.events, parts.stats
        self.escalation_rates = escalation_rates
        self.scope = parts.scope
        self.by_id: dict[RequestId, Sequence] = {}
        self.aborts: list[tuple[RequestId, str | None, FinishReason | None]] = []
        self.released: list[RequestId] = []      # ended since the last plan: the engine forgets their state
        self.sessions = SessionAffinity()
        # session -> (last finish time, its pages and their keys): TTL ageing of idle sessions' cache
        self._session_pages: OrderedDict[str, tuple[float, list[tuple[PageId, object]]]] = OrderedDict()
        # (arrival_s, tie-break, seq) of every request added, popped lazily once it left by_id: the oldest
        # tells whether any request can have timed out, without a pass over all of them every step.
        self._arrivals: list[tuple[float, int, Sequence]] = []
        self._arrival_counter = itertools.count()

    def register(self, seq: Sequence) -> None:
        self.by_id[seq.request_id] = seq
        if not seq.is_warmup:
            heapq.heappush(self._arrivals, (seq.request.arrival_s, next(self._arrival_counter), seq))

    def forget(self, seq: Sequence) -> None:
        self.by_id.pop(seq.request_id, None)
        self.released.append(seq.request_id)

    def take_released(self) -> list[RequestId]:
        released, self.released = self.released, []
        return released

    def process_aborts(self, now_s: float) -> list[RequestOutput]:
        """Ends the aborted and the timed-out requests (and their warm-ups); their final outputs. One running
        outside the step's scope ends at its member's next plan."""
        timeout_s = self.config.scheduler.request_timeout_s
        if timeout_s is not None and self._oldest_arrival_timed_out(now_s, timeout_s):
            for seq in list(self.by_id.values()):
                if not seq.is_warmup and now_s - seq.request.arrival_s > timeout_s:
                    self.aborts.append((seq.request_id, f"timed out after {timeout_s:.0f} s", None))
        outputs: list[RequestOutput] = []
        aborts, self.aborts = self.aborts, []
        for request_id, reason, finish_reason in aborts:
            aborted = self.by_id.get(request_id)
            if aborted is None:
                continue
            if not self._plannable(aborted):
                self.aborts.append((request_id, reason, finish_reason))
                continue
            stopped = finish_reason is FinishReason.STOP
            aborted.finish_reason = FinishReason.STOP if stopped else FinishReason.CANCELLED
            aborted.error = reason
            output = self.finish(aborted, now_s, outcome="finished" if stopped else "cancelled")
            if output is not None:      # always: a final output is built whatever was sent before
                outputs.append(output)
            warm = self.by_id.get(RequestId(f"{request_id}#warmup"))
            if warm is not None and self._plannable(warm):   # else it ends itself after its prefill
                self.finish(warm, now_s, outcome=None)
        return outputs

    def has_plannable_aborts(self) -> bool:
        """Whether a pending abort can be processed by a plan for the step's scope."""
        for request_id, _, _ in self.aborts:
            seq = self.by_id.get(request_id)
            if seq is not None and self._plannable(seq):
                return True
        return False

    def _plannable(self, seq: Sequence) -> bool:
        members = self.scope.members
        return members is None or seq.member in members or seq.request_id not in self.running

    def _oldest_arrival_timed_out(self, now_s: float, timeout_s: float) -> bool:
        """Whether the earliest arrival among the requests still known has waited past the timeout."""
        arrivals = self._arrivals
        while arrivals and self.by_id.get(arrivals[0][2].request_id) is not arrivals[0][2]:
            heapq.heappop(arrivals)
        return bool(arrivals) and now_s - arrivals[0][0] > timeout_s

    def age_idle_sessions(self, now_s: float) -> None:
        """Cached pages of a session idle for longer than session_ttl_s become the first to evict."""
        ttl_s = self.config.pool.session_ttl_s
        if ttl_s is None:
            return
        while self._session_pages:
            session, (last_s, pages) = next(iter(self._session_pages.items()))
            if now_s - last_s <= ttl_s:
                break
            del self._session_pages[session]
            for page, key in pages:
                if self.pool.is_cached(page) and self.pool.key_of(page) == key:
                    self.pool.demote(page)

    def emit(self, seq: Sequence, final: bool = False) -> RequestOutput | None:
        return seq.next_output(seq.holdback_tokens(self.config.escalation), final=final)

    def finish(self, seq: Sequence, now_s: float, outcome: str | None) -> RequestOutput | None:
        """Returns the pages (they stay cached) and produces the final output (None for a warm-up: outcome None)."""
        if seq.request_id in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        session = seq.request.session_id
        if session and seq.kv is not None and self.config.pool.session_ttl_s is not None:
            pages = [(p, self.pool.key_of(p)) for p in seq.kv.all_pages()]
            self._session_pages[session] = (now_s, [(p, k) for p, k in pages if k is not None])
            self._session_pages.move_to_end(session)
            if len(self._session_pages) > MAX_AGED_SESSIONS:    # bounded whatever the clients send: the
                self._session_pages.popitem(last=False)         # oldest's pages just age by LRU as others do
        seq.drop_pages(self.kv)
        release_pin(seq, self.kv, self.running)
        self.forget(seq)
        seq.state = RequestState.CANCELLED if seq.finish_reason is FinishReason.CANCELLED else RequestState.FINISHED
        if outcome is None:
            return None
        self.stats.on_request_done(seq.member, outcome)
        if outcome == "finished" and seq.monitor is not None:
            self.escalation_rates.record(seq.member, escalated=False)   # it could have escalated and did not
        self.stats.on_tokens(seq.member, prompt_tokens=seq.num_prompt_tokens)
        if seq.request.session_id:
            self.sessions.record(seq.request.session_id, seq.member)
        kind = EventKind.CANCEL if outcome == "cancelled" else EventKind.FINISH
        self.events.emit(kind, now_s, seq.request_id, seq.member,
                         reason=seq.finish_reason.value if seq.finish_reason else None)
        return self.emit(seq, final=True)
