"""The front balancers of the per-member peer deployment (`mfs bench --peer vllm`, eval/bench/peer_bench.py).

Each member of the family runs as its own server; a balancer in front picks one server per request, by the rule
MFS's separate-deployment baselines route by (eval/baseline/deployments.py), so both sides of the comparison see
the same routing:
- route: the smallest member whose complexity band holds the request's complexity (the core's
  Router.adequate_member on the core's estimator score of the prompt, or the trace's complexity hint);
- sticky (the session-sticky balancer only): a session's later turns go to the server of its first turn while
  that server can hold them (the core's SessionHomes, as the baselines keep sessions);
- placement: a server that cannot hold the request (prompt + max_tokens past its max_model_len, which its KV
  blocks bound) passes it to the smallest larger member's server that can, else the largest smaller one;
  the decision says so (rerouted_from). None can: the request is refused, as every server would refuse it.
Pure: no servers, no I/O. BalancedEngine puts a balancer in front of one engine per member.
"""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any

from orchestrator.core.complexity import ComplexityEstimator
from orchestrator.core.errors import InvalidRequestError
from orchestrator.core.router import Router, SessionHomes
from orchestrator.core.types import MemberName, Request, RequestId, RequestOutput, RouteDecision

BALANCERS = ("complexity", "sticky")


class ComplexityBalancer:
    """The reference's simple load balancer: every request routed on its own complexity, placed on a server
    that can hold it. limits: member -> the longest sequence (prompt + max_tokens) its server accepts."""

    sticky = False

    def __init__(self, router: Router, estimator: ComplexityEstimator, limits: Mapping[str, int]) -> None:
        self.router, self.estimator = router, estimator
        self.names: tuple[str, ...] = tuple(router.family.serving_names)
        missing = [m for m in self.names if m not in limits]
        if missing:
            raise ValueError(f"no server limit for member(s) {', '.join(missing)}")
        self.limits = dict(limits)
        self.num_reroutes = 0

    def complexity(self, request: Request) -> float:
        """As the core's scheduler reads it: the caller's hint, else the estimator's score of the prompt."""
        if request.complexity_hint is not None:
            return request.complexity_hint
        return self.estimator.score(request.prompt_token_ids)

    def holds(self, member: str, request: Request) -> bool:
        return len(request.prompt_token_ids) + request.sampling.max_tokens <= self.limits[member]

    def place(self, routed: str, request: Request) -> str | None:
        """routed if its server holds the request, else the smallest larger member's that does, else the largest
        smaller one's; None when no server can."""
        index = self.names.index(routed)
        return next((m for m in [*self.names[index:], *reversed(self.names[:index])] if self.holds(m, request)),
                    None)

    def route(self, request: Request) -> RouteDecision:
        """The server for `request` (a pinned request goes to its member's server unchecked)."""
        if request.pinned_member is not None:
            return self._decision(request, request.pinned_member, "pinned", 0.0)
        complexity = self.complexity(request)
        adequate = self.router.adequate_member(complexity)
        decision = self._decision(request, adequate, f"complexity {complexity:.3f}: {adequate}", complexity)
        decision = self._keep(decision, request)
        member = self.place(decision.member, request)
        if member is None:
            raise InvalidRequestError(f"no server can hold the request ({len(request.prompt_token_ids)} prompt + "
                                      f"{request.sampling.max_tokens} new tokens; max_model_len: {self.limits})",
                                      param="max_tokens")
        if member != decision.member:
            self.num_reroutes += 1
            decision = dataclasses.replace(decision, member=MemberName(member), rerouted_from=decision.member,
                                           reason=f"re-routed {decision.member}->{member} (server too small); "
                                                  f"{decision.reason}")
        self._remember(request, member)
        return decision

    def _keep(self, decision: RouteDecision, request: Request) -> RouteDecision:
        return decision

    def _remember(self, request: Request, member: str) -> None:
        pass

    @staticmethod
    def _decision(request: Request, member: str, reason: str, complexity: float) -> RouteDecision:
        return RouteDecision(request_id=RequestId(request.request_id), member=MemberName(member), reason=reason,
                             scores={}, components={}, matched_prefix_tokens={}, complexity=complexity)


class StickyBalancer(ComplexityBalancer):
    """Session-sticky: a session's first turn as the simple balancer places it; its later turns go to that
    server while it holds them (else routed and placed afresh, the home unchanged)."""

    sticky = True

    def __init__(self, router: Router, estimator: ComplexityEstimator, limits: Mapping[str, int]) -> None:
        super().__init__(router, estimator, limits)
        self.homes = SessionHomes()

    def _keep(self, decision: RouteDecision, request: Request) -> RouteDecision:
        return self.homes.keep(decision, request, self.holds)

    def _remember(self, request: Request, member: str) -> None:
        self.homes.remember(request, member)


def make_balancer(kind: str, router: Router, estimator: ComplexityEstimator,
                  limits: Mapping[str, int]) -> ComplexityBalancer:
    if kind not in BALANCERS:
        raise ValueError(f"unknown balancer {kind!r} (known: {', '.join(BALANCERS)})")
    return (StickyBalancer if kind == "sticky" else ComplexityBalancer)(router, estimator, limits)


class BalancedEngine:
    """The engine interface the bench's replay drives (eval/bench/driver.py: generate, stats), in front of one
    engine per member (eval/bench/http_engine.py HttpEngine: generate(request, model=, route=))."""

    def __init__(self, balancer: ComplexityBalancer, engines: Mapping[str, Any]) -> None:
        self.balancer, self.engines = balancer, dict(engines)

    def stats(self) -> dict[str, Any]:
        return {"counters": {"reroutes": self.balancer.num_reroutes}}

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        decision = self.balancer.route(request)
        async for out in self.engines[decision.member].generate(request, model=decision.member, route=decision):
            yield out
