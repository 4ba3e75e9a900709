"""One generation at the HTTP edge: engine outputs -> text deltas (stop strings), logprobs, usage, SSE chunks."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from orchestrator.serve.api_schema import (
    ParsedRequest, chat_logprobs, chunk, completion_logprobs, error_body, finish_reason_text, full_response,
    logprob_entry, mfs_extension, usage, usage_chunk,
)
from orchestrator.core.errors import MFSError, RequestTimeoutError
from orchestrator.serve.edge import Edge
from orchestrator.serve.tokenizer import IncrementalDecoder
from orchestrator.core.types import FinishReason, MemberSpan, RequestOutput, RouteDecision

log = logging.getLogger("mfs.server")


class _CutStreamFilter(logging.Filter):
    """uvicorn logs "ASGI callable returned without completing response" as an error for a stream the server
    cut on purpose (a stalled reader, already logged as a warning with its request id): one such line is dropped
    per cut, any other stays."""

    MESSAGE = "ASGI callable returned without completing response."

    def __init__(self) -> None:
        super().__init__()
        self.pending = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.pending and record.getMessage() == self.MESSAGE:
            self.pending -= 1
            return False
        return True


_cut_streams = _CutStreamFilter()
logging.getLogger("uvicorn.error").addFilter(_cut_streams)


_DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before the answer was complete."""


# ----------------------------------------------------------------------------- one generation
@dataclass(slots=True)
class Generation:
    """Drives one engine.generate stream: decodes text, applies stop strings, accumulates the answer."""

    edge: Edge
    parsed: ParsedRequest
    decoder: IncrementalDecoder
    iterator: AsyncIterator[RequestOutput] | None = None
    text: list[str] = field(default_factory=list)
    text_chars: int = 0
    logprobs: list[dict] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    member: str = ""
    spans: tuple[MemberSpan, ...] = ()
    route: RouteDecision | None = None
    num_drafted_tokens: int = 0                # speculation, as the engine's last output counted it
    num_accepted_tokens: int = 0
    finish_reason: str | None = None
    engine_finished: bool = False              # the engine ended the request itself (no abort needed)
    first_token_s: float | None = None
    closed: bool = False
    token_ids: list[int] = field(default_factory=list)     # return_token_ids: every generated id
    sent_token_ids: int = 0                                # of those, the ones a chunk carried
    sent_prompt_ids: bool = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    async def next_delta(self) -> tuple[str, list[dict]]:
        """Waits for the next engine output; returns (text delta, logprob entries). Raises MFSError."""
        if self.iterator is None:
            try:
                self.iterator = aiter(self.edge.engine.generate(self.parsed.request))
            except MFSError:
                self.engine_finished = True        # refused before it existed: nothing to abort
                raise
        timeout_s = self.edge.settings.request_timeout_s
        remaining_s = None if timeout_s is None else self.parsed.request.arrival_s + timeout_s - time.monotonic()
        try:
            if remaining_s is not None and remaining_s <= 0:
                raise TimeoutError
            # asyncio.timeout, not wait_for: wait_for wraps every token's await in a new Task
            async with asyncio.timeout(remaining_s):
                out = await anext(self.iterator)
        except StopAsyncIteration:
            self.engine_finished = True
            self.finish_reason = self.finish_reason or FinishReason.CANCELLED.value
            tail = self.decoder.flush()
            self._record(tail, [])
            return tail, []
        except TimeoutError:
            raise RequestTimeoutError(f"request exceeded the server timeout of {timeout_s} s") from None
        except MFSError:
            if not self.completion_tokens:
                self.engine_finished = True        # QueueFullError / unavailable at admission
            raise
        return self._absorb(out)

    def _absorb(self, out: RequestOutput) -> tuple[str, list[dict]]:
        now_s = time.monotonic()
        self.member = out.member or self.member
        self.spans = out.spans or self.spans
        self.route = out.route or self.route
        self.num_drafted_tokens = max(self.num_drafted_tokens, out.num_drafted_tokens)
        self.num_accepted_tokens = max(self.num_accepted_tokens, out.num_accepted_tokens)
        self.cached_tokens = max(self.cached_tokens, out.num_cached_prompt_tokens)
        if out.new_token_ids and self.first_token_s is None:
            self.first_token_s = now_s
        self.completion_tokens += len(out.new_token_ids)
        if self.parsed.return_token_ids:
            self.token_ids.extend(out.new_token_ids)
        entries = []
        if self.parsed.logprobs:
            tops = out.new_top_logprobs or [()] * len(out.new_token_ids)
            entries = [logprob_entry(self.edge.tokenizer, t, lp, top)
                       for t, lp, top in zip(out.new_token_ids, out.new_logprobs, tops)]
        delta = self.decoder.push(out.new_token_ids)
        if out.finished:
            self.engine_finished = True
            if out.finish_reason is FinishReason.ERROR or (out.error and out.finish_reason is None):
                raise MFSError(f"engine error: {out.error or 'unknown'}")
            delta += self.decoder.flush()          # may still find a stop string in the held-back tail
            self.finish_reason = "stop" if self.decoder.stopped else finish_reason_text(out.finish_reason)
        elif self.decoder.stopped:
            # A stop string ended the answer: the engine stops at its next step and returns the pages.
            self.edge.engine.abort(self.parsed.request.request_id, FinishReason.STOP)
            self.finish_reason = "stop"
        self._record(delta, entries)
        return delta, entries

    def _record(self, delta: str, entries: list[dict]) -> None:
        self.text.append(delta)
        self.text_chars += len(delta)
        self.logprobs.extend(entries)

    def model(self) -> str:
        return self.spans[-1].member if self.spans else (self.member or self.edge.family.name)

    def usage(self) -> dict:
        return usage(len(self.parsed.request.prompt_token_ids), self.completion_tokens, self.cached_tokens)

    def mfs(self) -> dict:
        spans = self.spans or ((MemberSpan(self.member, self.completion_tokens),) if self.member else ())
        return mfs_extension(spans, self.route, self.num_drafted_tokens, self.num_accepted_tokens)

    def logprobs_object(self, entries: list[dict], offset: int) -> dict | None:
        if not self.parsed.logprobs:
            return None
        if self.parsed.kind == "chat":
            return chat_logprobs(entries)
        return completion_logprobs(entries, offset)

    def response(self) -> dict:
        return full_response(self.parsed, self.model(), "".join(self.text), self.finish_reason,
                             self.logprobs_object(self.logprobs, 0), self.usage(), self.mfs(), **self.id_fields())

    def unsent_token_ids(self) -> bool:
        return self.parsed.return_token_ids and len(self.token_ids) > self.sent_token_ids

    def id_fields(self) -> dict[str, list[int]]:
        """return_token_ids (vLLM's field): the ids generated since the last chunk, and the prompt's ids once."""
        if not self.parsed.return_token_ids:
            return {}
        fields = {"token_ids": self.token_ids[self.sent_token_ids:]}
        self.sent_token_ids = len(self.token_ids)
        if not self.sent_prompt_ids:
            self.sent_prompt_ids = True
            fields["prompt_token_ids"] = list(self.parsed.request.prompt_token_ids)
        return fields

    async def close(self) -> None:
        """Always runs: aborts an unfinished request, closes the stream, records edge latencies."""
        if self.closed:
            return
        self.closed = True
        if not self.engine_finished:
            self.edge.engine.abort(self.parsed.request.request_id)
        closer = getattr(self.iterator, "aclose", None)
        if closer is not None:
            with anyio.CancelScope(shield=True):   # may run inside a cancelled (disconnected) stream
                try:
                    await asyncio.wait_for(closer(), 1.0)
                except (Exception, asyncio.CancelledError):
                    log.debug("closing the engine stream of %s failed", self.parsed.request.request_id)
        now_s = time.monotonic()
        first = None if self.first_token_s is None else self.first_token_s - self.parsed.request.arrival_s
        self.edge.metrics.observe_request(self.model(), first, now_s - self.parsed.request.arrival_s,
                                          self.completion_tokens)


async def until_disconnected(request: HTTPRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: HTTPRequest, work) -> Any:
    """Runs `work` (a coroutine); raises ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        # cancel() only asks: the task ends at its next await. Wait for that, so its cleanup has run before the
        # caller closes the engine stream (reading task.result() now would raise InvalidStateError).
        await asyncio.wait({task})
    if task.cancelled():
        raise ClientGone
    return task.result()


def _sse(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _stream(gen: Generation, first: tuple[str, list[dict]]) -> AsyncIterator[str]:
    """SSE body; a client disconnect cancels this generator and `close` aborts the request."""
    parsed = gen.parsed
    try:
        if parsed.kind == "chat":
            yield _sse(chunk(parsed, gen.model(), role=True))
        delta, entries = first
        while True:
            if delta or entries or gen.unsent_token_ids():
                yield _sse(chunk(parsed, gen.model(), text=delta,
                                 logprobs=gen.logprobs_object(entries, gen.text_chars - len(delta)),
                                 **gen.id_fields()))
            if gen.done:
                break
            try:
                delta, entries = await gen.next_delta()
            except MFSError as exc:
                yield _sse(error_body(exc))
                yield _DONE
                return
        yield _sse(chunk(parsed, gen.model(), text="" if parsed.kind == "completion" else None,
                         finish_reason=gen.finish_reason, mfs=gen.mfs(), **gen.id_fields()))
        if parsed.include_usage:
            yield _sse(usage_chunk(parsed, gen.model(), gen.usage()))
        yield _DONE
    finally:
        await gen.close()


class SSEResponse(StreamingResponse):
    """Closes the generation even when the client leaves before the body iterator ever started, and cancels it
    when the client takes no data for stall_s: uvicorn stops writing to a socket whose peer does not read (its
    write buffer is bounded by flow control) and the engine's outputs for the request are bounded by max_tokens,
    so a stalled reader holds at most that, for at most about stall_s; then its request is aborted, its pages
    return and the connection is closed. A watchdog task per stream checks when the pending send began: no timer
    per chunk on the per-token path."""

    def __init__(self, gen: Generation, first: tuple[str, list[dict]], headers: dict[str, str] | None = None,
                 stall_s: float | None = None):
        super().__init__(_stream(gen, first), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._gen = gen
        self._stall_s = stall_s
        self._sending_since: float | None = None
        self._stalled = False

    async def __call__(self, scope, receive, send) -> None:
        loop = asyncio.get_running_loop()

        async def watched_send(message) -> None:
            self._sending_since = loop.time()
            try:
                await send(message)
            finally:
                self._sending_since = None

        task = asyncio.current_task()
        watchdog = loop.create_task(self._watch(task)) if self._stall_s is not None else None
        try:
            await super().__call__(scope, receive, send if watchdog is None else watched_send)
        except BaseException:
            if not self._stalled:
                raise
            task.uncancel()
            log.warning("stream %s cancelled: its client took no data for %g s",
                        self._gen.parsed.request.request_id, self._stall_s)
            self._gen.edge.metrics.count_stalled_stream()
            _cut_streams.pending += 1
        finally:
            if watchdog is not None:
                watchdog.cancel()
            await self._gen.close()

    async def _watch(self, task: asyncio.Task) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._stall_s / 4)
            since = self._sending_since
            if since is not None and loop.time() - since >= self._stall_s:
                self._stalled = True
                task.cancel()
                return
