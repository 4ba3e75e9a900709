"""The HTTP edge's per-server state (Edge) and its settings: what the routes and each generation share.

Its own module so the app factory (server.py) and the per-generation stream (edge_stream.py) both
depend on it without depending on each other.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from orchestrator.core.engine_api import ServingEngine
from orchestrator.core.family import FamilySpec
from orchestrator.serve.metrics import ServerMetrics
from orchestrator.serve.tokenizer import FamilyTokenizer


@dataclass(slots=True)
class ServerSettings:
    """Per-server knobs the HTTP routes enforce (the engine has its own config)."""

    api_key: str | None = None
    request_timeout_s: float | None = 600.0    # config.scheduler.request_timeout_s
    max_body_bytes: int = 4 * 2**20
    body_timeout_s: float = 30.0               # the whole request body must arrive within this (slow senders)
    # a stream whose client has not taken a chunk for this long is cancelled (slow or stalled readers): the
    # request is aborted, its pages return and its buffered output is dropped
    stream_stall_s: float = 30.0
    grace_s: float = 10.0                      # SIGTERM: in-flight requests get this long, then are cancelled
    node_name: str | None = None               # sent as X-MFS-Node on every response (fleet: which replica)


@dataclass(slots=True)
class Edge:
    """What one running server shares between its routes and its in-flight generations."""

    engine: ServingEngine
    tokenizer: FamilyTokenizer
    family: FamilySpec
    settings: ServerSettings
    metrics: ServerMetrics
    draining: bool = False                     # set on SIGTERM: refuse new generations
    loop: asyncio.AbstractEventLoop | None = None
    stopping: asyncio.Future | None = None

    def begin_drain(self) -> None:
        """SIGTERM: refuse new work and let the engine finish or cancel in-flight requests within grace_s,
        so open streams end with a final chunk before uvicorn's own shutdown timeout cuts them."""
        self.draining = True
        if self.loop is not None and self.stopping is None:
            def stop() -> None:
                self.stopping = asyncio.ensure_future(self.engine.stop(self.settings.grace_s))
            self.loop.call_soon_threadsafe(stop)
