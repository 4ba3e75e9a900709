"""What one client may hold of the server: time to send its headers, header sizes, requests in flight, and the
identity (an API key's digest, never the key) that bounds it and isolates its prefix cache.

- `header_limited_protocol`: uvicorn's HTTP protocol (httptools, else h11) with a deadline on the request head.
  uvicorn's own `timeout_keep_alive` only runs between requests and stops at the first byte, so a client that
  trickles a header a byte at a time (slowloris) would hold a connection forever; here the head must be complete
  within `header_timeout_s` of the connection (or of the previous response) and within `max_header_bytes`, else
  408 / 431 and the connection is closed.
- `ClientLimits`: ASGI middleware in front of the generation routes: a declared Content-Length at most
  `max_body_bytes` (413, answered before routing: a refused body costs the loop as little as possible),
  `X-Session-ID` (and the gateway's routing key) at most MAX_SESSION_HEADER_BYTES (431 naming the header), and at
  most `max_client_requests` requests in flight per API key (per client address without keys), 429 naming the
  limit.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from collections.abc import Iterable

from orchestrator.serve import gateway_headers

MAX_SESSION_HEADER_BYTES = 256
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
TENANT_STATE_KEY = "mfs_tenant"           # scope["state"][...]: the matched API key's digest, for the cache salt


def key_digest(key: str) -> str:
    """A fixed-size, one-way name for an API key: what the server keeps, counts and salts with."""
    return hashlib.blake2b(key.encode("utf-8"), digest_size=16, person=b"mfs-api-key").hexdigest()


def matching_key(authorization: str | None, keys: Iterable[str]) -> str | None:
    """The digest of the configured key the `Authorization: Bearer KEY` header carries, or None. Every key is
    compared (constant time each), so the time taken says nothing about which one nearly matched."""
    given = (authorization or "").encode()
    found = None
    for key in keys:
        if hmac.compare_digest(given, f"Bearer {key}".encode()):
            found = key
    return None if found is None else key_digest(found)


def error_json(message: str, error_type: str, code: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}}).encode()


async def _reply(send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class ClientLimits:
    """Pure ASGI middleware for the generation routes (nothing buffered: SSE passes through; a stream counts as
    in flight until its last byte is sent)."""

    def __init__(self, app, api_keys: tuple[str, ...], max_client_requests: int | None,
                 max_body_bytes: int | None = None):
        self.app, self.api_keys, self.max_client_requests = app, api_keys, max_client_requests
        self.max_body_bytes = max_body_bytes
        self.in_flight: dict[str, int] = {}       # client -> requests in flight; an entry leaves at zero

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATE_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1").lower(), value)
        declared = headers.get("content-length", b"")
        if self.max_body_bytes is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _reply(send, 413, error_json(
                f"request body is {int(declared)} bytes, over the limit of {self.max_body_bytes}",
                "invalid_request_error", "request_too_large"), [(b"connection", b"close")])
            return
        for name in (gateway_headers.SESSION_HEADER, gateway_headers.ROUTING_KEY_HEADER):
            value = headers.get(name)
            if value is not None and len(value) > MAX_SESSION_HEADER_BYTES:
                await _reply(send, 431, error_json(
                    f"header {name} is {len(value)} bytes; the limit is {MAX_SESSION_HEADER_BYTES}",
                    "invalid_request_error", "header_too_large", name), [(b"connection", b"close")])
                return
        tenant = None
        if self.api_keys:
            auth = headers.get("authorization")
            tenant = matching_key(auth.decode("latin-1") if auth is not None else None, self.api_keys)
            if tenant is None:               # the route's own check answers 401
                await self.app(scope, receive, send)
                return
            scope.setdefault("state", {})[TENANT_STATE_KEY] = tenant
        client = f"key:{tenant}" if tenant else f"addr:{(scope.get('client') or ('unknown',))[0]}"
        limit = self.max_client_requests
        held = self.in_flight.get(client, 0)
        if limit and held >= limit:
            who = "this API key" if tenant else "this client address"
            await _reply(send, 429, error_json(
                f"{who} has {held} requests in flight; the limit is {limit} per API key (per client address "
                f"without keys: mfs serve --max-client-requests)", "rate_limit_exceeded", "too_many_client_requests"),
                [(b"retry-after", b"1")])
            return
        self.in_flight[client] = held + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.in_flight[client] - 1
            if left:
                self.in_flight[client] = left
            else:
                del self.in_flight[client]


# ----------------------------------------------------------------------------- the request head's deadline
def _base_protocol() -> type:
    """What uvicorn's "auto" picks: httptools when installed, else h11."""
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol


def header_limited_protocol(header_timeout_s: float, max_header_bytes: int, base: type | None = None) -> type:
    """A uvicorn HTTP protocol class (uvicorn.Config(http=...)) that answers 408 to a request head not complete
    within header_timeout_s and 431 to one over max_header_bytes, then closes the connection. Between requests
    on a kept-alive connection the deadline is uvicorn's timeout_keep_alive plus header_timeout_s."""
    base = base or _base_protocol()

    class HeaderLimited(base):
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._await_head(header_timeout_s)

        def connection_lost(self, exc) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._await_head(self.timeout_keep_alive + header_timeout_s)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                return
            if not self._idle():
                self._head_bytes = 0            # a request is in progress: its head was complete
                return
            self._head_bytes += len(data)
            if self._head_bytes > max_header_bytes:
                self._refuse(431, b"Request Header Fields Too Large", error_json(
                    f"the request head exceeds {max_header_bytes} bytes", "invalid_request_error",
                    "header_too_large"))

        def _idle(self) -> bool:
            """No request in progress: the next one's head has not been completely received."""
            cycle = getattr(self, "cycle", None)
            return cycle is None or cycle.response_complete

        def _await_head(self, delay_s: float) -> None:
            self._cancel_head_timer()
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(delay_s, self._head_deadline)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_deadline(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or not self._idle():
                return
            if self._head_bytes == 0 and getattr(self, "cycle", None) is not None:
                self.transport.close()          # an idle kept-alive connection: closed, as keep-alive does
                return
            self._refuse(408, b"Request Timeout", error_json(
                f"the request head did not arrive within {header_timeout_s:g} s", "invalid_request_error",
                "request_timeout"))

        def _refuse(self, status: int, reason: bytes, body: bytes) -> None:
            self._cancel_head_timer()
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                 b"connection: close\r\n\r\n%s" % (status, reason, len(body), body))
            self.transport.close()

    HeaderLimited.__name__ = HeaderLimited.__qualname__ = f"HeaderLimited{base.__name__}"
    return HeaderLimited
