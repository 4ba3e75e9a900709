"""Closed-loop chat sessions of a trace, one definition for the real-time driver (`mfs bench`) and the
virtual-time one (`mfs simulate`): each turn's prompt (closed history: the reply this system generated goes back),
its record and its request, when a session ends, and how a streamed output fills the record."""
from __future__ import annotations

from typing import Any

from eval.bench.metrics import RequestRecord
from eval.workloads import Trace, next_prompt
from orchestrator.core.types import FinishReason, Request, RequestId, RequestOutput, SamplingParams


class ClosedLoopSessions:
    """The turns of `trace` as a chat client sends them; `records` holds every turn started, in order."""

    def __init__(self, trace: Trace, tag: str) -> None:
        self.trace, self.tag, self.history = trace, tag, trace.spec.history
        self.records: list[RequestRecord] = []
        self._previous: dict[int, RequestRecord] = {}         # session index -> its last turn's record

    def start_turn(self, index: int, k: int, now_s: float, arrival_s: float,
                   **request_fields: Any) -> tuple[RequestRecord, Request | None]:
        """Turn k of session `index`, sent at now_s (replay time): its record and its request, or None when the
        session has ended (closed history and the previous turn failed: a chat client has no reply to send back;
        the record says so and counts as failed, and the session sends no further turn). Every request is greedy.
        Natural lengths (the trace's `lengths`): EOS ends the reply and max_tokens is the trace's cap, as a chat
        client sends it, so no system knows a reply's length in advance; exact: ignore_eos and max_tokens = the
        dataset reply's length, so every system generates the same lengths."""
        session = self.trace.sessions[index]
        turn = session.turns[k]
        last = self._previous.get(index)
        prompt = next_prompt(turn, last.prompt_token_ids if last else None, last.output_token_ids if last else None,
                             self.history)
        record = RequestRecord(session_id=session.session_id, turn_index=k, send_s=now_s, first_token_s=None,
                               finish_s=None, prompt_tokens=len(prompt), cached_tokens=0, output_tokens=0,
                               prompt_token_ids=prompt)
        self.records.append(record)
        self._previous[index] = record
        if last is not None and self.history == "closed" and not last.ok:
            record.error = f"session ended: turn {k - 1} failed"
            return record, None
        request = Request(request_id=RequestId(f"{self.tag}-{session.session_id}-t{k}"), prompt_token_ids=list(prompt),
                          sampling=self._sampling(turn.max_tokens),
                          arrival_s=arrival_s, session_id=session.session_id,
                          complexity_hint=session.complexity, **request_fields)
        return record, request


    def _sampling(self, reply_tokens: int) -> SamplingParams:
        if self.trace.spec.lengths == "exact":
            return SamplingParams(max_tokens=reply_tokens, temperature=0.0, ignore_eos=True)
        return SamplingParams(max_tokens=self.trace.spec.max_output_tokens, temperature=0.0)


def record_output(record: RequestRecord, out: RequestOutput, now: float) -> None:
    """One streamed RequestOutput into its record (the real replay and mfs simulate's both use this)."""
    if out.new_token_ids:
        if record.first_token_s is None:
            record.first_token_s = now
        record.output_token_ids.extend(out.new_token_ids)
        record.output_logprobs.extend(out.new_logprobs)
    record.cached_tokens = max(record.cached_tokens, out.num_cached_prompt_tokens or 0)
    if out.num_prompt_tokens:
        record.prompt_tokens = out.num_prompt_tokens
    if out.spans:
        record.members = [span.member for span in out.spans if span.num_tokens > 0] or [out.member]
        record.tokens_by_member = {}
        for span in out.spans:
            if span.num_tokens > 0:
                record.tokens_by_member[span.member] = record.tokens_by_member.get(span.member, 0) + span.num_tokens
    elif out.member and (not record.members or record.members[-1] != out.member):
        record.members.append(out.member)
    if out.route is not None:
        record.route_reason = out.route.reason
        record.rerouted_from = out.route.rerouted_from
    if out.error:
        record.error = out.error
    if out.finished:
        record.finish_s = now
        if out.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED) and record.error is None:
            record.error = out.finish_reason.value
