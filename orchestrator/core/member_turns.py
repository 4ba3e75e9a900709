"""Token-level member scheduling on a shared device: which members' decodes run in a step.

When every member steps in every step, a small member's tokens wait behind the largest member's forward. Instead
each member steps at its own frequency f (a share of the steps; a member with prefill work steps at once, so time to
first token is not traded): a step lasts D = sum_i f_i c_i (c_i: member i's forward) and member i's tokens come
every D / f_i. The mean token latency over requests, sum_i w_i D / f_i (w_i: the rate requests arrive at member i),
is smallest at f_i proportional to sqrt(w_i / c_i) (a Lagrange condition), the largest stepping every time. Each
member's period is bounded by `max_slowdown` x sum_i c_i (every member in every step), its TPOT guard.

The scheduler sees the requests in flight, not arrival rates; Little's law links them: w_i / a_i = s_i x sum_r 1 / L_r
(a_i: tokens per step, s_i: the share of the steps member i has taken, a moving average; L_r: a request's max_tokens).
Counting the requests in flight instead would count a member's slowness again (the slower its tokens, the more of
its requests are in flight).

Only relative forward costs matter: the executor's estimate of each member's decode forward at its batch and
context once it offers one (which also prices what a forward costs beyond its weights), else weight bytes from the
member's shape (or a cost function given by the builder). A credit per member (credit += f each step; it steps at 1)
turns frequencies into steps.

With speculation, the drafts of all the members stepping together share one set of draft forwards (speculation.py),
so a drafting member whose credit has reached JOIN_CREDIT joins another drafting member's step, paying its turn in
advance: its frequency over time is unchanged, its steps fall where drafts are made anyway. With
riding_draft_member (an ablation's), a draft member whose decodes ride every draft forward steps in every step it
has decodes, and the frequencies are the others'. Pure: no clock, no I/O.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable

from orchestrator.core.config import MFSConfig
from orchestrator.core.family import FamilySpec, MemberSpec
from orchestrator.core.sequence import Sequence
from orchestrator.core.draft_length import StepCost
from orchestrator.core.types import ForwardShape, MemberName

# scheduler.member_turns for an independent family: no member's token period more than doubles. SIMULATED (Qwen3
# 1.7B/8B/32B on one H200, aiconfigurator, seed 0, 0.5 sessions/s: `mfs simulate --family qwen3-large --gpu
# h200_sxm --sessions 120 --rates 0.5 --systems mfs --set speculation.enabled=false --set scheduler.member_turns=G`):
# G = 1.5, 2, 3, 5 gave 15.6, 14.6, 14.2, 14.1 ms per token, G = 0 (every member in every step) 22.5
DEFAULT_MEMBER_TURNS = 2.0
# a drafting member joins another's drafting step once it has a quarter of its turn: SIMULATED (the 400-session
# trace at 6 sessions/s, seed 0, the draft member's decodes riding every draft forward): joining at 0.5, 0.25, 0.1
# gave 14.98, 15.06, 14.98 ms per token against 15.12 without (the three within one seed's noise)
JOIN_CREDIT = 0.25
# the moving average of a member's realized share of the steps: about the last 64 steps it had decodes in
STEP_SHARE_EMA = 1 / 64
# member, requests decoding on it -> the relative cost of its decode forward
ForwardCost = Callable[[str, int], float]


def shape_weight_bytes(member: MemberSpec) -> float:
    """Weights a decode forward reads, from the shape alone (attention and an MLP of about 3x the hidden size, the
    embedding and the output head); only the ratio between members matters here."""
    hidden = member.hidden_size
    attention = hidden * member.head_dim * (2 * member.num_heads + 2 * member.num_kv_heads)
    mlp = 3 * hidden * (3 * hidden)
    return float(member.num_layers * (attention + mlp) + 2 * member.vocab_size * hidden)


def member_turns_for(family: FamilySpec, config: MFSConfig, drafts_ride: bool, private_drafts: bool,
                     draft_member_every_step: bool) -> MemberTurns | None:
    """The member turns scheduler.member_turns asks for (unset: none for a nested family, DEFAULT_MEMBER_TURNS
    otherwise); None when every member steps in every step. drafts_ride: speculation's draft member decodes ride
    its draft forwards; private_drafts and draft_member_every_step: the builder's policies (SchedulerPolicies)."""
    turns = config.scheduler.member_turns
    if turns is None:
        turns = 0.0 if family.is_nested() else DEFAULT_MEMBER_TURNS
    if not turns:
        return None
    # targets' drafts share the draft member's forwards when their member batches share a step
    shared_drafts = config.speculation.enabled and not private_drafts
    riding = shared_drafts and drafts_ride and draft_member_every_step
    return MemberTurns(family, turns, shared_drafts=shared_drafts, riding_draft_member=riding)


class MemberTurns:
    """StepMembers (batching.py): every member with prefill work, and each decoding member at its frequency."""

    def __init__(self, family: FamilySpec, max_slowdown: float, cost: ForwardCost | None = None,
                 shared_drafts: bool = False, riding_draft_member: bool = False) -> None:
        """shared_drafts: the members above the draft member draft in shared forwards, so they join each other's
        steps (JOIN_CREDIT). riding_draft_member (with shared_drafts): the draft member steps whenever it has
        decodes, and the frequencies are the other members'."""
        if max_slowdown < 1.0:
            raise ValueError(f"scheduler.member_turns {max_slowdown}: a member's token period can only grow (>= 1)")
        self.max_slowdown = max_slowdown
        self.draft_member = family.members[0].name if shared_drafts else None
        self.riding_member = self.draft_member if riding_draft_member else None
        shape_bytes: dict[str, float] = {m.name: shape_weight_bytes(m) for m in family.members}
        self.cost: ForwardCost = cost or (lambda member, _n: shape_bytes[member])
        self.credit: dict[str, float] = {m.name: 0.0 for m in family.members}
        self.step_share: dict[str, float] = {m.name: 1.0 for m in family.members}
        self.estimate: StepCost | None = None

    def use_step_cost(self, estimate: StepCost | None) -> None:
        """The executor's step-cost estimate prices each member's decode forward (None: the cost function)."""
        self.estimate = estimate

    def frequencies(self, weights: dict[str, float], batch: dict[str, int] | None = None,
                    costs: dict[str, float] | None = None) -> dict[str, float]:
        """Each decoding member's share of the steps (the largest is 1), its period within the guard. weights: per
        member, the rate its requests arrive at (relative); batch: the requests decoding on it (for the cost);
        costs: per member, its forward's cost (None: the cost function's)."""
        batch = batch or {}
        if costs is None:
            costs = {m: self.cost(m, batch.get(m, 0)) for m in weights}
        costs = {m: max(costs[m], 1e-12) for m in weights}
        raw = {m: math.sqrt(w / costs[m]) for m, w in weights.items()}
        top = max(raw.values())
        freq = {m: r / top for m, r in raw.items()}
        bound = self.max_slowdown * sum(costs.values())      # the longest period a member may see
        guarded: set[str] = set()
        for _ in range(len(freq)):
            # Guarded members step just often enough: f_g = D / bound, so D = A + D * C_g / bound
            free_work = sum(freq[m] * costs[m] for m in freq if m not in guarded)
            guarded_cost = sum(costs[m] for m in guarded)
            step = (free_work / (1.0 - guarded_cost / bound) if guarded_cost < bound else math.inf)
            for m in guarded:
                freq[m] = min(1.0, step / bound)
            if step / bound >= 1.0:
                step = free_work + guarded_cost
            late = {m for m in freq if m not in guarded and step / freq[m] > bound * (1.0 + 1e-9)}
            if not late:
                break
            guarded |= late
        return freq

    def select(self, running: Iterable[Sequence]) -> Iterable[Sequence]:
        candidates = list(running)
        decoding: dict[str, int] = {}
        per_length: dict[str, float] = {}       # sum over the member's decoding requests of 1 / length
        context: dict[str, int] = {}            # sum over the member's decoding requests of their context
        prefilling: set[str] = set()
        priced = self.estimate is not None
        for seq in candidates:
            if seq.is_decoding():
                decoding[seq.member] = decoding.get(seq.member, 0) + 1
                length = max(1, seq.request.sampling.max_tokens)
                per_length[seq.member] = per_length.get(seq.member, 0.0) + 1.0 / length
                if priced:
                    context[seq.member] = context.get(seq.member, 0) + seq.num_computed_tokens
            else:
                prefilling.add(seq.member)
        if len(decoding) + len(prefilling - decoding.keys()) <= 1:
            self._took(decoding, decoding.keys())
            return candidates                   # one member has work: it steps
        stepping = set(prefilling)
        riding = self.riding_member
        if riding is not None and riding in decoding:
            stepping.add(riding)                # it steps every step; the frequencies are the others'
            del per_length[riding]
        costs = self._estimated_costs(decoding, context, per_length) if priced and per_length else None
        freq = (self.frequencies({m: w * self.step_share[m] for m, w in per_length.items()}, decoding, costs)
                if per_length else {})
        for member, f in freq.items():
            self.credit[member] += f
            if self.credit[member] >= 1.0 - 1e-9 or member in prefilling:
                self.credit[member] = max(0.0, self.credit[member] - 1.0)
                stepping.add(member)
        draft_member = self.draft_member
        if draft_member is not None and any(m != draft_member for m in stepping):
            for member in freq:
                if member not in stepping and member != draft_member and self.credit[member] >= JOIN_CREDIT:
                    self.credit[member] -= 1.0
                    stepping.add(member)
        self._took(decoding, stepping)
        return [seq for seq in candidates if seq.member in stepping]

    def _estimated_costs(self, decoding: dict[str, int], context: dict[str, int],
                         members: Collection[str]) -> dict[str, float] | None:
        """Per member, the estimate of its decode forward (its requests at their mean context). None when one has
        no figure yet: seconds and bytes do not mix."""
        estimate = self.estimate
        assert estimate is not None
        costs: dict[str, float] = {}
        for member in members:
            n = decoding[member]
            mean_context = context[member] // n
            cost = estimate([ForwardShape(MemberName(member), (mean_context,) * n, (), ())])
            if cost is None:
                return None
            costs[member] = cost
        return costs

    def _took(self, decoding: Collection[str], stepping: Collection[str]) -> None:
        """Each member with decodes: whether it stepped, into its realized share of the steps."""
        for member in decoding:
            self.step_share[member] += STEP_SHARE_EMA * ((member in stepping) - self.step_share[member])
