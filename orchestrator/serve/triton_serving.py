"""TritonServing: MFS routing and escalation per request over members served by Triton (ServingEngine).

Triton owns each member's KV pool and batching; MFS decides the member, watches confidence, escalates.
The KV ledger is an ESTIMATE (docs/TRTLLM.md): an approximate per-member prefix index from MFS's own
routing history, corrected by the per-request kv_cache_reused_blocks output and Triton's KV block metrics.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from engines.triton.client import TritonClient, check_packable
from orchestrator.core.block_hash import chain_block_hashes, hash_seed
from orchestrator.core.config import MFSConfig
from orchestrator.core.errors import EngineUnavailableError, ModelNotFoundError, QueueFullError
from orchestrator.core.escalation import ConfidenceMonitor, can_escalate, handover_target
from orchestrator.core.events import Stats
from orchestrator.core.family import FamilyError, FamilySpec, load_family
from orchestrator.core.router import MemberLoad, Router, SessionAffinity
from orchestrator.core.sequence import Sequence
from orchestrator.core.types import FinishReason, MemberName, Request, RequestId, RequestOutput, RouteDecision
from orchestrator.serve.request_fields import refuse_unsupported_sampling
from orchestrator.serve.tokenizer import FamilyTokenizer, complexity_estimator
from orchestrator.serve.triton_ledger import EstimateCounters, PrefixEstimate

log = logging.getLogger("mfs.triton")
PROBE_INTERVAL_S = 0.5
METRICS_INTERVAL_S = 1.0
DEFAULT_TOKENS_PER_BLOCK = 32


@dataclass(slots=True)
class _InFlight:
    member: str
    tokens: int                       # prompt + generated so far (the load the router sees)


@dataclass(slots=True)
class _Span:
    """One member's turn at a request: a Triton stream over the context the request has so far."""

    index: int                        # 0 for the routed member, then one per handover
    member: str
    context: list[int]                # prompt + tokens kept so far: what Triton prefills
    predicted_hit_tokens: int = 0
    reused_blocks: int | None = None  # Triton's kv_cache_reused_blocks for this stream
    num_streamed_tokens: int = 0      # tokens Triton generated here (before any rollback)
    escalated_to: str | None = None


class TritonServing:
    """ServingEngine over Triton: route -> stream from the member's model -> escalate on low confidence."""

    def __init__(self, config: MFSConfig, family: FamilySpec | None = None, url: str | None = None,
                 metrics_url: str | None = None, clock: Callable[[], float] = time.monotonic,
                 probe_interval_s: float = PROBE_INTERVAL_S):
        self.config = config
        self.family = family or load_family(config.family)
        drafter = self.family.drafter
        if drafter is not None:     # Triton's engines do not speculate here: it would idle in GPU memory
            raise FamilyError(f"member {drafter.name} is drafts_only, but the Triton engine path does not speculate: "
                              "serve this family with the local engine (engine.kind: local), or drop drafts_only")
        self.family_name = self.family.name
        self.member_names = self.family.member_names
        self.tokenizer = FamilyTokenizer(self.family.members[0].checkpoint_dir)   # the server's edge uses it
        self.clock = clock
        url = url or config.engine.triton_url
        if metrics_url is None:
            metrics_url = config.engine.triton_metrics_url or _default_metrics_url(url)
        self.client = TritonClient(url, metrics_url)
        self.probe_interval_s = probe_interval_s
        self.stats_counters = Stats()
        self.tokens_per_block = {m: DEFAULT_TOKENS_PER_BLOCK for m in self.member_names}
        self.index = {m: PrefixEstimate() for m in self.member_names}
        self.estimate = EstimateCounters()
        self._seed = hash_seed(self.family.members[0].tokenizer_hash, None)
        self._in_flight: dict[RequestId, _InFlight] = {}
        self._aborted: set[RequestId] = set()   # ended at their next streamed token, like LocalServing's abort
        self._sessions = SessionAffinity()
        self._ready = False
        self._accepting = False
        self._probe_task: asyncio.Task | None = None
        self._router = self._estimator = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._router = Router(self.family, self.config.router)
        self._accepting = True
        await self.client.connect()
        await self._probe_once()
        self._probe_task = asyncio.create_task(self._probe_loop(), name="mfs-triton-probe")

    async def stop(self, grace_s: float = 5.0) -> None:
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._aborted.update(self._in_flight)
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
            self._probe_task = None
        self._ready = False
        await self.client.close()

    def is_ready(self) -> bool:
        return self._ready and self._accepting

    async def _probe_loop(self) -> None:
        last_metrics = 0.0
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self._probe_once()
                if self._ready and time.monotonic() - last_metrics >= METRICS_INTERVAL_S:
                    last_metrics = time.monotonic()
                    await self._poll_metrics()
            except Exception:  # the probe must survive anything Triton does
                log.exception("Triton health probe failed")

    async def _probe_once(self) -> None:
        """Health probe; after an outage the channel is rebuilt and the members' settings re-read."""
        ready = await self.client.is_ready()
        if not ready and self._ready:
            self._mark_down("health probe failed")
        elif not ready:
            await self.client.connect()     # a fresh channel: the old one may sit in backoff
            ready = await self.client.is_ready()
        if ready and not self._ready:
            try:
                await self._load_member_settings()
            except Exception as exc:  # a model not ready yet: try again at the next probe
                log.warning("Triton up but member settings unavailable: %s", exc)
                return
            if self.estimate.disconnects:
                self.estimate.reconnects += 1
                # Triton restarted: every cached block it had is gone.
                self.index = {m: PrefixEstimate(self.index[m].capacity_blocks) for m in self.member_names}
            self._ready = True
            log.info("Triton ready at %s", self.client.url)

    def _mark_down(self, why: str) -> None:
        if self._ready:
            self._ready = False
            self.estimate.disconnects += 1
            log.warning("Triton unavailable (%s)", why)

    async def _load_member_settings(self) -> None:
        for member in self.member_names:
            params = await self.client.model_parameters(member)
            self.tokens_per_block[member] = int(params.get("mfs_tokens_per_block", DEFAULT_TOKENS_PER_BLOCK))

    async def _poll_metrics(self) -> None:
        try:
            metrics = await self.client.kv_block_metrics()
        except Exception as exc:  # metrics are advisory
            log.debug("KV metrics poll failed: %s", exc)
            return
        for member in self.member_names:
            values = metrics.get(member)
            if not values:
                continue
            self.estimate.members[member] = values
            if values.get("max"):
                self.index[member].capacity_blocks = int(values["max"])
                self.index[member].trim()

    # ------------------------------------------------------------------ requests
    def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        return self._generate(request)

    async def _generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        refuse_unsupported_sampling(request.sampling)
        check_packable(request.sampling, len(request.prompt_token_ids), request.sampling.max_tokens)
        if not self.is_ready():
            self.stats_counters.on_request_done(request.pinned_member or self.member_names[0], "rejected")
            raise EngineUnavailableError("Triton is not ready")
        limit = self.config.scheduler.max_queue + self.config.scheduler.max_running_requests
        if len(self._in_flight) >= limit:
            raise QueueFullError(f"{len(self._in_flight)} requests in flight (limit {limit})")
        seq = self._sequence(request, self._route(request))
        state = _InFlight(seq.member, len(request.prompt_token_ids))
        self._in_flight[request.request_id] = state
        try:
            # aclosing, here and in _run: a caller that stops reading (the HTTP edge, at the final output) closes
            # the inner generators now, not whenever the loop's finalizer gets to them, so the request is
            # accounted and its Triton stream closed in order.
            async with aclosing(self._run(seq, state)) as outputs:
                async for output in outputs:
                    yield output
        finally:
            self._in_flight.pop(request.request_id, None)
            self._aborted.discard(request.request_id)

    def _route(self, request: Request) -> RouteDecision | None:
        if request.pinned_member is not None:
            if request.pinned_member not in self.family.serving_names:
                raise ModelNotFoundError(f"no member {request.pinned_member!r} to serve requests in family "
                                         f"{self.family_name}")
            return None
        complexity = request.complexity_hint
        if complexity is None:
            complexity = self._complexity(request.prompt_token_ids)
        matched = {m: self._predicted_hit_tokens(m, request.prompt_token_ids) for m in self.member_names}
        loads = {m: MemberLoad(num_running=sum(1 for f in self._in_flight.values() if f.member == m), num_waiting=0,
                               running_tokens=sum(f.tokens for f in self._in_flight.values() if f.member == m),
                               queued_tokens=0) for m in self.member_names}
        decision = self._router.route(request, complexity=complexity, matched_prefix_tokens=matched, loads=loads,
                                      session_member=self._sessions.get(request.session_id or ""))
        self.stats_counters.record_route(decision)
        return decision

    def _sequence(self, request: Request, route: RouteDecision | None) -> Sequence:
        """The core's state for the request: the same token rules as the local engine's scheduler applies."""
        member = route.member if route is not None else MemberName(str(request.pinned_member))
        seq = Sequence(request=request, member=member, token_ids=list(request.prompt_token_ids),
                       num_prompt_tokens=len(request.prompt_token_ids), route=route,
                       complexity=route.complexity if route is not None else 0.0)
        if can_escalate(self.config.escalation, self.family, member, request.pinned_member is not None):
            seq.monitor = ConfidenceMonitor(self.config.escalation)
        return seq

    def _complexity(self, token_ids: list[int]) -> float:
        if self._estimator is None:   # built on first use: decoding a large vocabulary takes a moment
            self._estimator = complexity_estimator(self.tokenizer)
        return self._estimator.score(token_ids)

    def _hashes(self, member: str, token_ids: list[int]) -> list[bytes]:
        return chain_block_hashes(token_ids, self.tokens_per_block[member], self._seed)

    def _predicted_hit_tokens(self, member: str, token_ids: list[int]) -> int:
        # The last prompt token is always recomputed (its logits start decoding), as in the engines.
        hashes = self._hashes(member, token_ids[:-1])
        return self.index[member].match_blocks(hashes) * self.tokens_per_block[member]

    async def _run(self, seq: Sequence, state: _InFlight) -> AsyncIterator[RequestOutput]:
        """One Triton stream per member the request visits: the routed one, then each escalation target."""
        for index in itertools.count():
            span = _Span(index, seq.member, list(seq.token_ids))
            span.predicted_hit_tokens = self._predicted_hit_tokens(span.member, span.context)
            self.estimate.predicted_hit_tokens += span.predicted_hit_tokens
            try:
                async with aclosing(self._stream_span(seq, span, state)) as outputs:
                    async for output in outputs:
                        yield output
            except EngineUnavailableError:
                self._mark_down("stream failed")
                self.stats_counters.on_request_done(span.member, "failed")
                raise
            except (asyncio.CancelledError, GeneratorExit):
                if seq.finish_reason is not None and span.escalated_to is None:
                    # The caller stopped reading at the final output (the HTTP edge does): the request ended
                    # as it should; without this it counted as cancelled and taught the prefix estimate nothing.
                    self._account(span)
                    self._finish(seq)
                else:
                    self.stats_counters.on_request_done(span.member, "cancelled")
                raise
            except Exception:
                self.stats_counters.on_request_done(span.member, "failed")
                raise
            self._account(span)
            if span.escalated_to is None:
                self._finish(seq)
                return
            # The larger member continues from prompt + kept tokens; its own cache serves what it holds.
            self.stats_counters.on_escalation(span.member, span.escalated_to)

    async def _stream_span(self, seq: Sequence, span: _Span, state: _InFlight) -> AsyncIterator[RequestOutput]:
        """Streams span.member's answer into seq until the request finishes or escalates."""
        sampling = seq.request.sampling
        stream = self.client.generate(span.member, span.context, sampling, f"{seq.request_id}-{span.index}",
                                      self._end_id(seq), sampling.max_tokens - seq.num_generated)
        try:
            async for delta in stream:
                if delta.reused_blocks is not None:
                    span.reused_blocks = delta.reused_blocks
                    if seq.num_cached_prompt_tokens is None:
                        seq.num_cached_prompt_tokens = min(delta.reused_blocks * self.tokens_per_block[span.member],
                                                           seq.num_prompt_tokens)
                if seq.request_id in self._aborted:
                    seq.finish_reason = FinishReason.CANCELLED
                else:
                    self._take_tokens(seq, span, state, delta.token_ids, delta.logprobs)
                done = seq.finish_reason is not None or (delta.final and span.escalated_to is None)
                if done and seq.finish_reason is None:   # Triton ended the stream itself (its end_id, its limit)
                    seq.finish_reason = (FinishReason.LENGTH if seq.num_generated >= sampling.max_tokens
                                         else FinishReason.STOP)
                state.tokens = len(seq.token_ids)
                output = seq.next_output(seq.holdback_tokens(self.config.escalation), final=done)
                if output is not None:
                    yield output
                if done or span.escalated_to is not None:
                    return
        finally:
            await stream.aclose()   # cancels the Triton request if we stopped reading early

    def _take_tokens(self, seq: Sequence, span: _Span, state: _InFlight, token_ids: list[int],
                     logprobs: list[float]) -> None:
        """Appends streamed tokens by the core's rules; stops at a finish or a handover (the rest is dropped)."""
        spec = self.family.member(span.member)
        for token, logprob in zip(token_ids, logprobs):
            span.num_streamed_tokens += 1
            seq.append_token(token, logprob)
            reason = seq.stop_reason(token, spec.eos_token_ids, spec.context_tokens)
            if reason is not None:
                seq.finish_reason = reason
                return
            # top-1 estimate: probability of the chosen token (exact for greedy decoding).
            if seq.monitor is not None and seq.monitor.observe(math.exp(logprob)):
                target = handover_target(self.family, seq.member, seq.request.pinned_member is not None,
                                         len(seq.token_ids))
                if target is not None:
                    self._hand_over(seq, target)
                    span.escalated_to = state.member = target
                    return

    def _hand_over(self, seq: Sequence, target: str) -> None:
        seq.roll_back_for_handover()
        seq.member = MemberName(target)
        seq.monitor.reset()
        if not can_escalate(self.config.escalation, self.family, target, seq.request.pinned_member is not None):
            seq.monitor = None

    def _finish(self, seq: Sequence) -> None:
        cancelled = seq.finish_reason is FinishReason.CANCELLED
        self.stats_counters.on_request_done(seq.member, "cancelled" if cancelled else "finished")
        if seq.request.session_id:
            self._sessions.record(seq.request.session_id, seq.member)

    def _end_id(self, seq: Sequence) -> int:
        """The end token Triton may stop on by itself: none (-1) while EOS must not end the request
        (ignore_eos, or min_tokens not reached yet: then MFS applies the stop rule client-side)."""
        sampling = seq.request.sampling
        eos = self.family.member(seq.member).eos_token_ids
        if sampling.ignore_eos or sampling.min_tokens > seq.num_generated or not eos:
            return -1
        return eos[0]

    def _account(self, span: _Span) -> None:
        """A finished span: Triton's reuse report against the prediction, the stats, the prefix estimate."""
        member, context, predicted_tokens = span.member, span.context, span.predicted_hit_tokens
        reused_blocks, num_generated = span.reused_blocks, span.num_streamed_tokens
        tpb = self.tokens_per_block[member]
        hashes = self._hashes(member, context[:-1])
        reported = predicted_tokens if reused_blocks is None else reused_blocks * tpb
        if reused_blocks is not None:
            self.estimate.reported_hit_tokens += reported
            if reused_blocks * tpb < predicted_tokens:
                self.estimate.corrections += 1
                self.index[member].forget_from(hashes, reused_blocks)
        self.stats_counters.on_prefix_query(member, len(context), {"arena": reported})
        self.stats_counters.on_tokens(member, prompt_tokens=len(context), generated_tokens=num_generated)
        # Every full block of what Triton just processed is now reusable there (blocks enter its radix tree when full).
        self.index[member].insert(hashes)

    def abort(self, request_id: RequestId, finish_reason: FinishReason | None = None) -> None:
        # Triton has no "finished by stop string" notion: the stream is simply cancelled there.
        if request_id in self._in_flight:
            self._aborted.add(request_id)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """The ARCHITECTURE.md snapshot; 'pages' here are Triton KV blocks (all layers), from its metrics."""
        by_member, totals = {}, {"free": 0, "used": 0, "cached": 0, "host": 0, "disk": 0}
        total = 0
        for m in self.member_names:
            metrics = self.estimate.members.get(m, {})
            used, free = int(metrics.get("used", 0)), int(metrics.get("free", 0))
            cached = min(len(self.index[m]), free)       # estimate: reusable blocks among the free ones
            by_member[m] = {"used": used, "cached": cached, "host": 0, "disk": 0}
            totals["used"] += used
            totals["cached"] += cached
            totals["free"] += free - cached
            total += int(metrics.get("max", 0))
        running: dict[str, int] = {m: 0 for m in self.member_names}
        for flight in self._in_flight.values():
            running[flight.member] = running.get(flight.member, 0) + 1
        snapshot = self.stats_counters.snapshot(
            time_s=self.clock(), family=self.family_name, members=self.member_names,
            pages={"total": total, "page_bytes": 0, "by_state": totals, "by_member": by_member},
            queue_depth=0, running=running, waiting={})
        e = self.estimate
        snapshot["engine"] = {
            "kind": "triton", "url": self.client.url, "ready": self.is_ready(), "units": "kv_blocks",
            "tokens_per_block": dict(self.tokens_per_block),
            "estimate": {"predicted_hit_tokens": e.predicted_hit_tokens, "reported_hit_tokens": e.reported_hit_tokens,
                         "corrections": e.corrections, "index_blocks": {m: len(i) for m, i in self.index.items()}},
            "disconnects": e.disconnects, "reconnects": e.reconnects,
            "kv_block_metrics": {m: dict(v) for m, v in e.members.items()},
        }
        return snapshot


def _default_metrics_url(grpc_url: str) -> str:
    """Metrics on the gRPC port + 1, as Triton's own defaults and `mfs triton-up`'s (8101 -> 8102)."""
    host, _, port = grpc_url.rpartition(":")
    try:
        return f"http://{host or '127.0.0.1'}:{int(port) + 1}/metrics"
    except ValueError:
        return f"http://{grpc_url}:8102/metrics"

