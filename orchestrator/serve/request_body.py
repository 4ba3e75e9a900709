"""Reading a generation request's body under the edge's limits: size, read time, JSON syntax and nesting depth."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import Request as HTTPRequest

from orchestrator.core.errors import InvalidRequestError, MFSError, PayloadTooLargeError


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """What any request body must stay within before a field is looked at (documented in docs/API.md)."""

    max_bytes: int = 4 * 2**20
    max_depth: int = 8                 # deepest legal body: messages[i].content[j].text is 4 levels
    max_items: int = 2**20             # elements of one array or members of one object (bounded by max_bytes too)
    read_timeout_s: float = 30.0       # the whole body must arrive within this after the headers


def servable_body_bytes(prompt_chars: int, context_tokens: int, logit_bias_entries: int) -> int:
    """The longest body a request this server could serve may have, read from the family's context: every prompt
    character in JSON's longest escape (12 bytes: a surrogate pair's two \\uXXXX), each context token's share of
    message and content-part fields (128 bytes: a part costs at least one token of the chat template), a full
    logit_bias (40 bytes an entry), all of it indented (x2), and 64 KiB for the other fields. A longer body is
    refused from its Content-Length, before it is read: reading and parsing megabytes only to refuse them for
    their length is what lets one client slow every stream."""
    return 2 * (12 * prompt_chars + 128 * context_tokens + 40 * logit_bias_entries) + 64 * 2**10


class BodyTimeoutError(MFSError):
    status_code = 408
    error_type = "invalid_request_error"
    code = "request_timeout"


async def read_json_body(request: HTTPRequest, limits: BodyLimits) -> Any:
    """The parsed body; InvalidRequestError / PayloadTooLargeError / BodyTimeoutError for anything else."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_bytes:
        raise PayloadTooLargeError(f"request body is {int(declared)} bytes, over the limit of {limits.max_bytes}")
    try:
        async with asyncio.timeout(limits.read_timeout_s):
            body = await _read_bytes(request, limits.max_bytes)
    except TimeoutError:
        raise BodyTimeoutError(f"the request body did not arrive within {limits.read_timeout_s:g} s") from None
    return parse_json(body, limits)


async def _read_bytes(request: HTTPRequest, limit_bytes: int) -> bytes:
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit_bytes:
            raise PayloadTooLargeError(f"request body exceeds {limit_bytes} bytes")
    return bytes(body)


def parse_json(body: bytes, limits: BodyLimits) -> Any:
    """orjson, not the json module: it parses without recursing in Python (its own depth limit, 1024, ends in a
    JSONDecodeError, never a RecursionError), refuses NaN/Infinity, lone surrogates and invalid UTF-8, and turns
    an integer past 64 bits into a float (which every integer field then refuses by type)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}", None) from None
    check_shape(value, limits)
    return value


def check_shape(value: Any, limits: BodyLimits) -> None:
    """Depth and container sizes, walked without recursion. The error names the top-level field it is under."""
    stack: list[tuple[Any, int, str | None]] = [(value, 1, None)] if type(value) in (dict, list) else []
    while stack:
        node, depth, field = stack.pop()
        if depth > limits.max_depth:
            raise InvalidRequestError(f"request body nests deeper than {limits.max_depth} levels", field)
        if len(node) > limits.max_items:
            raise InvalidRequestError(f"an array or object holds more than {limits.max_items} items", field)
        children = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in children:
            if type(child) is dict or type(child) is list:
                stack.append((child, depth + 1, key if depth == 1 and isinstance(key, str) else field))
