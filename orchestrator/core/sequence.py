"""One request's state inside the core (tokens, pages, progress, confidence monitor, output spans) and the
per-token rules every engine applies to it: append, stop, roll back for a handover, hold back, emit."""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from orchestrator.core.config import EscalationConfig
from orchestrator.core.escalation import ON_ESCALATE_ROLLBACK, ConfidenceMonitor
from orchestrator.core.kv_cache import KVCacheManager, SeqKV
from orchestrator.core.types import (FinishReason, MemberName, MemberSpan, Request, RequestId, RequestOutput,
                                RequestState, RouteDecision)


@dataclass(slots=True, eq=False)
class DraftState:
    """A request's KV on the member that drafts for it (speculation.py): a second set of tables beside its own."""

    member: MemberName
    kv: SeqKV
    hashes: list[bytes]                        # the draft member's full-block hashes (its block size, its salt)
    salt: str | None                           # cache salt of the draft's keys (a private draft cache's own)
    shares_hashes: bool                        # its keys are the request's own (`Sequence.hashes`): none kept here
    num_computed_tokens: int = 0               # positions whose draft KV exists


@dataclass(slots=True, eq=False)
class Sequence:
    """The core's state for one request (or one warm-up prefill)."""

    request: Request
    member: MemberName
    token_ids: list[int]                       # prompt + generated
    num_prompt_tokens: int
    route: RouteDecision | None = None
    complexity: float = 0.0
    state: RequestState = RequestState.WAITING
    kv: SeqKV | None = None
    hashes: list[bytes] = field(default_factory=list)   # full-block hashes for the current member
    num_computed_tokens: int = 0               # positions whose KV exists at every layer
    shared_until_tokens: int = 0               # positions below this start at shared_depth (handover)
    shared_depth: int = 0
    monitor: ConfidenceMonitor | None = None
    spans: list[MemberSpan] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple] = field(default_factory=list)
    num_emitted_tokens: int = 0                # generated tokens released to the client (never rolled back)
    num_delivered_tokens: int = 0              # of those, the ones in an output built so far
    num_cached_prompt_tokens: int | None = None
    admit_order: int = 0
    is_warmup: bool = False
    warmup_member: MemberName | None = None    # where a warm-up prefilled this prompt (until it pays off)
    count_query: bool = True                   # next admission reports a prefix query (not after preemption)
    finish_reason: FinishReason | None = None
    error: str | None = None
    enqueued_step: int = 0                     # scheduler step it (last) joined the queue: aging
    num_admissions: int = 0                    # first admission records the queue wait
    num_escalations: int = 0                   # escalated requests are preempted after fresh ones
    pinned_kv: SeqKV | None = None             # source member's pages, kept until the target admits it
    held: bool = False                         # aged past scheduler.aging_steps: its pages are held
    draft: DraftState | None = None            # the drafting member's KV while it speculates
    num_drafted_tokens: int = 0                # speculation: tokens drafted for it, and the ones accepted
    num_accepted_tokens: int = 0

    @property
    def request_id(self) -> RequestId:
        return self.request.request_id

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def is_decoding(self) -> bool:
        n = len(self.token_ids)
        return self.num_computed_tokens == n - 1 and n > self.num_prompt_tokens

    def computed_to(self, computed: int, kv: KVCacheManager) -> None:
        """Its KV exists up to `computed` positions (never moving back); its newly full blocks get their keys."""
        assert self.kv is not None
        if computed > self.num_computed_tokens:
            self.num_computed_tokens = computed
        kv.register_full_blocks(self.kv, self.hashes, self.num_computed_tokens)

    def drop_pages(self, kv: KVCacheManager) -> None:
        """Its pages go back (full blocks stay cached under their keys) and its computed progress restarts."""
        if self.kv is not None:
            kv.release(self.kv)
            self.kv = None
        self.drop_draft(kv)
        self.num_computed_tokens = 0
        self.shared_until_tokens = 0
        self.shared_depth = 0

    def drop_draft(self, kv: KVCacheManager) -> None:
        """The draft's pages go back (its full blocks stay cached); the request decodes without drafting."""
        if self.draft is not None:
            kv.release(self.draft.kv)
            self.draft = None

    # ------------------------------------------------------------------ token rules (every engine's)
    # The scheduler (local engine) and TritonServing (members behind Triton) both go through these, so a
    # request stops, escalates, holds back and streams the same way whichever engine serves it.
    def append_token(self, token_id: int, logprob: float, top_logprobs: tuple = ()) -> None:
        """Records one generated token on the current member (its span grows, or a new span starts)."""
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.top_logprobs.append(top_logprobs)
        spans, member = self.spans, self.member
        if spans and spans[-1].member == member:
            spans[-1] = MemberSpan(member=member, num_tokens=spans[-1].num_tokens + 1)
        else:
            spans.append(MemberSpan(member=member, num_tokens=1))

    def stop_reason(self, token_id: int, eos_token_ids: Collection[int], context_tokens: int) -> FinishReason | None:
        """Why the request ends after token_id (just appended), or None: a stop token or EOS once min_tokens
        are out, max_tokens, or the current member's context full."""
        sampling = self.request.sampling
        if self.num_generated >= sampling.min_tokens:
            if token_id in sampling.stop_token_ids:
                return FinishReason.STOP
            if not sampling.ignore_eos and token_id in eos_token_ids:
                return FinishReason.STOP
        if self.num_generated >= sampling.max_tokens:
            return FinishReason.LENGTH
        if len(self.token_ids) >= context_tokens:
            return FinishReason.LENGTH
        return None

    def roll_back_for_handover(self) -> int:
        """Drops the low-confidence tail the monitor asks to regenerate (never tokens already sent to the
        client); returns how many went."""
        monitor = self.monitor
        assert monitor is not None      # only a monitored request escalates
        rollback = min(monitor.rollback_tokens(), self.num_generated - self.num_emitted_tokens)
        if rollback > 0:
            del self.token_ids[-rollback:], self.logprobs[-rollback:], self.top_logprobs[-rollback:]
            last = self.spans[-1]
            self.spans[-1] = MemberSpan(last.member, last.num_tokens - rollback)
            if self.spans[-1].num_tokens == 0:
                self.spans.pop()
        return max(0, rollback)

    def holdback_tokens(self, config: EscalationConfig) -> int:
        """Tokens kept from the client while a rollback could still drop them."""
        if self.monitor is not None and config.on_escalate == ON_ESCALATE_ROLLBACK:
            return config.window_tokens
        return 0

    def next_output(self, holdback_tokens: int, final: bool = False) -> RequestOutput | None:
        """The tokens not yet sent, less the held-back tail (all of them when final); None if nothing is due."""
        end = self.num_generated if final else max(self.num_emitted_tokens, self.num_generated - holdback_tokens)
        if end <= self.num_emitted_tokens and not final:
            return None
        self.num_emitted_tokens = end
        begin = self.num_delivered_tokens
        if begin > 0 and not final and not self.request.intermediate_outputs:
            return None     # emitted, delivered with the final output (Request.intermediate_outputs)
        offset = self.num_prompt_tokens
        self.num_delivered_tokens = end
        return RequestOutput(
            request_id=self.request_id, new_token_ids=self.token_ids[offset + begin:offset + end],
            new_logprobs=self.logprobs[begin:end], new_top_logprobs=self.top_logprobs[begin:end],
            member=self.member, finished=final, finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt_tokens, num_cached_prompt_tokens=self.num_cached_prompt_tokens or 0,
            spans=tuple(self.spans), route=self.route if begin == 0 else None, error=self.error,
            num_drafted_tokens=self.num_drafted_tokens, num_accepted_tokens=self.num_accepted_tokens)
