"""Per-system benchmark metrics from per-request records and engine stats snapshots (pure, no engine)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.core.events import percentile

TIERS = ("arena", "host", "disk")


@dataclass(slots=True)
class RequestRecord:
    """What the driver measured for one request (times relative to the replay start)."""

    session_id: str
    turn_index: int
    send_s: float
    first_token_s: float | None
    finish_s: float | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    members: list[str] = field(default_factory=list)   # span members in order (>1 distinct = escalated)
    tokens_by_member: dict[str, int] = field(default_factory=dict)   # kept output tokens per member (spans)
    error: str | None = None
    route_reason: str | None = None            # the scheduler's RouteDecision.reason
    rerouted_from: str | None = None           # RouteDecision.rerouted_from: placement moved it off this member
    output_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)   # per output token (mfs bench --record-confidences)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_s is not None and self.output_tokens > 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.send_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.send_s

    @property
    def token_latency_s(self) -> float | None:
        """The headline's per-request term: e2e / output tokens."""
        return None if self.finish_s is None or not self.output_tokens else self.e2e_s / self.output_tokens

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for one-token replies."""
        if self.finish_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def rerouted(self) -> bool:
        """Sent to another member than routing chose because the chosen member's slice cannot hold it (a larger
        one when one can, else a smaller one: eval/baseline/deployments.py)."""
        return self.rerouted_from is not None

    @property
    def escalated(self) -> bool:
        return len(set(self.members)) > 1

    @property
    def member(self) -> str | None:
        return self.members[-1] if self.members else None   # the member that finished the request


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def counter_delta(after: Any, before: Any) -> Any:
    """after - before for nested counter dicts (keys missing in `before` count as 0)."""
    if isinstance(after, Mapping):
        before = before if isinstance(before, Mapping) else {}
        return {k: counter_delta(v, before.get(k)) for k, v in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool):
        return after - (before if isinstance(before, (int, float)) else 0)
    return after


def prefix_hit_rates(counters: Mapping[str, Any]) -> dict[str, Any]:
    """Hit rates from stats counters: hit tokens (by tier) / prefix query tokens, overall, by tier, by member."""
    queries: Mapping[str, int] = counters.get("prefix_query_tokens", {}) or {}
    hits: Mapping[str, Mapping[str, int]] = counters.get("prefix_hit_tokens", {}) or {}
    total_query = sum(queries.values())
    by_tier = {t: sum(h.get(t, 0) for h in hits.values()) for t in TIERS}
    by_member = {m: (sum(hits.get(m, {}).values()) / q if q else None) for m, q in queries.items()}
    return {
        "prefix_hit_rate_counters": sum(by_tier.values()) / total_query if total_query else None,
        "prefix_hit_rate_by_tier": {t: (n / total_query if total_query else None) for t, n in by_tier.items()},
        "prefix_hit_rate_by_member": by_member,
    }


def pages_timeline(samples: Sequence[Mapping[str, Any]]) -> list[list[float]]:
    """[[t_s, used, cached, host, disk], ...] from (t_s, stats snapshot) samples."""
    rows = []
    for sample in samples:
        states = sample["stats"].get("pages", {}).get("by_state", {})
        rows.append([round(sample["t_s"], 3), *(int(states.get(s, 0)) for s in ("used", "cached", "host", "disk"))])
    return rows


def summarize(records: Sequence[RequestRecord], counters: Mapping[str, Any], duration_s: float,
              timeline: list[list[float]] | None = None, members: Sequence[str] = ()) -> dict[str, Any]:
    """The per-system metrics block of the bench JSON. `counters` = stats counters delta over the replay;
    members (small to large) gives the re-routes' directions."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    e2e = [r.e2e_s for r in ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    requests_by_member: dict[str, int] = {}
    tokens_by_member: dict[str, int] = {}
    for r in ok:
        requests_by_member[r.member] = requests_by_member.get(r.member, 0) + 1
        for member, n in member_tokens(r).items():
            tokens_by_member[member] = tokens_by_member.get(member, 0) + n
    result: dict[str, Any] = {
        # Headline: mean over requests of e2e latency / output tokens (normalised latency).
        "mean_token_latency_s": mean([r.token_latency_s for r in ok]),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p90_s": percentile(tpot, 90), "tpot_p99_s": percentile(tpot, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "throughput_tok_s": output_tokens / duration_s if duration_s > 0 else None,
        "prefix_hit_rate": prefix_tokens_rate(ok),
        "escalation_rate": (sum(r.escalated for r in ok) / len(ok)) if ok else None,
        "preemptions": int(counters.get("preemptions", 0) or 0),
        "reroutes": sum(r.rerouted for r in records),
        **reroutes_by_direction(records, members),
        "escalations_refused": int(counters.get("escalations_refused", 0) or 0),
        "num_requests": len(ok),
        "num_failed": len(records) - len(ok),
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_by_member": requests_by_member,
        "output_tokens_by_member": tokens_by_member,
        "escalations": dict(counters.get("escalations", {}) or {}),
        "warmups": dict(counters.get("warmups", {}) or {}),
        "offloads": dict(counters.get("offloads", {}) or {}),
        "evictions": int(counters.get("evictions", 0) or 0),
        "pages_timeline": timeline or [],
        "per_request": [per_request_row(r) for r in records],
    }
    result.update(prefix_hit_rates(counters))
    return result


def reroutes_by_direction(records: Sequence[RequestRecord], members: Sequence[str]) -> dict[str, int | None]:
    """Re-routes to a larger member (reroutes_up) and to a smaller one (reroutes_down: quality given up for a
    slice too small), by the family's order; None without it."""
    order = {m: i for i, m in enumerate(members)}
    moved = [(order.get(r.rerouted_from), order.get(r.members[0])) for r in records
             if r.rerouted_from is not None and r.members]
    if not order or any(a is None or b is None for a, b in moved):
        return {"reroutes_up": None, "reroutes_down": None}
    return {"reroutes_up": sum(b > a for a, b in moved), "reroutes_down": sum(b < a for a, b in moved)}


def member_tokens(r: RequestRecord) -> dict[str, int]:
    """Output tokens per member; a record without span counts gives them all to its last member."""
    if r.tokens_by_member:
        return dict(r.tokens_by_member)
    return {r.member: r.output_tokens} if r.member is not None and r.output_tokens else {}


def decode_floor_token_latency(records: Sequence[RequestRecord], step_s: Mapping[str, float]) -> float | None:
    """A lower bound on mean_token_latency_s for the same token placement: every output token costs one
    decode step of the member that produced it, run alone (batch of one, short context), and nothing
    queues or prefills. A real step holds at least that member's work, so no scheduler gets below this
    without moving tokens to smaller members or producing several tokens per step. None when a member's
    step cost is unknown."""
    terms = []
    for r in records:
        if not r.ok:
            continue
        tokens = member_tokens(r)
        if any(m not in step_s for m in tokens):
            return None
        terms.append(sum(n * step_s[m] for m, n in tokens.items()) / r.output_tokens)
    return mean(terms)


def prefix_tokens_rate(records: Sequence[RequestRecord]) -> float | None:
    """Cached prompt tokens / prompt tokens, as the engine reported per request."""
    prompt = sum(r.prompt_tokens for r in records)
    return sum(r.cached_tokens for r in records) / prompt if prompt else None


def per_request_row(r: RequestRecord) -> dict[str, Any]:
    return {"session_id": r.session_id, "turn_index": r.turn_index, "member": r.member,
            "members": list(dict.fromkeys(r.members)), "tokens_by_member": member_tokens(r), "escalated": r.escalated,
            "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
            "output_tokens": r.output_tokens, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "e2e_s": r.e2e_s,
            "send_s": r.send_s, "error": r.error, "rerouted": r.rerouted}


def paired_token_latency(system: Sequence[RequestRecord], baseline: Sequence[RequestRecord]) -> tuple[float | None, float | None, int]:
    """(system's, baseline's mean token latency, count) over the requests BOTH served: a system that
    refuses the longest requests otherwise averages over an easier set than one that serves them all."""
    def served(records):
        return {(r.session_id, r.turn_index): r.token_latency_s for r in records if r.ok}

    ours, theirs = served(system), served(baseline)
    common = sorted(ours.keys() & theirs.keys())
    return mean([ours[k] for k in common]), mean([theirs[k] for k in common]), len(common)


def reduction(system: float | None, baseline: float | None) -> float | None:
    """1 - system/baseline (positive = system is faster)."""
    if system is None or not baseline:
        return None
    return 1.0 - system / baseline
