"""The two engine-facing interfaces: a step executor (local engine) and a serving engine (what the server calls).

Structural Protocols only; implementations live in engines/ (executors) and orchestrator/ (serving).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from orchestrator.core.types import (FinishReason, ForwardShape, PageId, Request, RequestId, RequestOutput,
                                     SampledToken, StepPlan)


class StepExecutor(Protocol):
    """Runs the core's step plans on ONE page arena (the local engine, or a fake in tests).

    Owns tensors only; every decision (which pages, which tokens, which layers) comes in the plan.
    """

    num_pages: int
    page_bytes: int

    def execute(self, plan: StepPlan) -> list[SampledToken]:
        """Release plan.released_requests, run every batch (page loads already written), sample, return the sampled
        tokens in chunk order; raises RequestFault when some requests' own work failed (the others' done)."""
        ...

    def read_page(self, page: PageId) -> bytes: ...

    def write_page(self, page: PageId, data: bytes) -> None: ...

    def release(self, request_ids: Sequence[RequestId]) -> None:
        """Forget per-request state (sampler generators)."""
        ...


class StepCostEstimator(Protocol):
    """What an executor that can price a step offers the core: the seconds a step of these forwards would take,
    draft forwards first (the simulator from its cost model; the local engine from a fit of its own measured
    steps, None until it has measured enough). Speculation chooses its draft length with it; an executor without
    it gets the configured fixed length."""

    def estimate_step_s(self, forwards: Sequence[ForwardShape]) -> float | None: ...

    def estimate_error(self) -> float:
        """How far an estimate may be off, relative to the step (0: a cost model; a fit: its residual error):
        speculation drafts only where the saving is larger."""
        ...


class ServingEngine(Protocol):
    """Request-level interface the HTTP server and the bench drive: local loop or Triton-backed."""

    family_name: str
    member_names: list[str]        # small to large

    async def start(self) -> None: ...

    async def stop(self, grace_s: float = 5.0) -> None: ...

    def is_ready(self) -> bool: ...

    def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Streams incremental outputs; the last one has finished=True. Cancelling the iterator
        (or calling abort) cancels the request at the next step and returns its pages."""
        ...

    def abort(self, request_id: RequestId, finish_reason: FinishReason | None = None) -> None:
        """Ends a request at the next step and returns its pages. finish_reason STOP means the edge
        found a stop string (a normal finish); None means cancelled."""
        ...

    def stats(self) -> dict[str, Any]:
        """A JSON-able snapshot (orchestrator.core.events.Stats.snapshot; docs/ARCHITECTURE.md, Stats snapshot)."""
        ...
