"""The real-time driver of `mfs bench`: replays a trace's sessions against one serving engine (closed-loop
chat: each turn's prompt carries the reply this engine generated), warm-up and the solo decode probes."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from eval.bench.metrics import (RequestRecord, counter_delta, decode_floor_token_latency, pages_timeline,
                               summarize)
from eval.bench.sessions import ClosedLoopSessions, record_output
from eval.workloads import Trace
from orchestrator.core.errors import MFSError
from orchestrator.core.events import percentile
from orchestrator.core.types import Request, RequestId, SamplingParams

STATS_INTERVAL_S = 0.5
PROBE_TOKENS = 48          # decode steps timed per member before and after the replay (the decode floor's step costs)


async def replay(engine: Any, trace: Trace, tag: str, on_done=None) -> tuple[list[RequestRecord], list[dict], dict, float]:
    """Sessions start at their arrival times; each turn goes out when the previous one finished plus its
    think time. Returns (records, stats samples, counters delta over the replay, duration)."""
    before = engine.stats().get("counters", {})
    start = time.monotonic()
    clock = lambda: time.monotonic() - start  # noqa: E731 - seconds since the replay start
    samples: list[dict] = []

    async def sample_stats() -> None:
        while True:
            stats = engine.stats()
            samples.append({"t_s": clock(), "stats": {"pages": stats.get("pages", {})}})
            await asyncio.sleep(STATS_INTERVAL_S)

    sessions = ClosedLoopSessions(trace, tag)

    async def run_session(index: int) -> None:
        await asyncio.sleep(max(0.0, trace.arrival_times_s[index] - clock()))
        for k, turn in enumerate(trace.sessions[index].turns):
            if k:
                await asyncio.sleep(turn.think_time_s)
            record, request = sessions.start_turn(index, k, clock(), time.monotonic())
            if request is None:
                return
            await run_request(engine, request, record, clock)
            if on_done is not None:
                on_done(record)

    sampler = asyncio.create_task(sample_stats())
    try:
        await asyncio.gather(*(run_session(i) for i in range(len(trace.sessions))))
    finally:
        sampler.cancel()
    duration = clock()
    counters = counter_delta(engine.stats().get("counters", {}), before)
    return sessions.records, samples, counters, duration


async def measure_engine(engine: Any, members: list[str], trace: Trace, name: str, on_done=None,
                         instrument=None, probe=None) -> tuple[list[RequestRecord], dict]:
    """One system's replay on a started engine: warm-up, the solo decode probes around the replay, the metrics
    block. instrument(engine), when given, is called right before the replay; a callable it returns, right after.
    probe: how a solo decode step is timed (probe_decode_step_s; probe_stream_step_s over HTTP)."""
    probe = probe or probe_decode_step_s
    await warm_up(engine, members, name)
    before = await probe(engine, members, f"{name}-before")
    detach = instrument(engine) if instrument is not None else None
    records, samples, counters, duration = await replay(engine, trace, name, on_done)
    if callable(detach):
        detach()
    # probed again after the replay, the faster of the two kept: one probe can catch a slow moment
    # (clocks, a neighbour), and the floor must stay a lower bound
    after = await probe(engine, members, f"{name}-after")
    step_s = {m: min(v for v in (before.get(m), after.get(m)) if v is not None)
              for m in members if m in before or m in after}
    metrics = summarize(records, counters, duration, pages_timeline(samples), members)
    metrics["solo_decode_step_s"] = step_s
    metrics["solo_decode_probes_s"] = {"before": before, "after": after}
    metrics["decode_floor_token_latency_s"] = decode_floor_token_latency(records, step_s)
    metrics["counters"] = counters
    return records, metrics


async def run_request(engine: Any, request: Request, record: RequestRecord, clock) -> None:
    try:
        async for out in engine.generate(request):
            record_output(record, out, clock())
    except Exception as exc:  # a rejected or failed request is recorded, the replay goes on
        record.error = f"{type(exc).__name__}: {exc}"
    record.output_tokens = len(record.output_token_ids)


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


async def probe_stream_step_s(engine: Any, members: list[str], tag: str, tokens: int = PROBE_TOKENS) -> dict[str, float]:
    """probe_decode_step_s for an engine whose outputs may arrive in bursts (a server's stream read over HTTP:
    several chunks in one read come out back to back): per member, the time from the first output with tokens to
    the last over the tokens that came after the first output, of one pinned request running alone."""
    out: dict[str, float] = {}
    for member in members:
        first = last = None
        after_first = 0
        async for result in engine.generate(pinned_request(f"{tag}-probe-{member}", member, tokens)):
            if result.new_token_ids:
                now = time.monotonic()
                if first is None:
                    first = now
                else:
                    last, after_first = now, after_first + len(result.new_token_ids)
        if last is not None and after_first and last > first:
            out[member] = (last - first) / after_first
    return out
