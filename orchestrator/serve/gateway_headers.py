"""The header contract between the fleet front (`mfs fleet`), the SGLang Model Gateway and `mfs serve` replicas.

Why headers: the gateway (sglang-router 0.3.x, regular HTTP mode) parses /v1/chat/completions into its own typed
request and re-serialises it, which drops fields it does not know (`user`, `cache_salt`, `mfs_profile`), and it
forwards only an allow-list of request headers: `authorization`, `x-request-id`, `x-correlation-id`,
`traceparent`, `tracestate`, `x-smg-routing-key` and anything starting with `x-request-id-`. So:
- the session key travels as `x-smg-routing-key` (the gateway pins it with its `manual` policy and forwards it;
  a replica reads it as the session id when `X-Session-ID` is absent);
- MFS body fields the gateway would drop travel as `x-request-id-mfs-*` headers, percent-encoded UTF-8, and a
  replica puts them back into the body when the body lacks them (the body wins when both are present).
Dropping `cache_salt` silently would let tenants share prefix caches across the fleet, hence this module.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, unquote

ROUTING_KEY_HEADER = "x-smg-routing-key"        # fixed in sglang-router 0.3.x (not configurable there)
SESSION_HEADER = "x-session-id"                 # what MFS clients send
NODE_HEADER = "x-mfs-node"                      # every replica response names its node (the gateway passes it on)
BOOT_HEADER = "x-mfs-boot"                      # ... and its process incarnation (a restart empties its cache)
# body field -> header that carries it through the gateway
LIFTED_FIELDS = {"cache_salt": "x-request-id-mfs-cache-salt", "mfs_profile": "x-request-id-mfs-profile"}
MAX_KEY_CHARS = 128                             # longer session keys travel as their SHA-256 (header size limits)


def session_key(headers: Mapping[str, str], body: Any) -> str | None:
    """The session a request belongs to: `X-Session-ID`, else the body's `user`, else an explicit routing key."""
    key = headers.get(SESSION_HEADER) or None
    if key is None and isinstance(body, dict) and isinstance(body.get("user"), str) and body["user"]:
        key = body["user"]
    if key is None:
        key = headers.get(ROUTING_KEY_HEADER) or None
    return key


def encode(value: str) -> str:
    """Header-safe form of any string (keys and salts may be arbitrary UTF-8)."""
    return quote(value, safe="")


def routing_key(session: str) -> str:
    """The `x-smg-routing-key` value for a session: header-safe, bounded in length, stable."""
    value = encode(session)
    return value if len(value) <= MAX_KEY_CHARS else "sha256-" + hashlib.sha256(session.encode()).hexdigest()


def lifted_headers(body: Any) -> dict[str, str]:
    """Headers that carry the body fields the gateway drops (front side)."""
    if not isinstance(body, dict):
        return {}
    return {header: encode(body[name]) for name, header in LIFTED_FIELDS.items() if isinstance(body.get(name), str)}


def restore_lifted(body: Any, headers: Mapping[str, str]) -> Any:
    """Replica side: put lifted fields back into the body where the body lacks them."""
    if not isinstance(body, dict):
        return body
    for name, header in LIFTED_FIELDS.items():
        value = headers.get(header)
        if value is not None and name not in body:
            body[name] = unquote(value)
    return body


def replica_session_id(headers: Mapping[str, str]) -> str | None:
    """Replica side: `X-Session-ID` when a client talks to it directly, else the gateway's routing key."""
    return headers.get(SESSION_HEADER) or headers.get(ROUTING_KEY_HEADER) or None
