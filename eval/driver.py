"""The real-time driver of `mfs bench`: replays a trace's sessions against one serving engine (closed-loop
chat: each turn's prompt carries the reply this engine generated), warm-up and the solo decode probes."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from eval.metrics_calc import RequestRecord, counter_delta, percentile
from eval.workloads import Trace, next_prompt
from orchestrator.core.errors import MFSError
from orchestrator.core.types import FinishReason, Request, RequestId, RequestOutput, SamplingParams

STATS_INTERVAL_S = 0.5
PROBE_TOKENS = 48          # decode steps timed per member before and after the replay (the decode floor's step costs)


async def replay(engine: Any, trace: Trace, tag: str, on_done=None) -> tuple[list[RequestRecord], list[dict], dict, float]:
    """Sessions start at their arrival times; each turn goes out when the previous one finished plus its
    think time. Returns (records, stats samples, counters delta over the replay, duration)."""
    before = engine.stats().get("counters", {})
    start = time.monotonic()
    clock = lambda: time.monotonic() - start  # noqa: E731 - seconds since the replay start
    samples: list[dict] = []
    records: list[RequestRecord] = []

    async def sample_stats() -> None:
        while True:
            stats = engine.stats()
            samples.append({"t_s": clock(), "stats": {"pages": stats.get("pages", {})}})
            await asyncio.sleep(STATS_INTERVAL_S)

    history = trace.spec.history

    async def run_session(index: int) -> None:
        session = trace.sessions[index]
        await asyncio.sleep(max(0.0, trace.arrival_times_s[index] - clock()))
        previous: RequestRecord | None = None
        for k, turn in enumerate(session.turns):
            if k:
                await asyncio.sleep(turn.think_time_s)
            prompt = next_prompt(turn, previous.prompt_token_ids if previous else None,
                                 previous.output_token_ids if previous else None, history)
            record = RequestRecord(session_id=session.session_id, turn_index=k, send_s=clock(),
                                   first_token_s=None, finish_s=None, prompt_tokens=len(prompt),
                                   cached_tokens=0, output_tokens=0, prompt_token_ids=prompt)
            records.append(record)
            if previous is not None and history == "closed" and not previous.ok:
                # A chat client has no reply to send back: the session ends here (counted as failed).
                record.error = f"session ended: turn {k - 1} failed"
                previous = record
                continue
            # Greedy and ignore_eos: every system generates exactly the trace's reply lengths.
            request = Request(request_id=RequestId(f"{tag}-{session.session_id}-t{k}"),
                              prompt_token_ids=list(prompt),
                              sampling=SamplingParams(max_tokens=turn.max_tokens, temperature=0.0, ignore_eos=True),
                              arrival_s=time.monotonic(), session_id=session.session_id)
            await run_request(engine, request, record, clock)
            previous = record
            if on_done is not None:
                on_done(record)

    sampler = asyncio.create_task(sample_stats())
    try:
        await asyncio.gather(*(run_session(i) for i in range(len(trace.sessions))))
    finally:
        sampler.cancel()
    duration = clock()
    counters = counter_delta(engine.stats().get("counters", {}), before)
    return records, samples, counters, duration


async def run_request(engine: Any, request: Request, record: RequestRecord, clock) -> None:
    try:
        async for out in engine.generate(request):
            record_output(record, out, clock())
    except Exception as exc:  # a rejected or failed request is recorded, the replay goes on
        record.error = f"{type(exc).__name__}: {exc}"
    record.output_tokens = len(record.output_token_ids)


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


def pinned_request(request_id: str, member: str, max_tokens: int, prompt: list[int] | None = None) -> Request:
    """A greedy request that runs on `member` only (warm-up and decode probes: a short fixed prompt)."""
    return Request(request_id=RequestId(request_id), prompt_token_ids=[1, 7, 8, 9] if prompt is None else prompt,
                   sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                   arrival_s=time.monotonic(), pinned_member=member)


async def warm_up(engine: Any, members: list[str], tag: str) -> None:
    """One short pinned request per member so first-call allocations stay out of the measurement."""
    for member in members:
        try:
            async for _ in engine.generate(pinned_request(f"{tag}-warmup-{member}", member, 2)):
                pass
        except MFSError:                   # a slice too small even for this: nothing to warm
            continue


async def probe_decode_step_s(engine: Any, members: list[str], tag: str, tokens: int = PROBE_TOKENS) -> dict[str, float]:
    """Per member: the median time between streamed tokens of one pinned request running alone (a decode
    step at batch one and short context, through the whole serving stack). The decode floor builds on it."""
    out: dict[str, float] = {}
    for member in members:
        gaps: list[float] = []
        last = None
        try:
            async for result in engine.generate(pinned_request(f"{tag}-probe-{member}", member, tokens)):
                now = time.monotonic()
                if result.new_token_ids:
                    if last is not None:       # the first token comes from the prefill step: not a decode step
                        gaps.append((now - last) / len(result.new_token_ids))
                    last = now
        except MFSError:                   # e.g. a static slice too small for the probe: no step cost (floor n/a)
            continue
        if gaps:
            out[member] = percentile(gaps, 50)
    return out
