"""The engine interface the bench's replay drives (eval/bench/driver.py: `generate(request)` streaming
RequestOutputs, `stats()`), over an OpenAI-compatible server: `mfs serve` or one of vLLM's, so the same closed-loop
replay measures a server from outside, as its clients see it.

Each request is a streaming POST /v1/completions with the prompt as token ids, the request's max_tokens,
temperature and ignore_eos, `stream_options.include_usage` and `return_token_ids` (vLLM's field, which `mfs serve`
honours too): the reply's token ids go back into the session's next prompt exactly as generated, as the in-process
bench feeds them back. The session travels as the X-Session-ID header (MFS keys its session affinity on it; vLLM
ignores it), a cache_salt as the field. A server that streams text without token ids is an error, never a guess.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from eval.bench.servers import sse_events
from orchestrator.core.types import (FinishReason, MemberName, MemberSpan, Request, RequestId, RequestOutput,
                                     RouteDecision)

SESSION_HEADER = "X-Session-ID"
TIMEOUT_S = 1800.0           # a request's whole stream, however loaded the server


class HttpEngineError(RuntimeError):
    """The server answered with an error status or an error event, or without token ids."""


class HttpEngine:
    """One server. model: what requests name unless the caller says (the family for `mfs serve`: it routes;
    a member's name for a per-member server). A pinned request names its member."""

    def __init__(self, base_url: str, model: str, timeout_s: float = TIMEOUT_S) -> None:
        self.base_url, self.model, self.timeout_s = base_url.rstrip("/"), model, timeout_s
        self._session = None

    async def start(self) -> None:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0)           # a closed loop has as many streams open as sessions
        self._session = aiohttp.ClientSession(connector=connector,
                                              timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> HttpEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def stats(self) -> dict[str, Any]:
        """Nothing read from outside (the replay's counters and page samples stay empty)."""
        return {}

    def body(self, request: Request, model: str | None = None) -> dict[str, Any]:
        sampling = request.sampling
        body: dict[str, Any] = {"model": model or request.pinned_member or self.model,
                                "prompt": list(request.prompt_token_ids), "max_tokens": sampling.max_tokens,
                                "temperature": sampling.temperature, "stream": True,
                                "stream_options": {"include_usage": True}, "return_token_ids": True}
        if sampling.ignore_eos:
            body["ignore_eos"] = True
        if request.cache_salt:
            body["cache_salt"] = request.cache_salt
        return body

    async def generate(self, request: Request, model: str | None = None,
                       route: RouteDecision | None = None) -> AsyncIterator[RequestOutput]:
        """The server's stream as RequestOutputs: one per chunk with token ids; the last one finished, with the
        usage (prompt and cached tokens) and, from `mfs serve`, the members that produced the reply."""
        if self._session is None:
            raise HttpEngineError("HttpEngine.generate before start()")
        headers = {SESSION_HEADER: request.session_id} if request.session_id else {}
        parse = _Stream(request.request_id, MemberName(model or request.pinned_member or self.model), route)
        async with self._session.post(self.base_url + "/v1/completions", json=self.body(request, model),
                                      headers=headers) as resp:
            if resp.status != 200:
                raise HttpEngineError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for event in sse_events(resp.content):
                out = parse.event(event)
                if out is not None:
                    yield out
        yield parse.final()


class _Stream:
    """One completion stream's events -> RequestOutputs (the final one held until the usage arrives)."""

    def __init__(self, request_id: str, member: MemberName, route: RouteDecision | None) -> None:
        self.request_id, self.member, self.route = RequestId(request_id), member, route
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = {}
        self.spans: tuple[MemberSpan, ...] = ()
        self.num_tokens = 0
        self.sent_first = False

    def event(self, event: dict[str, Any]) -> RequestOutput | None:
        if "error" in event:
            raise HttpEngineError(f"error event: {str(event['error'])[:300]}")
        if event.get("usage"):
            self.usage = event["usage"]
        if isinstance(event.get("mfs"), dict):
            self.spans = tuple(MemberSpan(MemberName(s["member"]), int(s["tokens"]))
                               for s in event["mfs"].get("members") or ())
        choices = event.get("choices") or ()
        if not choices:
            return None
        choice = choices[0]
        ids = choice.get("token_ids")
        if ids is None:
            if choice.get("text"):
                raise HttpEngineError("the server streamed text without token_ids (return_token_ids unsupported)")
            ids = []
        self.member = MemberName(event.get("model") or self.member)       # MFS: the member producing now
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if not ids:
            return None
        self.num_tokens += len(ids)
        return RequestOutput(self.request_id, list(ids), [], [], self.member, route=self._route_once())

    def _route_once(self) -> RouteDecision | None:
        if self.sent_first:
            return None
        self.sent_first = True
        return self.route

    def final(self) -> RequestOutput:
        """The finishing output: the finish reason, prompt and cached tokens from the usage, the members' spans."""
        details = self.usage.get("prompt_tokens_details") or {}
        reason = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}.get(self.finish_reason or "")
        error = None if reason is not None else f"stream ended without a finish reason ({self.finish_reason!r})"
        if self.usage and self.usage.get("completion_tokens") != self.num_tokens:
            error = (f"usage says {self.usage.get('completion_tokens')} completion tokens, the stream carried "
                     f"{self.num_tokens} token ids")
        return RequestOutput(self.request_id, [], [], [], self.member, finished=True,
                             finish_reason=reason if error is None else FinishReason.ERROR,
                             num_prompt_tokens=int(self.usage.get("prompt_tokens") or 0),
                             num_cached_prompt_tokens=int(details.get("cached_tokens") or 0),
                             spans=self.spans, route=self._route_once(), error=error)
