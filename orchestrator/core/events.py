"""Events (a bounded ring) and the counters behind the stats snapshot."""
from __future__ import annotations

import enum
import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.core.types import RouteDecision

OUTCOMES = ("finished", "cancelled", "failed", "rejected")
HIT_TIERS = ("arena", "host", "disk")
OFFLOAD_TIERS = ("host", "disk")
PAGE_STATES = ("free", "used", "cached", "host", "disk")
MEMBER_PAGE_STATES = ("used", "cached", "host", "disk")
RECENT_ROUTES = 100
PREEMPTION_KINDS = ("swap", "recompute")
QUEUE_WAIT_WINDOW = 4096        # queue-wait percentiles cover this many recent admissions per member


class EventKind(enum.Enum):
    ADMIT = "admit"
    ROUTE = "route"
    ESCALATE = "escalate"
    PREEMPT = "preempt"
    EVICT = "evict"
    OFFLOAD = "offload"
    LOAD = "load"
    FINISH = "finish"
    CANCEL = "cancel"
    WARMUP = "warmup"
    HOLD = "hold"            # a request aged past scheduler.aging_steps: its pages are now held for it


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    time_s: float
    request_id: str | None
    member: str | None
    data: dict = field(default_factory=dict)


class EventLog:
    """The last `capacity` events."""

    def __init__(self, capacity: int = 10000) -> None:
        self._events: deque[Event] = deque(maxlen=capacity)   # maxlen drops the oldest in O(1)
        self._lock = threading.Lock()

    def emit(self, kind: EventKind, time_s: float, request_id: str | None = None,
             member: str | None = None, **data: Any) -> None:
        with self._lock:
            self._events.append(Event(kind, time_s, request_id, member, data))

    def recent(self, n: int | None = None) -> list[Event]:
        """The last n events, oldest first (all of them when n is None)."""
        with self._lock:
            events = list(self._events)
        if n is None:
            return events
        return events[-n:] if n > 0 else []

    def __len__(self) -> int:
        return len(self._events)


def _zeros(names: Sequence[str]) -> dict[str, int]:
    return {name: 0 for name in names}


class Stats:
    """Monotonic counters (updated by the engine thread) and the snapshot any thread may read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, dict[str, int]] = {}
        self._prefix_query_tokens: dict[str, int] = {}
        self._prefix_hit_tokens: dict[str, dict[str, int]] = {}
        self._escalations: dict[str, int] = {}
        self._preemptions_by_kind = {kind: 0 for kind in PREEMPTION_KINDS}
        self._downgrades: dict[str, int] = {}
        self._escalations_refused = 0
        self._queue_wait_s: dict[str, deque[float]] = {}
        self._evictions = 0
        self._offloads = _zeros(OFFLOAD_TIERS)
        self._warmups = {"issued": 0, "hit": 0}
        self._generated_tokens: dict[str, int] = {}
        self._prompt_tokens: dict[str, int] = {}
        self._member_steps: dict[str, int] = {}
        self._drafted_tokens: dict[str, int] = {}      # "draft->target" -> tokens drafted (speculation)
        self._accepted_tokens: dict[str, int] = {}     # "draft->target" -> drafted tokens the target accepted
        self._draft_length_steps: dict[int, int] = {}  # k chosen -> member batches (with a request able to draft)
        self._ride_tokens: dict[str, int] = {}         # member -> tokens its decodes took riding draft forwards
        self._routes: deque[dict[str, Any]] = deque(maxlen=RECENT_ROUTES)

    def on_request_done(self, member: str, outcome: str) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        with self._lock:
            self._requests.setdefault(member, _zeros(OUTCOMES))[outcome] += 1

    def on_prefix_query(self, member: str, prompt_tokens: int, hit_tokens_by_tier: Mapping[str, int]) -> None:
        with self._lock:
            self._prefix_query_tokens[member] = self._prefix_query_tokens.get(member, 0) + prompt_tokens
            hits = self._prefix_hit_tokens.setdefault(member, _zeros(HIT_TIERS))
            for tier, num_tokens in hit_tokens_by_tier.items():
                hits[tier] = hits.get(tier, 0) + num_tokens

    def on_escalation(self, src: str, dst: str) -> None:
        with self._lock:
            pair = f"{src}->{dst}"
            self._escalations[pair] = self._escalations.get(pair, 0) + 1

    def on_escalation_refused(self) -> None:
        """The placement refused an escalation (eval's deployments: the target's slice cannot hold it)."""
        with self._lock:
            self._escalations_refused += 1

    def on_preemption(self, kind: str = "recompute") -> None:
        if kind not in PREEMPTION_KINDS:
            raise ValueError(f"preemption kind must be one of {PREEMPTION_KINDS}, got {kind!r}")
        with self._lock:
            self._preemptions_by_kind[kind] += 1

    def on_queue_wait(self, member: str, wait_s: float) -> None:
        """Arrival to first admission of one request (the most recent QUEUE_WAIT_WINDOW per member)."""
        with self._lock:
            self._queue_wait_s.setdefault(member, deque(maxlen=QUEUE_WAIT_WINDOW)).append(max(0.0, wait_s))

    def on_eviction(self, num_pages: int) -> None:
        with self._lock:
            self._evictions += num_pages

    def on_offload(self, tier: str, num_pages: int) -> None:
        with self._lock:
            self._offloads[tier] = self._offloads.get(tier, 0) + num_pages

    def on_warmup(self, issued: bool, hit: bool) -> None:
        with self._lock:
            self._warmups["issued"] += int(issued)
            self._warmups["hit"] += int(hit)

    def on_tokens(self, member: str, prompt_tokens: int = 0, generated_tokens: int = 0) -> None:
        with self._lock:
            self._prompt_tokens[member] = self._prompt_tokens.get(member, 0) + prompt_tokens
            self._generated_tokens[member] = self._generated_tokens.get(member, 0) + generated_tokens

    def on_member_steps(self, members: Iterable[str]) -> None:
        """One step ran these members' forwards."""
        with self._lock:
            for member in members:
                self._member_steps[member] = self._member_steps.get(member, 0) + 1

    def on_speculation(self, pair: str, drafted_tokens: int, accepted_tokens: int) -> None:
        """One verify of `pair` ("draft->target"): tokens drafted, and how many of them the target accepted."""
        with self._lock:
            self._drafted_tokens[pair] = self._drafted_tokens.get(pair, 0) + drafted_tokens
            self._accepted_tokens[pair] = self._accepted_tokens.get(pair, 0) + accepted_tokens

    def on_ride(self, member: str, tokens: int) -> None:
        """A decode of the draft member rode its draft forwards (a family of separate weights) for `tokens`."""
        with self._lock:
            self._ride_tokens[member] = self._ride_tokens.get(member, 0) + tokens

    def on_draft_length(self, k: int) -> None:
        """A member's batch in a step, with some request able to draft, drafts k tokens (0: none)."""
        with self._lock:
            self._draft_length_steps[k] = self._draft_length_steps.get(k, 0) + 1

    def record_route(self, decision: RouteDecision) -> None:
        route = {"request_id": decision.request_id, "member": decision.member, "reason": decision.reason,
                 "complexity": decision.complexity, "scores": dict(decision.scores),
                 "matched_prefix_tokens": dict(decision.matched_prefix_tokens)}
        with self._lock:
            self._routes.append(route)
            if decision.downgraded_from is not None:
                pair = f"{decision.downgraded_from}->{decision.member}"
                self._downgrades[pair] = self._downgrades.get(pair, 0) + 1

    def snapshot(self, *, time_s: float, family: str, members: Sequence[str], pages: Mapping[str, Any],
                 queue_depth: int, running: Mapping[str, int], waiting: Mapping[str, int],
                 serving: Sequence[str] | None = None) -> dict[str, Any]:
        """The 'Stats snapshot' of docs/ARCHITECTURE.md: JSON-able, zeros for every member and tier.

        pages: {"total", "page_bytes", "by_state": {...}, "by_member": {...}}; missing entries read 0.
        serving: the members requests are served by (FamilySpec.serving_names; default: members): escalation pairs
        are zero-filled among them only (a drafts_only member is never escalated from).
        """
        members = list(members)
        serving = list(serving) if serving is not None else members
        with self._lock:
            counters = {
                "requests": _per_member(members, self._requests, OUTCOMES),
                "prefix_query_tokens": _per_member(members, self._prefix_query_tokens),
                "prefix_hit_tokens": _per_member(members, self._prefix_hit_tokens, HIT_TIERS),
                "escalations": {**{f"{a}->{b}": 0 for i, a in enumerate(serving) for b in serving[i + 1:]},
                                **self._escalations},
                "escalations_refused": self._escalations_refused,
                "preemptions": sum(self._preemptions_by_kind.values()),
                "preemptions_by_kind": dict(self._preemptions_by_kind),
                "downgrades": dict(self._downgrades),
                "evictions": self._evictions,
                "offloads": dict(self._offloads),
                "warmups": dict(self._warmups),
                "generated_tokens": _per_member(members, self._generated_tokens),
                "prompt_tokens": _per_member(members, self._prompt_tokens),
                "member_steps": _per_member(members, self._member_steps),
                "drafted_tokens": {**_draft_pairs(members), **self._drafted_tokens},
                "accepted_draft_tokens": {**_draft_pairs(members), **self._accepted_tokens},
                "draft_length_steps": {str(k): n for k, n in sorted(self._draft_length_steps.items())},
            }
            if self._ride_tokens:           # only where decodes ride (a counter appears once it counts)
                counters["ride_tokens"] = dict(self._ride_tokens)
            waits = {m: list(self._queue_wait_s.get(m, ())) for m in _union(members, self._queue_wait_s)}
            routes = [{**r, "scores": dict(r["scores"]), "matched_prefix_tokens": dict(r["matched_prefix_tokens"])}
                      for r in self._routes]
        return {
            "time_s": float(time_s),
            "family": family,
            "members": members,
            "pages": pages_block(members, pages),
            "queue_depth": int(queue_depth),
            "running": _per_member(members, running),
            "waiting": _per_member(members, waiting),
            "counters": counters,
            "queue_wait_s": {m: _wait_percentiles(v) for m, v in waits.items()},
            "recent_routes": routes,
        }


def pages_block(members: Sequence[str], pages: Mapping[str, Any]) -> dict[str, Any]:
    """The snapshot's "pages" entry: pages as the scheduler counts them, zeros for every state and member."""
    by_member = pages.get("by_member", {})
    return {
        "total": int(pages.get("total", 0)),
        "page_bytes": int(pages.get("page_bytes", 0)),
        "by_state": {**_zeros(PAGE_STATES), **pages.get("by_state", {})},
        "by_member": _per_member(list(members), by_member, MEMBER_PAGE_STATES),
    }


def percentile(values: Iterable[float], q: float) -> float | None:
    """THE percentile of MFS (the stats snapshot, the bench and the simulator): linear interpolation between the
    closest ranks (numpy's default) of `values` in any order, q in [0, 100]; None when there is none."""
    data = sorted(values)
    if not data:
        return None
    rank = (len(data) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (rank - low)


def _wait_percentiles(waits: list[float]) -> dict[str, float]:
    """A member's recent queue waits: their count and p50/p90/p99 (0.0 while it has none, as its gauges read)."""
    return {"count": len(waits), **{f"p{q}": percentile(waits, q) or 0.0 for q in (50, 90, 99)}}


def _draft_pairs(members: list[str]) -> dict[str, int]:
    """Zeros for every pair speculation drafts for: the smallest member for each larger one."""
    return {f"{members[0]}->{m}": 0 for m in members[1:]}


def _union(members: list[str], extra: Mapping[str, Any]) -> list[str]:
    """The family's members in order, then any other names seen (never drop a counted name)."""
    return members + [m for m in extra if m not in members]


def _per_member(members: list[str], counts: Mapping[str, Any], states: Sequence[str] | None = None) -> dict[str, Any]:
    """counts for every member and every other counted name: a number (0 where none), or with `states` a count per
    state (0 where none)."""
    if states is None:
        return {m: counts.get(m, 0) for m in _union(members, counts)}
    return {m: {**_zeros(states), **counts.get(m, {})} for m in _union(members, counts)}
