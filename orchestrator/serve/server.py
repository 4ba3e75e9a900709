"""The OpenAI-compatible HTTP edge (`mfs serve`): app factory, routes, SSE streaming, lifecycle and CLI."""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from orchestrator.serve.api_schema import error_body, models_list, parse_request
from orchestrator.serve.openapi_models import ChatCompletionRequest, CompletionRequest, request_body
from orchestrator.serve.request_body import BodyLimits, BodyTimeoutError, read_json_body
from orchestrator.serve.request_fields import ignored_header
from orchestrator.serve import gateway_headers
from orchestrator.serve.edge import Edge, ServerSettings
from orchestrator.serve.edge_stream import ClientGone, Generation, SSEResponse, unless_disconnected
from orchestrator.core.engine_api import ServingEngine
from orchestrator.core.errors import (AuthenticationError, EngineUnavailableError, InvalidRequestError, MFSError,
                                      PayloadTooLargeError, QueueFullError)
from orchestrator.serve.client_limits import TENANT_STATE_KEY, ClientLimits, header_limited_protocol, matching_key
from orchestrator.core.family import FamilySpec
from orchestrator.serve.metrics import CONTENT_TYPE, ServerMetrics, StatsCache
from orchestrator.serve.tokenizer import FamilyTokenizer, IncrementalDecoder

log = logging.getLogger("mfs.server")
ENGINE_DIED_EXIT = 3      # `mfs serve`'s exit status when its engine process died: the supervisor restarts it
_KNOWN_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/stats", "/health", "/metrics",
                 "/openapi.json"}


def create_app(engine: ServingEngine, tokenizer: FamilyTokenizer, family: FamilySpec,
               settings: ServerSettings) -> FastAPI:
    edge = Edge(engine, tokenizer, family, settings, ServerMetrics(engine.stats))
    app = FastAPI(title="MFS", lifespan=_lifespan(edge), docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.edge = edge
    # /metrics and /v1/stats read engine snapshots through one cache: a scrape flood costs the engine at most a
    # snapshot per StatsCache.min_interval_s and never blocks the loop on a round trip
    app.state.stats_cache = stats_cache = StatsCache.for_engine(engine)
    app.include_router(_v1_routes(edge, int(time.time()), stats_cache))
    _add_probe_routes(app, edge, stats_cache)
    _exact_request_schemas(app)
    _install_error_handlers(app)
    app.add_middleware(ClientLimits, api_keys=settings.keys(), max_client_requests=settings.max_client_requests,
                       max_body_bytes=edge.body_limit_bytes())
    app.add_middleware(_ResponseCounter, metrics=edge.metrics, node_name=settings.node_name,
                       boot_id=uuid.uuid4().hex[:12])
    return app


def _lifespan(edge: Edge):
    """Starts the engine with the app; on shutdown waits for a drain SIGTERM began, then stops it."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        edge.loop = asyncio.get_running_loop()
        await edge.engine.start()
        try:
            yield
        finally:
            if edge.stopping is not None:
                await edge.stopping
            await edge.engine.stop(edge.settings.grace_s)    # idempotent; finishes what a drain started
            edge.close_parse_pool()
    return lifespan


def _authorizer(settings: ServerSettings):
    keys = settings.keys()

    async def authorize(request: HTTPRequest) -> None:
        if keys and matching_key(request.headers.get("authorization"), keys) is None:
            raise AuthenticationError("missing or incorrect API key (Authorization: Bearer KEY)")
    return authorize


def _v1_routes(edge: Edge, created_s: int, stats_cache: StatsCache) -> APIRouter:
    """/v1: the two generation endpoints, the model list and the stats snapshot, behind the API key."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_authorizer(edge.settings))])

    @v1.post("/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: HTTPRequest) -> Response:
        return await _generate(edge, "completion", request)

    @v1.post("/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: HTTPRequest) -> Response:
        return await _generate(edge, "chat", request)

    @v1.get("/models")
    async def models() -> dict:
        return models_list(edge.family, created_s)

    @v1.get("/stats")
    async def stats() -> dict:
        return await stats_cache.snapshot()

    return v1


def _exact_request_schemas(app: FastAPI) -> None:
    """/openapi.json with the request bodies' schemas as pydantic writes them: FastAPI's OpenAPI model holds a
    bound as a float, which turned `seed`'s 2^64 - 1 (and the other integer bounds) into 2^64, a value the server
    refuses."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = generate()
            for path, model in (("/v1/completions", CompletionRequest),
                                ("/v1/chat/completions", ChatCompletionRequest)):
                document["paths"][path]["post"].update(request_body(model))
        return app.openapi_schema
    app.openapi = openapi


def _add_probe_routes(app: FastAPI, edge: Edge, stats_cache: StatsCache) -> None:
    """/health (503 while starting or draining) and /metrics (Prometheus), open without the API key (/metrics
    behind it with ServerSettings.metrics_need_key)."""
    @app.get("/health")
    async def health() -> Response:
        problem = getattr(edge.engine, "health_problem", lambda: None)()   # a stalled or failing engine
        ready = edge.engine.is_ready() and not edge.draining and problem is None
        state = "ok" if ready else ("draining" if edge.draining else "unhealthy" if problem else "starting")
        body = {"status": state, "family": edge.family.name}
        if problem and not edge.draining:
            body["reason"] = problem
        return JSONResponse(body, status_code=200 if ready else 503)

    guard = [Depends(_authorizer(edge.settings))] if edge.settings.metrics_need_key else []

    @app.get("/metrics", dependencies=guard)
    async def metrics() -> Response:
        reading = await stats_cache.read()
        return Response(reading.render(edge.metrics), media_type=CONTENT_TYPE)


async def _generate(edge: Edge, kind: str, request: HTTPRequest) -> Response:
    """One completion or chat request: SSE when it streams, one JSON body otherwise; 499 if the client left."""
    if edge.draining:
        raise EngineUnavailableError("server is shutting down")
    settings = edge.settings
    try:
        body = await read_json_body(request, BodyLimits(max_bytes=edge.body_limit_bytes(),
                                                        read_timeout_s=settings.body_timeout_s))
    except ClientDisconnect:
        return Response(status_code=499)      # the client left while sending its body: nobody reads an answer
    # Behind the fleet gateway the session arrives as its routing key and dropped body fields as headers.
    body = gateway_headers.restore_lifted(body, request.headers)
    session_id = gateway_headers.replica_session_id(request.headers)
    tenant = request.scope.get("state", {}).get(TENANT_STATE_KEY)     # the API key's digest (ClientLimits)
    # In a worker thread: rendering the chat template and tokenizing take time in proportion to the prompt, and the
    # tokenizers library releases the GIL while it encodes, so the loop goes on streaming other answers meanwhile.
    # The edge's own few threads (ServerSettings.parse_threads), not asyncio's default executor: see there.
    parsed = await asyncio.get_running_loop().run_in_executor(edge.parse_pool(), functools.partial(
        parse_request, kind, body, tokenizer=edge.tokenizer, family=edge.family, session_id=session_id,
        tenant=tenant))
    gen = Generation(edge, parsed, IncrementalDecoder(edge.tokenizer, parsed.stop_strings))
    try:
        if parsed.stream:
            first = await unless_disconnected(request, gen.next_delta())
            return SSEResponse(gen, first, ignored_header(parsed.ignored_fields), settings.stream_stall_s)

        async def run_to_end() -> None:
            while not gen.done:
                await gen.next_delta()
        await unless_disconnected(request, run_to_end())
        return JSONResponse(gen.response(), headers=ignored_header(parsed.ignored_fields))
    except ClientGone:
        await gen.close()
        return Response(status_code=499)      # nobody reads it; nginx's "client closed request"
    except BaseException:
        await gen.close()
        raise
    finally:
        if not parsed.stream:
            await gen.close()


def _error_response(exc: MFSError) -> JSONResponse:
    headers = {}
    if isinstance(exc, QueueFullError):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    if isinstance(exc, (BodyTimeoutError, PayloadTooLargeError)):
        headers["Connection"] = "close"         # the rest of the body is not read: the connection cannot go on
    return JSONResponse(error_body(exc), status_code=exc.status_code, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MFSError)
    async def on_mfs_error(request: HTTPRequest, exc: MFSError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        error = MFSError(str(exc.detail))
        error.status_code, error.error_type = exc.status_code, "invalid_request_error"
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        return _error_response(InvalidRequestError(str(exc.errors()), None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: HTTPRequest, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(MFSError(f"internal error: {type(exc).__name__}"))


class _ResponseCounter:
    """Pure ASGI middleware (no body buffering, so SSE and disconnects pass through): counts statuses and
    names the node (X-MFS-Node) so a client behind a gateway can tell which replica answered."""

    def __init__(self, app, metrics: ServerMetrics, node_name: str | None = None, boot_id: str = ""):
        self.app, self.metrics = app, metrics
        # X-MFS-Boot changes when the process restarts: same node name, cold cache (the fleet front reports it)
        self.node_headers = [(gateway_headers.NODE_HEADER.encode(), node_name.encode()),
                             (gateway_headers.BOOT_HEADER.encode(), boot_id.encode())] if node_name else []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in _KNOWN_ROUTES else "other"

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_response(route, message["status"])
                if self.node_headers:
                    message = {**message, "headers": [*message.get("headers", []), *self.node_headers]}
            await send(message)
        await self.app(scope, receive, counting_send)


# ----------------------------------------------------------------------------- mfs serve
class _Server(uvicorn.Server):
    """uvicorn.Server that drains the app on SIGTERM/SIGINT (health 503, new requests 503, engine.stop), and
    stops with ENGINE_DIED_EXIT when the engine process dies (in-flight requests have had their error)."""

    exit_code = 0

    def engine_died(self, reason: str) -> None:
        """Any thread. Restarting the engine in place would hide a crash loop and the lost cache from the
        operator; exiting lets the supervisor (systemd, Kubernetes, mfs fleet) restart the whole server."""
        log.critical("%s: mfs serve exits with status %d so that its supervisor restarts it",
                     reason, ENGINE_DIED_EXIT)
        self.exit_code = ENGINE_DIED_EXIT
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        edge = getattr(getattr(self.config.app, "state", None), "edge", None)
        if edge is not None:
            edge.begin_drain()
        super().handle_exit(sig, frame)


def add_arguments(parser) -> None:
    parser.add_argument("--family", help="shipped family name or family directory (default: config, 'tiny')")
    parser.add_argument("--config", help="YAML config file (docs/CONFIG.md)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--engine", choices=["local", "triton"], help="serving engine (default: config, local)")
    parser.add_argument("--triton-url", help="Triton gRPC HOST:PORT for --engine triton "
                                             "(default: config, 127.0.0.1:8101, mfs triton-up's)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes (visible in the "
                        "process list: prefer $MFS_API_KEY or --api-key-file)")
    parser.add_argument("--api-key-file", help="file of API keys, one per line (# comments); each key is a tenant "
                        "with its own prefix cache and request limit")
    parser.add_argument("--max-client-requests", type=int, default=1024,
                        help="requests in flight per API key (per client address without keys); 0: no limit")
    parser.add_argument("--metrics-need-key", action="store_true",
                        help="put /metrics behind the API keys too (open by default)")
    parser.add_argument("--grace-s", type=float, default=10.0, help="SIGTERM grace period for in-flight requests")
    parser.add_argument("--node-name", help="name sent as X-MFS-Node on every response (default HOST:PORT)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def main(args) -> int:
    from orchestrator.core.config import ConfigError, load_config
    from orchestrator.core.family import FamilyError
    from orchestrator.serve.factory import build_serving_engine

    overrides = {key: value for key, value in (("family", args.family), ("engine.kind", args.engine),
                                                ("engine.triton_url", args.triton_url)) if value is not None}
    try:
        config = load_config(args.config, overrides)
        engine = build_serving_engine(config)
    except (ConfigError, FamilyError) as exc:
        print(f"mfs serve: {exc}")
        return 2
    try:
        keys = api_keys(args, os.environ)
        if args.max_client_requests < 0:
            raise ValueError("--max-client-requests must be >= 0 (0: no limit)")
    except (OSError, ValueError) as exc:
        print(f"mfs serve: {exc}")
        return 2
    settings = ServerSettings(api_keys=keys, request_timeout_s=config.scheduler.request_timeout_s,
                              grace_s=args.grace_s, node_name=args.node_name or f"{args.host}:{args.port}",
                              max_client_requests=args.max_client_requests or None,
                              metrics_need_key=args.metrics_need_key)
    app = create_app(engine, engine.tokenizer, engine.family, settings)
    server = _Server(server_config(app, settings, args.host, args.port, args.log_level))
    if hasattr(engine, "on_death"):        # engines in a child process (ProcessServing)
        engine.on_death = server.engine_died
    _say_if_slow_loop()
    # uvicorn re-raises the captured signal after a graceful shutdown; a no-op handler makes that exit 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return server.exit_code or (0 if server.started else 1)


API_KEY_ENV = "MFS_API_KEY"


def api_keys(args, environ) -> tuple[str, ...]:
    """The accepted API keys, from wherever they were given: --api-key, $MFS_API_KEY (comma-separated) and
    --api-key-file (one per line; blank lines and # comments skipped). None given: the /v1 routes are open."""
    keys = [args.api_key] if args.api_key else []
    keys += [k.strip() for k in environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            from_file = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
        if not from_file:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key")
        keys += from_file
    bad = [k for k in keys if any(c.isspace() for c in k)]
    if bad:
        raise ValueError("an API key must not contain whitespace")
    return tuple(dict.fromkeys(keys))


def server_config(app, settings: ServerSettings, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for `mfs serve`: the request head's deadline and size, connections + tasks bounded."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          timeout_graceful_shutdown=int(settings.grace_s) + 5,
                          limit_concurrency=settings.limit_concurrency,
                          # h11's own bound (a 400) above ours, so an oversized head is always our 431
                          h11_max_incomplete_event_size=settings.max_header_bytes + 2**20,
                          http=header_limited_protocol(settings.header_timeout_s, settings.max_header_bytes))


def _say_if_slow_loop() -> None:
    """uvicorn uses uvloop and httptools when they are installed (the faster loop and HTTP parser for many
    concurrent SSE streams); without them it falls back silently, so say it once."""
    try:
        import httptools  # noqa: F401
        import uvloop  # noqa: F401
    except ImportError as exc:
        print(f"mfs serve: {exc.name} is not installed: streaming on the slower asyncio loop / h11 parser "
              "(pip install uvloop httptools)")
