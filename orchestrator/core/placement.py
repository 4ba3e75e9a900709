"""Placement: whether a request fits the pool at intake, where a routed request finally runs, whether it may escalate.

MFS has one pool: every member can take every request its capacity holds, so routing's choice stands and every
escalation target is open. Another placement (eval's independent deployments, each on its own slice) may move
a request to another member (RouteDecision.rerouted_from says so) or refuse an escalation. Pure core.
"""
from __future__ import annotations

from typing import Protocol

from orchestrator.core.errors import InvalidRequestError
from orchestrator.core.family import FamilySpec
from orchestrator.core.kv_cache import KVCacheManager
from orchestrator.core.sequence import Sequence
from orchestrator.core.types import Request, RouteDecision


def misfit(family: FamilySpec, kv: KVCacheManager, capacity_pages: dict[str, int], member: str,
           request: Request) -> tuple[str, str] | None:
    """Why `member` cannot hold the request whole (context, pages): message and field, or None. Not an exception:
    one kept in a local and raised holds its frame in a cycle (traceback -> frame -> local) only gc frees."""
    prompt_tokens = len(request.prompt_token_ids)
    context_tokens = family.member(member).context_tokens
    if prompt_tokens >= context_tokens:
        return f"prompt has {prompt_tokens} tokens; member {member} holds {context_tokens}", "prompt"
    pages = kv.pages_for_tokens(member, prompt_tokens + request.sampling.max_tokens)
    if pages > capacity_pages[member]:
        return (f"request needs {pages} KV pages on {member}; the pool can give it at most {capacity_pages[member]}",
                "max_tokens")
    return None


def check_fits(family: FamilySpec, kv: KVCacheManager, capacity_pages: dict[str, int], request: Request) -> None:
    """Every member the request may run on (escalation included) can hold it whole; else InvalidRequestError."""
    for name in [request.pinned_member] if request.pinned_member else family.serving_names:
        why = misfit(family, kv, capacity_pages, name, request)
        if why is not None:
            raise InvalidRequestError(*why)


class Placement(Protocol):
    def check_fits(self, request: Request) -> None: ...
    def holds(self, member: str, request: Request) -> bool: ...
    def place(self, decision: RouteDecision, request: Request) -> RouteDecision: ...
    def accepts_escalation(self, seq: Sequence) -> bool: ...
    def warms_up(self, member: str) -> bool: ...


class SharedPoolPlacement:
    """One pool for the family: a request runs where routing sends it, and may escalate anywhere."""

    def __init__(self, family: FamilySpec, kv: KVCacheManager, capacity_pages: dict[str, int]) -> None:
        self.family = family
        self.kv = kv
        self.capacity_pages = capacity_pages

    def check_fits(self, request: Request) -> None:
        check_fits(self.family, self.kv, self.capacity_pages, request)

    def holds(self, member: str, request: Request) -> bool:
        return misfit(self.family, self.kv, self.capacity_pages, member, request) is None

    def place(self, decision: RouteDecision, request: Request) -> RouteDecision:
        return decision

    def accepts_escalation(self, seq: Sequence) -> bool:
        return True

    def warms_up(self, member: str) -> bool:
        """A warm-up prefill for `member` here would be read here (its escalations continue on this pool)."""
        return True
