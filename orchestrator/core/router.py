"""Routes a request to one family member by scoring complexity fit, cache affinity and load."""
from __future__ import annotations

import bisect
import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.core.config import RouterConfig, RouterWeights
from orchestrator.core.family import FamilySpec
from orchestrator.core.types import MemberName, Request, RouteDecision

SESSION_BONUS_INDEPENDENT = 0.2   # router.session_bonus: null means this for independent families, 0 for nested


@dataclass(frozen=True, slots=True)
class MemberLoad:
    """What one member is doing now (the scheduler's view)."""

    num_running: int
    num_waiting: int
    running_tokens: int       # prompt + generated tokens of its running requests
    queued_tokens: int        # prompt tokens of requests waiting for it
    expected_delay_s: float = 0.0   # expected wait before this request could be admitted there (scheduler's estimate)
    pool_pressure: float = 0.0      # share of its pool's pages held or reserved by running requests
    pages_per_token: float = 0.0    # KV pages one token costs on this member
    escalation_rate: float = 0.0    # recent share of its requests that escalated out (EscalationRates)

    @property
    def total_tokens(self) -> int:
        return self.running_tokens + self.queued_tokens


_IDLE = MemberLoad(0, 0, 0, 0)


class SessionAffinity:
    """Session id -> the member that answered its last turn (the router's session bonus), LRU-bounded."""

    __slots__ = ("max_sessions", "_members")

    def __init__(self, max_sessions: int = 10000):
        self.max_sessions = max_sessions
        self._members: OrderedDict[str, MemberName] = OrderedDict()

    def __len__(self) -> int:
        return len(self._members)

    def get(self, session_id: str) -> MemberName | None:
        return self._members.get(session_id)

    def record(self, session_id: str, member: str) -> None:
        self._members[session_id] = MemberName(member)
        self._members.move_to_end(session_id)
        if len(self._members) > self.max_sessions:
            self._members.popitem(last=False)


class SessionHomes(SessionAffinity):
    """Session id -> the member that served its first turn (router.sticky_sessions): later turns go there while it
    holds them, as a front balancer with session affinity keeps a conversation on its server. LRU-bounded."""

    __slots__ = ()

    def __init__(self, max_sessions: int = 1 << 16) -> None:
        super().__init__(max_sessions)

    def keep(self, decision: RouteDecision, request: Request, holds: Callable[[str, Request], bool]) -> RouteDecision:
        """The session's home instead of the routed member while holds(home, request)."""
        session = request.session_id
        home = self._members.get(session) if session else None
        if session is None or home is None or home == decision.member or request.pinned_member is not None \
                or not holds(home, request):
            return decision
        self._members.move_to_end(session)
        return dataclasses.replace(decision, member=home, reason=f"session kept on {home}; {decision.reason}")

    def remember(self, request: Request, member: str) -> None:
        """The first turn's (placed) member becomes the session's home."""
        session = request.session_id
        if session and session not in self._members and request.pinned_member is None:
            self.record(session, member)


@dataclass(frozen=True, slots=True)
class FitPenalties:
    """Shape of the complexity-fit component (RouterConfig has no knobs for it yet).

    fit(member) = 1 for the smallest adequate member, minus `smaller_per_step` per size step below it
    (too weak: answers get worse) or `larger_per_step` per step above it (adequate but slower and
    dearer). Smaller is penalised much harder than larger.
    """

    smaller_per_step: float = 0.6
    larger_per_step: float = 0.15
    tie_epsilon: float = 1e-9    # totals closer than this count as a tie (the smaller member wins)


class Router:
    """Scores every member and picks one; every component lands in the RouteDecision so it can be explained.

    total(member) = w.complexity * fit + w.affinity * cached_fraction + session - w.load * load_fraction - pressure
      fit             see FitPenalties (thresholds from config.complexity_thresholds)
      cached_fraction matched_prefix_tokens[member] / prompt tokens, 0 below config.affinity_min_tokens
      session         config.session_bonus for the session's last member
      load_fraction   min(1, max((running + queued tokens) / config.load_saturation_tokens,
                                 expected_delay_s / config.delay_saturation_s)); 0 unless load_in_score
      pressure        config.pressure_weight * pool_pressure * pages_per_token / the largest pages_per_token
    use_affinity=False zeroes affinity and session, use_load=False load and pressure (eval's blind router).
    components[member] holds the weighted parts (load and pressure negative), summing to scores[member]. The
    highest total wins, ties go to the smaller member. A saturated or busy winner may then be downgraded (profile
    allow_downgrade, use_load): _downgrade_target, _delay_downgrade_target.
    """

    __slots__ = ("family", "config", "fit", "_names", "_num_members", "_thresholds", "session_bonus", "use_affinity",
                 "use_load", "load_in_score")

    def __init__(self, family: FamilySpec, config: RouterConfig, fit: FitPenalties | None = None, *,
                 use_affinity: bool = True, use_load: bool = True) -> None:
        if not family.members:
            raise ValueError(f"family {family.name!r} has no members to route to")
        self.family = family
        self.config = config
        self.fit = fit or FitPenalties()
        self.use_affinity = use_affinity
        self.use_load = use_load
        self._names: tuple[str, ...] = tuple(family.serving_names)    # a drafts_only member takes no request
        self._num_members = len(self._names)
        self._thresholds = tuple(config.complexity_thresholds)
        # Nested family: a smaller member already reuses the larger one's lower-layer pages, so pulling
        # a follow-up turn to the session's last (often larger) member buys little and costs its step time.
        self.session_bonus = (config.session_bonus if config.session_bonus is not None
                              else 0.0 if family.is_nested() else SESSION_BONUS_INDEPENDENT)
        self.load_in_score = config.load_in_score if config.load_in_score is not None else family.is_nested()

    def adequate_index(self, complexity: float) -> int:
        """Index of the smallest member whose complexity band holds `complexity` (thresholds are lower bounds)."""
        return min(bisect.bisect_right(self._thresholds, complexity), self._num_members - 1)

    def adequate_member(self, complexity: float) -> str:
        return self._names[self.adequate_index(complexity)]

    def weights(self, request: Request) -> RouterWeights:
        """The request's profile's weights, or the configured profile's when the config does not name it."""
        profiles = self.config.profiles
        weights = profiles.get(request.profile.value)
        return weights if weights is not None else profiles[self.config.profile]

    def route(self, request: Request, *, complexity: float, matched_prefix_tokens: dict[str, int],
              loads: dict[str, MemberLoad], session_member: str | None) -> RouteDecision:
        """One decision."""
        config, fit = self.config, self.fit
        weights = self.weights(request)
        names = self._names
        adequate = self.adequate_index(complexity)
        prompt_tokens = max(1, len(request.prompt_token_ids))
        saturation_tokens = max(1, config.load_saturation_tokens)
        use_affinity, use_load = self.use_affinity, self.use_load

        scores: dict[str, float] = {}
        components: dict[str, dict[str, float]] = {}
        best_index, best_total = 0, float("-inf")
        max_ppt = max((loads.get(n, _IDLE).pages_per_token for n in names), default=0.0) or 1.0
        for index, name in enumerate(names):
            steps = index - adequate
            if steps >= 0:
                fit_value = 1.0 - fit.larger_per_step * steps
            else:
                fit_value = 1.0 + fit.smaller_per_step * steps
            complexity_part = weights.complexity * fit_value
            affinity_part = session_part = load_part = pressure_part = 0.0
            if use_affinity:
                matched = matched_prefix_tokens.get(name, 0)
                if matched >= config.affinity_min_tokens:
                    affinity_part = weights.affinity * min(1.0, matched / prompt_tokens)
                if name == session_member:
                    session_part = self.session_bonus
            if use_load:
                load = loads.get(name, _IDLE)
                if self.load_in_score:
                    fraction = max((load.running_tokens + load.queued_tokens) / saturation_tokens,
                                   load.expected_delay_s / config.delay_saturation_s)
                    load_part = -weights.load * min(1.0, fraction)
                pressure_part = -config.pressure_weight * load.pool_pressure * load.pages_per_token / max_ppt
            total = complexity_part + affinity_part + session_part + load_part + pressure_part
            scores[name] = total
            components[name] = {"complexity": complexity_part, "affinity": affinity_part,
                                "load": load_part, "session": session_part, "pressure": pressure_part}
            if total > best_total + fit.tie_epsilon:   # strict: ties keep the smaller member
                best_index, best_total = index, total

        winner = names[best_index]
        reason = f"complexity {complexity:.2f} -> {names[adequate]}"
        if best_index != adequate:
            reason += "; " + self._why_not_adequate(names[adequate], winner, components, matched_prefix_tokens, loads)
        elif components[winner]["affinity"] > 0.0:
            reason += f" ({matched_prefix_tokens.get(winner, 0)} cached tokens)"

        downgraded_from = None
        if request.pinned_member is not None:
            if request.pinned_member not in scores and request.pinned_member in self.family.member_names:
                raise ValueError(f"member {request.pinned_member!r} of family {self.family.name!r} only drafts for "
                                 f"the larger members; requests go to {', '.join(names)}")
            if request.pinned_member not in scores:
                raise ValueError(f"pinned member {request.pinned_member!r} is not in family "
                                 f"{self.family.name!r} (members: {', '.join(names)})")
            winner, reason = request.pinned_member, "pinned"
        elif use_load and weights.allow_downgrade:
            target = self._downgrade_target(best_index, loads, saturation_tokens)
            why = None
            if target is not None:
                tokens = loads.get(winner, _IDLE).total_tokens
                why = f"{winner} saturated ({tokens} >= {config.load_saturation_tokens} tokens)"
            else:
                target = self._delay_downgrade_target(best_index, complexity, loads)
                if target is not None:
                    load = loads.get(winner, _IDLE)
                    trigger = config.downgrade_delay_s
                    if load.expected_delay_s >= trigger:
                        why = f"{winner} expected wait {load.expected_delay_s * 1000:.0f} ms >= {trigger * 1000:.0f} ms"
                    else:
                        why = f"{winner} runs {load.num_running} >= {config.downgrade_running} requests"
                    why += f", {names[target]} within the complexity gap"
            if target is not None:
                reason += f"; {why}, downgraded to {names[target]}"
                downgraded_from, winner = MemberName(winner), names[target]

        return RouteDecision(
            request_id=request.request_id, member=MemberName(winner), reason=reason, scores=scores,
            components=components, matched_prefix_tokens=dict(matched_prefix_tokens), complexity=complexity,
            downgraded_from=downgraded_from)

    # ------------------------------------------------------------------------- internals
    def _downgrade_target(self, winner_index: int, loads: dict[str, MemberLoad], saturation_tokens: int) -> int | None:
        """Largest smaller member that is not saturated, when the winner is; else None."""
        names = self._names
        if loads.get(names[winner_index], _IDLE).total_tokens < saturation_tokens:
            return None
        for index in range(winner_index - 1, -1, -1):
            load = loads.get(names[index], _IDLE)
            if load.total_tokens < saturation_tokens and self._stays(load):
                return index
        return None   # everyone is saturated (or would send it back): stay put, the queue absorbs it

    def _stays(self, load: MemberLoad) -> bool:
        """Whether a request downgraded into this member is likely to stay there (escalation guard)."""
        limit = self.config.downgrade_max_escalation_rate
        return limit is None or load.escalation_rate <= limit

    def _delay_downgrade_target(self, winner_index: int, complexity: float,
                                loads: dict[str, MemberLoad]) -> int | None:
        """Largest smaller member whose expected delay is under the trigger, when the winner's is not and
        the request's complexity is at most downgrade_max_gap above that member's band (else None)."""
        config, names = self.config, self._names
        winner = loads.get(names[winner_index], _IDLE)
        busy = config.downgrade_running is not None and winner.num_running >= config.downgrade_running
        slow = winner.expected_delay_s >= config.downgrade_delay_s
        if not busy and not slow:
            return None
        for index in range(winner_index - 1, -1, -1):
            band_top = self._thresholds[index] if index < len(self._thresholds) else 1.0
            if complexity - band_top > config.downgrade_max_gap:
                return None          # smaller ones are further below: the guard only tightens
            load = loads.get(names[index], _IDLE)
            # The escalation guard is for downgrades that avoid a wait: a request that escalates back waits
            # for the larger member anyway. One that avoids the busy member's step (running count) keeps
            # the tokens it made on the smaller member when it escalates, so it is not held back.
            if load.expected_delay_s < config.downgrade_delay_s and (not slow or self._stays(load)):
                return index
        return None

    @staticmethod
    def _why_not_adequate(adequate: str, winner: str, components: dict[str, dict[str, float]],
                          matched_prefix_tokens: dict[str, int], loads: dict[str, MemberLoad]) -> str:
        """Names the component that moved the decision away from the adequate member."""
        won, lost = components[winner], components[adequate]
        gains = {key: won[key] - lost[key] for key in ("affinity", "session", "load")}
        key = max(gains, key=gains.__getitem__)
        if gains[key] <= 0.0:
            return f"{winner} scored highest"
        if key == "affinity":
            return f"{matched_prefix_tokens.get(winner, 0)} cached tokens on {winner} outweighed it"
        if key == "session":
            return f"the session's last member {winner} outweighed it"
        return f"{adequate} is loaded ({loads.get(adequate, _IDLE).total_tokens} tokens), {winner} chosen"
