"""The fleet's front door: the one URL clients use, in front of the SGLang Model Gateway (sglang-router).

It makes no routing decision of its own; the gateway picks the replica. What it adds (see gateway_headers for
why each is needed with sglang-router 0.3.x):
- the MFS session (`X-Session-ID`, else the body's `user`) becomes the gateway's routing key; keyed requests go to
  the sticky gateway (manual policy), keyless ones to the cache-aware one (or round-robin, as a baseline);
- body fields the gateway drops (`cache_salt`, `mfs_profile`) travel as headers;
- `/v1/models` is answered by a replica (the gateway's own list says "unknown");
- a node lost under an open stream ends that stream with an SSE error event, not a silent truncation;
- a session whose replica changed (its node was lost) is reported: `X-MFS-Session-Moved` on the response,
  a log line and `mfs_fleet_session_moves_total` (its cache on the new node is cold).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

import httpx
import orjson
from prometheus_client import CollectorRegistry, Counter, generate_latest

from orchestrator.serve import gateway_headers as gh
from orchestrator.serve.client_limits import MAX_SESSION_HEADER_BYTES

log = logging.getLogger("mfs.fleet")
GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-authenticate",
               "proxy-authorization", "trailer"}
# Not forwarded upstream: set by httpx, or (accept-encoding) so the stream arrives uncompressed and a cut one
# can be detected and ended with an error event.
_NOT_FORWARDED = _HOP_BY_HOP | {"host", "content-length", "accept-encoding", gh.ROUTING_KEY_HEADER}
_NOT_RELAYED = _HOP_BY_HOP | {"date", "server"}   # the front's own server adds these to its responses
MAX_TRACKED_SESSIONS = 100_000              # last node per session, LRU: bounds the front's memory


@dataclass(frozen=True, slots=True)
class FrontSettings:
    keyless_gateway_url: str                # requests without a session (all requests when there is no sticky one)
    sticky_gateway_url: str | None          # manual policy: requests with a session key
    worker_urls: tuple[str, ...]            # the replicas, for /v1/models
    keyless_gateway_name: str = "cache_aware"   # its policy: cache_aware, or round_robin (a baseline)
    request_timeout_s: float = 600.0        # whole generation; the gateway and replicas have their own too
    connect_timeout_s: float = 5.0
    max_body_bytes: int = 4 * 2**20
    body_timeout_s: float = 30.0            # the whole body must arrive within this after the headers (408)


def _error(status: int, message: str, kind: str) -> tuple[int, bytes]:
    return status, json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


class FleetFront:
    """ASGI app. One httpx client (connection pool) to the gateways and replicas for the process's life."""

    def __init__(self, settings: FrontSettings):
        self.settings = settings
        self.client: httpx.AsyncClient | None = None
        self.session_nodes: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self.registry = CollectorRegistry()
        self.requests = Counter("mfs_fleet_requests", "generation requests forwarded, by gateway and status",
                                ["gateway", "status"], registry=self.registry)
        self.moves = Counter("mfs_fleet_session_moves", "sessions answered by a different node than their "
                             "previous turn (node lost: cold cache there)", registry=self.registry)
        self.lost_streams = Counter("mfs_fleet_lost_streams", "streams cut by a lost node or gateway; ended "
                                    "with an SSE error event", registry=self.registry)

    def _client(self) -> httpx.AsyncClient:
        if self.client is None:
            timeout = httpx.Timeout(self.settings.request_timeout_s, connect=self.settings.connect_timeout_s)
            self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1000))
        return self.client

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await self.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "POST" and path in GENERATE_PATHS:
            await self._generate(scope, receive, send)
        elif method == "GET" and path == "/v1/models":
            auth = dict(scope["headers"]).get(b"authorization")
            await self._reply(send, *await self._models({"authorization": auth.decode("latin-1")} if auth else {}))
        elif method == "GET" and path == "/health":
            await self._reply(send, *await self._health())
        elif method == "GET" and path == "/fleet/workers":
            await self._reply(send, 200, json.dumps(await self._gateway_workers()).encode())
        elif method == "GET" and path == "/metrics":
            await self._reply(send, 200, generate_latest(self.registry), b"text/plain; version=0.0.4")
        else:
            await self._reply(send, *_error(404, f"{method} {path} is not served by the fleet front; per-node "
                                            "/metrics and /v1/stats are on each replica (see /fleet/workers)",
                                            "invalid_request_error"))

    # ------------------------------------------------------------------ generation
    async def _generate(self, scope, receive, send) -> None:
        body = bytearray()
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):     # a slow sender holds nothing for long
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body += message.get("body", b"")
                    if len(body) > self.settings.max_body_bytes:
                        await self._reply(send, *_error(413, f"request body exceeds {self.settings.max_body_bytes} "
                                                        "bytes", "invalid_request_error"), close=True)
                        return
                    if not message.get("more_body"):
                        break
        except TimeoutError:
            await self._reply(send, *_error(408, f"the request body did not arrive within "
                                            f"{self.settings.body_timeout_s:g} s", "invalid_request_error"),
                              close=True)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        session_header = headers.get(gh.SESSION_HEADER, "")
        if len(session_header.encode("latin-1")) > MAX_SESSION_HEADER_BYTES:
            await self._reply(send, *_error(431, f"header {gh.SESSION_HEADER} is {len(session_header)} bytes; the "
                                            f"limit is {MAX_SESSION_HEADER_BYTES}", "invalid_request_error"))
            return
        try:
            parsed = orjson.loads(body)         # orjson: a deeply nested body is a ValueError, not a RecursionError
        except ValueError:
            parsed = None                       # forwarded as is: the replica names the problem
        session = gh.session_key(headers, parsed)
        out = {k: v for k, v in headers.items() if k not in _NOT_FORWARDED}
        out["accept-encoding"] = "identity"     # else httpx asks for gzip
        out.update(gh.lifted_headers(parsed))
        if session is not None:
            out[gh.ROUTING_KEY_HEADER] = gh.routing_key(session)
        sticky = session is not None and self.settings.sticky_gateway_url is not None
        gateway = "sticky" if sticky else self.settings.keyless_gateway_name
        base = self.settings.sticky_gateway_url if sticky else self.settings.keyless_gateway_url
        query = scope.get("query_string", b"").decode("latin-1")
        url = f"{base}{scope['path']}" + (f"?{query}" if query else "")
        client = self._client()
        disconnect = asyncio.ensure_future(_wait_disconnect(receive))
        sending = asyncio.ensure_future(client.send(client.build_request("POST", url, headers=out, content=bytes(body)),
                                                    stream=True))
        try:
            # A non-streamed answer's headers come only when it is complete: a client that leaves meanwhile must
            # cancel it (closing the upstream connection makes the gateway drop it and the replica abort it).
            await asyncio.wait({sending, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if not sending.done():
                sending.cancel()
                self.requests.labels(gateway, "499").inc()
                return
            try:
                response = sending.result()
            except httpx.TimeoutException:
                self.requests.labels(gateway, "504").inc()
                await self._reply(send, *_error(504, f"the {gateway} gateway did not answer in time", "timeout"))
                return
            except httpx.HTTPError as exc:
                self.requests.labels(gateway, "502").inc()
                await self._reply(send, *_error(502, f"the {gateway} gateway is unreachable "
                                                f"({type(exc).__name__})", "gateway_unavailable"))
                return
            self.requests.labels(gateway, str(response.status_code)).inc()
            try:
                await self._relay(response, session, disconnect, send)
            finally:
                await response.aclose()
        finally:
            disconnect.cancel()

    def _note_node(self, session: str | None, node: tuple[str, str] | None) -> str | None:
        """Remembers the session's node (name, boot); when it changed returns what to report: the previous
        node's name, or "NAME (restarted)" when the same node came back; either way its cache there is cold."""
        if session is None or node is None:
            return None
        previous = self.session_nodes.pop(session, None)
        self.session_nodes[session] = node
        while len(self.session_nodes) > MAX_TRACKED_SESSIONS:
            self.session_nodes.popitem(last=False)
        if previous is None or previous == node:
            return None
        self.moves.inc()
        moved_from = previous[0] if previous[0] != node[0] else f"{previous[0]} (restarted)"
        log.warning("session %r moved from node %s to %s: its prefix cache there is cold", session, moved_from, node[0])
        return moved_from

    async def _relay(self, response: httpx.Response, session: str | None, disconnect: asyncio.Future,
                     send) -> None:
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.multi_items()
                   if k.lower() not in _NOT_RELAYED]
        name = response.headers.get(gh.NODE_HEADER)
        node = (name, response.headers.get(gh.BOOT_HEADER, "")) if name is not None else None
        moved_from = self._note_node(session, node) if response.is_success else None
        if moved_from is not None:
            headers.append((b"x-mfs-session-moved", moved_from.encode("latin-1")))
        is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
        if is_sse:   # we may append an error event, so the length is not known in advance
            headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        chunks = response.aiter_raw().__aiter__()
        tail, problem = b"", None
        while True:
            step = asyncio.ensure_future(chunks.__anext__())
            done, _ = await asyncio.wait({step, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if disconnect in done:          # client gone: closing the upstream makes the replica abort
                step.cancel()
                return
            try:
                chunk = step.result()
            except StopAsyncIteration:
                break
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                break
            tail = (tail + chunk)[-64:]
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if is_sse and response.is_success and b"[DONE]" not in tail:
            # The stream ended without its terminator: the node (or the gateway) was lost mid-answer.
            self.lost_streams.inc()
            message = ("the node serving this request was lost mid-answer"
                       + (f" ({problem})" if problem else "") + "; retry the request: another node will serve it")
            event = {"error": {"message": message, "type": "node_lost", "param": None, "code": 502}}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(),
                        "more_body": True})
            log.warning("stream for session %r cut: %s", session, problem or "ended without [DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # ------------------------------------------------------------------ control routes
    async def _models(self, headers: dict[str, str]) -> tuple[int, bytes]:
        """The family and its members, from the first replica that answers (the gateway hides them). A replica's
        refusal (401: no or wrong API key) is the answer; an unreachable one is skipped."""
        for url in self.settings.worker_urls:
            try:
                response = await self._client().get(f"{url}/v1/models", headers=headers, timeout=2.0)
            except httpx.HTTPError:
                continue
            if response.status_code < 500:
                return response.status_code, response.content
        return _error(503, "no replica answered /v1/models", "service_unavailable")

    async def _gateway_workers(self) -> dict:
        gateways = {self.settings.keyless_gateway_name: self.settings.keyless_gateway_url}
        if self.settings.sticky_gateway_url is not None:
            gateways["sticky"] = self.settings.sticky_gateway_url
        out: dict = {}
        for name, url in gateways.items():
            try:
                response = await self._client().get(f"{url}/workers", timeout=2.0)
                workers = response.json().get("workers", [])
                out[name] = {"url": url, "workers": [{"url": w.get("url"), "healthy": bool(w.get("is_healthy")),
                                                      "load": w.get("load")} for w in workers]}
            except (httpx.HTTPError, ValueError) as exc:
                out[name] = {"url": url, "error": type(exc).__name__, "workers": []}
        return out

    async def _health(self) -> tuple[int, bytes]:
        gateways = await self._gateway_workers()
        healthy = {name: sum(w["healthy"] for w in g["workers"]) for name, g in gateways.items()}
        ok = all(n > 0 for n in healthy.values())
        body = {"status": "ok" if ok else "unavailable", "healthy_workers": healthy,
                "total_workers": len(self.settings.worker_urls), "gateways": gateways}
        return (200 if ok else 503), json.dumps(body).encode()

    @staticmethod
    async def _reply(send, status: int, body: bytes, content_type: bytes = b"application/json",
                     close: bool = False) -> None:
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        if close:                               # the rest of the body is not read: the connection cannot go on
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
