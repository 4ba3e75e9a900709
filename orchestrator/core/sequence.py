"""One request's state inside the core: tokens, pages, progress, confidence monitor and output spans."""
from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.core.escalation import ConfidenceMonitor
from orchestrator.core.kv_cache import SeqKV
from orchestrator.core.types import (FinishReason, MemberName, MemberSpan, Request, RequestId, RequestState,
                                RouteDecision)


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
    num_emitted_tokens: int = 0
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

    @property
    def request_id(self) -> RequestId:
        return self.request.request_id

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def is_decoding(self) -> bool:
        return self.num_computed_tokens == len(self.token_ids) - 1 and self.num_generated > 0
