"""The split search's shortlist: which splits the real core re-scores beside the operator's default
(eval/baseline/split.py). A cheap model ranks every candidate; it only shortlists: the split the baseline runs is
the one the core's pilot finds fastest.

The ranking model (crude on purpose: it must score ~170 splits in seconds; no figure from it decides anything):
- each member is a deployment with its slice of the pages (`split_pages`), FCFS admission, its own batch
  cap and step token budget; the deployments take turns on the device (round robin over the busy ones),
  as eval/baseline/deployments.py runs them;
- a step of member m with n tokens costs step_s[m] * (1 + (n - 1) / PREFILL_TOKENS_PER_DECODE_STEP), where
  step_s[m] is the member's solo decode step (the default's pilot); no context term, no eviction;
- pages per request: KVLayout.pages_for_tokens (the one rule); a request needs its pages for prompt + tokens
  so far + one reserve block, grows by block, and preempts the youngest of its deployment (recompute) when its
  slice is short;
- routing on complexity alone (Router.adequate_member), re-routed as eval.baseline.deployments.Deployments.placement
  does; escalations as in the default's pilot (cold handover), skipped when the target slice cannot hold the
  request; a session's next turn reuses the previous turn's prefix on the same member.
Candidates: every split in steps of 1/GRID with each member at least 1/GRID (and the traffic split). Ranked:
first the splits on which every request fits the member it is routed to (prompt + max_tokens, as the deployments
admit) and every member the pilot escalated it to, by the model's mean token latency; then those that need
re-routes to a larger member only. A split that sends a request down to a smaller member is never shortlisted
(it trades quality for speed; without that rule the model retires the small deployments).
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from eval.baseline.split_pool import split_pages

PREFILL_TOKENS_PER_DECODE_STEP = 16.0   # cost model: 16 prompt tokens in a step cost one more decode step
GRID = 20


@dataclass(slots=True)
class SimTurn:
    prompt_tokens: int                     # what the replay sends (closed history: same for every system)
    max_tokens: int
    think_s: float
    routed: str                            # Router.adequate_member(complexity)
    spans: list[tuple[str, int]] = field(default_factory=list)   # the pilot's (member, tokens) if escalated


@dataclass(slots=True)
class SimSession:
    arrival_s: float
    turns: list[SimTurn]


@dataclass(slots=True)
class _Req:
    session: int
    turn: int
    send_s: float
    prompt: int                            # the turn's prompt tokens
    max_tokens: int
    member: str
    plan: list[tuple[str, int]]            # remaining (member, tokens) spans after this member's
    stop_at: int                           # generated count at which this member hands over (or finishes)
    generated: int = 0
    computed: int = 0                      # context tokens already in the cache (prefix hit or prefilled)
    target: int = 0                        # context to prefill before decoding (prompt, + generated after a restart)
    pages: int = 0
    order: int = 0
    first_token_s: float | None = None


class SplitSimulator:
    """One simulated replay of sessions under one split (pure Python, no engine)."""

    def __init__(self, members: Sequence[str], pages_for_tokens, num_pages: int, step_s: Mapping[str, float],
                 block_tokens: Mapping[str, int], max_running: int = 64, max_batch_tokens: int = 2048,
                 prefill_chunk_tokens: int = 512, reserve_blocks: int = 1):
        self.members = list(members)
        self.pages_for_tokens = pages_for_tokens
        self.num_pages = num_pages
        self.step_s = dict(step_s)
        self.block_tokens = dict(block_tokens)
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.reserve_blocks = reserve_blocks

    def holds(self, capacity: Mapping[str, int], member: str, tokens: int) -> bool:
        return self.pages_for_tokens(member, tokens) <= capacity[member]

    def placement(self, capacity: Mapping[str, int], routed: str, tokens: int) -> str | None:
        index = self.members.index(routed)
        for name in [*self.members[index:], *reversed(self.members[:index])]:
            if self.holds(capacity, name, tokens):
                return name
        return None

    def feasible(self, fractions: Mapping[str, float], sessions: Sequence[SimSession], upward: bool = False) -> bool:
        """Every request fits the member it is routed to (upward: or a larger one) and every member the pilot
        escalated it to. A split that needs re-routes for its own traffic retires a deployment rather than
        sizes it; one that sends traffic down to a smaller member, or leaves an escalation target too small,
        trades quality for speed: none is a split an operator would pick."""
        capacity = split_pages(self.num_pages, dict(fractions))
        for session in sessions:
            for t in session.turns:
                member = self.placement(capacity, t.routed, t.prompt_tokens + t.max_tokens)
                if member is None or (member != t.routed and not upward):
                    return False
                if self.members.index(member) < self.members.index(t.routed):
                    return False
                # the pilot's escalation targets must hold it too: a split that makes escalations impossible
                # would buy speed with quality
                if any(not self.holds(capacity, m, t.prompt_tokens + t.max_tokens) for m, _ in t.spans[1:]):
                    return False
        return True

    def run(self, fractions: Mapping[str, float], sessions: Sequence[SimSession]) -> dict[str, Any]:
        capacity = split_pages(self.num_pages, dict(fractions))
        queues = {m: deque() for m in self.members}
        running: dict[str, list[_Req]] = {m: [] for m in self.members}
        used = {m: 0 for m in self.members}
        last_member: dict[int, tuple[str, int]] = {}        # session -> (member, cached tokens)
        events = [(s.arrival_s, i, 0) for i, s in enumerate(sessions)]
        heapq.heapify(events)
        counter = itertools.count()
        latencies: list[float] = []
        reroutes = preemptions = escalations = 0
        now, turn_index = 0.0, -1

        def submit(session: int, turn: int, at_s: float) -> None:
            nonlocal reroutes
            t = sessions[session].turns[turn]
            total = t.prompt_tokens + t.max_tokens
            member = self.placement(capacity, t.routed, total)
            if member is None:
                raise ValueError("infeasible split: a request no deployment can hold")
            reroutes += member != t.routed
            plan = list(t.spans) if t.spans and t.spans[0][0] == member else [(member, t.max_tokens)]
            first, rest = plan[0], plan[1:]
            req = _Req(session, turn, at_s, t.prompt_tokens, t.max_tokens, member, rest,
                       stop_at=min(t.max_tokens, first[1]) if rest else t.max_tokens, target=t.prompt_tokens)
            cached = last_member.get(session)
            if cached is not None and cached[0] == member:
                req.computed = min(cached[1], t.prompt_tokens - 1)
            queues[member].append(req)

        def need(req: _Req, member: str) -> int:
            return self.pages_for_tokens(member, req.prompt + req.generated + self.reserve_blocks * self.block_tokens[member])

        while True:
            while events and events[0][0] <= now:
                at_s, session, turn = heapq.heappop(events)
                submit(session, turn, at_s)
            for m in self.members:                              # FCFS admission per deployment
                while queues[m] and len(running[m]) < self.max_running:
                    req = queues[m][0]
                    pages = need(req, m)
                    if used[m] + pages > capacity[m] and running[m]:
                        break
                    queues[m].popleft()
                    req.pages, req.order = pages, next(counter)
                    used[m] += pages
                    running[m].append(req)
            busy = [m for m in self.members if running[m]]
            if not busy:
                if not events:
                    break
                now = max(now, events[0][0])
                continue
            turn_index = next(i for i in ((turn_index + k) % len(self.members) for k in range(1, len(self.members) + 1))
                              if self.members[i] in busy)
            m = self.members[turn_index]
            budget, tokens, done = self.max_batch_tokens, 0, []
            decoding = [r for r in running[m] if r.computed >= r.target]
            prefilling = [r for r in running[m] if r.computed < r.target]
            budget -= len(decoding)
            tokens += len(decoding)
            chunks = []
            for r in prefilling:
                if budget <= 0:
                    break
                n = min(r.target - r.computed, self.prefill_chunk_tokens, budget)
                chunks.append((r, n))
                budget -= n
                tokens += n
            now += self.step_s[m] * (1.0 + (tokens - 1) / PREFILL_TOKENS_PER_DECODE_STEP)
            produced = list(decoding)
            for r, n in chunks:
                r.computed += n
                if r.computed >= r.target:
                    produced.append(r)                          # the last prefill chunk samples a token
            preempted: set[int] = set()
            for r in produced:
                if id(r) in preempted:
                    continue
                r.generated += 1
                if r.first_token_s is None:
                    r.first_token_s = now
                grown = need(r, m)
                while used[m] - r.pages + grown > capacity[m]:
                    victim = max((v for v in running[m] if v is not r and v not in done), key=lambda v: v.order,
                                 default=None)
                    if victim is None:
                        break
                    running[m].remove(victim)
                    used[m] -= victim.pages
                    victim.pages, victim.computed = 0, 0            # recompute: prompt and tokens so far
                    victim.target = victim.prompt + victim.generated
                    queues[m].appendleft(victim)
                    preempted.add(id(victim))
                    preemptions += 1
                used[m] += grown - r.pages
                r.pages = grown
                if r.generated >= r.stop_at:
                    done.append(r)
            for r in done:
                if id(r) in preempted:
                    continue
                if r.generated < r.max_tokens and not self.holds(capacity, r.plan[0][0], r.prompt + r.max_tokens):
                    r.plan.clear()                              # skipped: that deployment would refuse it
                    r.stop_at = r.max_tokens
                    continue
                running[m].remove(r)
                used[m] -= r.pages
                r.pages = 0
                if r.generated >= r.max_tokens:
                    latencies.append((now - r.send_s) / r.max_tokens)
                    last_member[r.session] = (m, r.prompt + r.generated)
                    t = sessions[r.session].turns
                    if r.turn + 1 < len(t):
                        heapq.heappush(events, (now + t[r.turn + 1].think_s, r.session, r.turn + 1))
                    continue
                target, tokens_there = r.plan.pop(0)
                escalations += 1
                r.member, r.computed, r.target = target, 0, r.prompt + r.generated   # cold handover
                r.stop_at = min(r.max_tokens, r.generated + tokens_there) if r.plan else r.max_tokens
                queues[target].appendleft(r)
        mean = sum(latencies) / len(latencies) if latencies else None
        return {"mean_token_latency_s": mean, "num_requests": len(latencies), "reroutes": reroutes,
                "preemptions": preemptions, "escalations": escalations}


def candidate_splits(members: Sequence[str], grid: int = GRID) -> list[dict[str, float]]:
    """Every split in steps of 1/grid with each member at least 1/grid."""
    out = []
    for parts in itertools.product(range(1, grid), repeat=len(members) - 1):
        last = grid - sum(parts)
        if last >= 1:
            out.append({m: p / grid for m, p in zip(members, (*parts, last))})
    return out


def search_split(simulator: SplitSimulator, sessions_by_rate: Mapping[float, Sequence[SimSession]],
                 grid: int = GRID, extra: Sequence[Mapping[str, float]] = ()) -> dict[str, Any]:
    """Ranks every candidate (and `extra` splits) that needs no re-route by the model's mean token latency
    averaged over the rates, then those that need re-routes to a larger member only. Raises ValueError when no
    candidate lets every request run on its routed member or a larger one."""
    any_sessions = next(iter(sessions_by_rate.values()))
    candidates = [dict(c) for c in (*candidate_splits(simulator.members, grid), *extra)]
    unique = list({tuple(sorted(c.items())): c for c in candidates}.values())
    ranked = []
    for rule, upward in (("no re-route", False), ("re-routes to a larger member", True)):
        scored = []
        for split in unique:
            if any(split == e["split"] for e in ranked) or not simulator.feasible(split, any_sessions, upward=upward):
                continue
            per_rate = [simulator.run(split, sessions)["mean_token_latency_s"] for sessions in sessions_by_rate.values()]
            latencies = [x for x in per_rate if x is not None]
            scored.append({"split": split, "rule": rule,
                           "model_score_s": sum(latencies) / len(latencies) if latencies else float("inf")})
        ranked += sorted(scored, key=lambda e: e["model_score_s"])
    if not ranked:
        raise ValueError("no split lets every request run on its routed member or a larger one")
    return {"ranked": ranked, "num_candidates": len(unique), "grid": grid,
            "num_without_reroutes": sum(e["rule"] == "no re-route" for e in ranked),
            "model": (f"step of member m with n tokens = solo_decode_step_s[m] x (1 + (n - 1) / "
                      f"{PREFILL_TOKENS_PER_DECODE_STEP:g}); deployments take turns; see eval/baseline/split_search.py")}


def shortlist_report(search: Mapping[str, Any], shortlist: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The search as the JSON carries it: how many candidates, the ranking rule, the shortlist with the model's
    scores (labelled: they only rank)."""
    return {"num_candidates": search["num_candidates"], "num_ranked": len(search["ranked"]),
            "num_without_reroutes": search["num_without_reroutes"], "grid": search["grid"],
            "role": "shortlist only: the core's simulated pilot decides (baseline_split_rescore)",
            "model": search["model"], "shortlist": [dict(e) for e in shortlist]}


def sim_sessions(trace, pilot_records: Sequence[Any], routed_member) -> list[SimSession]:
    """The trace's sessions for the simulator: lengths and think times from the trace, the routed member
    from routed_member(prompt token ids) on the pilot's actual prompt (the dataset prompt when the pilot
    did not send that turn), escalation spans from the pilot's records."""
    by_key = {(r.session_id, r.turn_index): r for r in pilot_records}
    out = []
    for session, arrival in zip(trace.sessions, trace.arrival_times_s):
        turns = []
        for k, (turn, length) in enumerate(zip(session.turns, trace.prompt_lengths(session))):
            record = by_key.get((session.session_id, k))
            prompt_ids = record.prompt_token_ids if record is not None and record.prompt_token_ids else turn.prompt_token_ids
            spans: list[tuple[str, int]] = []
            if record is not None and record.ok and len(set(record.members)) > 1:
                order = list(dict.fromkeys(record.members))
                spans = [(m, record.tokens_by_member.get(m, 0)) for m in order if record.tokens_by_member.get(m, 0)]
            turns.append(SimTurn(prompt_tokens=length, max_tokens=turn.max_tokens, think_s=turn.think_time_s,
                                 routed=routed_member(prompt_ids), spans=spans))
        out.append(SimSession(arrival_s=arrival, turns=turns))
    return out
