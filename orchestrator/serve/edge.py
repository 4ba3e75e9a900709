"""The HTTP edge's per-server state (Edge) and its settings: what the routes and each generation share.

Its own module so the app factory (server.py) and the per-generation stream (edge_stream.py) both
depend on it without depending on each other.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from orchestrator.core.engine_api import ServingEngine
from orchestrator.core.family import FamilySpec
from orchestrator.serve.metrics import ServerMetrics
from orchestrator.serve.request_body import servable_body_bytes
from orchestrator.serve.request_fields import MAX_LOGIT_BIAS_ENTRIES
from orchestrator.serve.tokenizer import FamilyTokenizer


@dataclass(slots=True)
class ServerSettings:
    """Per-server knobs the HTTP routes enforce (the engine has its own config)."""

    api_key: str | None = None
    api_keys: tuple[str, ...] = ()             # more keys (each a tenant: its own cache salt and request limit)
    request_timeout_s: float | None = 600.0    # config.scheduler.request_timeout_s
    # requests in flight per API key (per client address without keys); 0 or None: no limit
    max_client_requests: int | None = 1024
    header_timeout_s: float = 10.0             # a request head must arrive within this (slowloris)
    max_header_bytes: int = 64 * 1024          # ... and within this size (431)
    limit_concurrency: int | None = 4096       # uvicorn: connections + tasks beyond this get a 503
    max_body_bytes: int = 4 * 2**20            # never more than the family's context can use (Edge.body_limit_bytes)
    body_timeout_s: float = 30.0               # the whole request body must arrive within this (slow senders)
    # a stream whose client has not taken a chunk for this long is cancelled (slow or stalled readers): the
    # request is aborted, its pages return and its buffered output is dropped
    stream_stall_s: float = 30.0
    # threads that parse and tokenize request bodies off the event loop. Few and fixed: each thread the tokenizer
    # runs on keeps native memory of its own (its malloc arena, its regex caches) that grows as prompts vary, so
    # asyncio's default executor (up to min(32, cores + 4) threads, created under bursts) made the HTTP process's
    # RSS creep (~7.6 MiB/hour in the 30-minute soak). Two, so that one client's long prompt (bounded by the text
    # limit) never holds up another client's parsing
    parse_threads: int = 2
    grace_s: float = 10.0                      # SIGTERM: in-flight requests get this long, then are cancelled
    node_name: str | None = None               # sent as X-MFS-Node on every response (fleet: which replica)
    metrics_need_key: bool = False             # /metrics behind the API key too (it is open by default)

    def keys(self) -> tuple[str, ...]:
        """Every accepted API key (none: the /v1 routes are open)."""
        return tuple(dict.fromkeys((*((self.api_key,) if self.api_key else ()), *self.api_keys)))


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
    parse_executor: ThreadPoolExecutor | None = None     # settings.parse_threads threads (parse_pool)

    def body_limit_bytes(self) -> int:
        """The body size refused from Content-Length: max_body_bytes, or less where no request the family's
        context can hold comes near it (request_body.servable_body_bytes)."""
        context = self.family.context_tokens()
        return min(self.settings.max_body_bytes, servable_body_bytes(
            self.tokenizer.max_prompt_chars(context), context, MAX_LOGIT_BIAS_ENTRIES))

    def parse_pool(self) -> ThreadPoolExecutor:
        """The executor request bodies are parsed and tokenized on (made on first use; the lifespan's end shuts
        it down)."""
        if self.parse_executor is None:
            self.parse_executor = ThreadPoolExecutor(max_workers=max(1, self.settings.parse_threads),
                                                     thread_name_prefix="mfs-parse")
        return self.parse_executor

    def close_parse_pool(self) -> None:
        executor, self.parse_executor = self.parse_executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def begin_drain(self) -> None:
        """SIGTERM: refuse new work and let the engine finish or cancel in-flight requests within grace_s,
        so open streams end with a final chunk before uvicorn's own shutdown timeout cuts them."""
        self.draining = True
        if self.loop is not None and self.stopping is None:
            def stop() -> None:
                self.stopping = asyncio.ensure_future(self.engine.stop(self.settings.grace_s))
            self.loop.call_soon_threadsafe(stop)
