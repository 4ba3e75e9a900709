"""Per-request output streams on the asyncio side of a serving engine, fed once per engine step.

The engine (a thread, or a separate process through its reader thread) hands ALL of a step's outputs to the
event loop in one `call_soon_threadsafe` (`StepBatcher.flush`), instead of one wake-up per request per token.
A consumer that fell behind gets the outputs that queued up merged into one (`merge_outputs`): one text delta
and one SSE frame for several tokens, which keeps the edge's per-token work bounded under load.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from orchestrator.core.types import RequestId, RequestOutput

Item = RequestOutput | BaseException


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output carrying both's new tokens; state fields (finished, spans, route, ...) from the later one."""
    return replace(later,
                   new_token_ids=[*first.new_token_ids, *later.new_token_ids],
                   new_logprobs=[*first.new_logprobs, *later.new_logprobs],
                   new_top_logprobs=[*first.new_top_logprobs, *later.new_top_logprobs]
                   if (first.new_top_logprobs or later.new_top_logprobs) else [],
                   member=later.member or first.member,
                   num_cached_prompt_tokens=max(first.num_cached_prompt_tokens, later.num_cached_prompt_tokens),
                   spans=later.spans or first.spans,
                   route=later.route or first.route,
                   num_drafted_tokens=max(first.num_drafted_tokens, later.num_drafted_tokens),
                   num_accepted_tokens=max(first.num_accepted_tokens, later.num_accepted_tokens))


class OutputStream:
    """One request's outputs: a deque and a waiter future (lighter than asyncio.Queue on the per-token path)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item: Item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Item:
        """The next item; several RequestOutputs that queued up come back merged (an error never merges)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            return item
        while self._items and not isinstance(self._items[0], BaseException) and not item.finished:
            item = merge_outputs(item, self._items.popleft())
        return item

    async def until_finished(self, on_abandoned: Callable[[], None]) -> AsyncIterator[RequestOutput]:
        """Yields outputs until the finished one (an error item is raised); if the consumer stops early
        (client gone), on_abandoned() runs so the request is aborted and its pages return."""
        finished = False
        try:
            while True:
                item = await self.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                on_abandoned()


class StepBatcher:
    """Collects a step's outputs from the engine's sinks (on the engine thread, or the pipe reader) and hands
    them to each event loop in ONE call_soon_threadsafe at flush() (EngineCore.on_delivered)."""

    def __init__(self, on_loop_gone: Callable[[RequestId], None]):
        self._pending: list[tuple[asyncio.AbstractEventLoop, RequestId, OutputStream, Item]] = []
        self._on_loop_gone = on_loop_gone

    def sink(self, request_id: RequestId, stream: OutputStream) -> Callable[[Item], None]:
        """The caller's sink for one request (call it on the event loop that will read the stream)."""
        loop = asyncio.get_running_loop()
        pending = self._pending

        def put(item: Item) -> None:
            pending.append((loop, request_id, stream, item))
        return put

    def flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending[:] = list(self._pending), []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, Item]]] = {}
        for loop, _, stream, item in batch:
            by_loop.setdefault(loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(put_all, items)
            except RuntimeError:     # that caller's loop is gone: nobody reads these streams any more
                for gone_loop, request_id, _, _ in batch:
                    if gone_loop is loop:
                        self._on_loop_gone(request_id)


def put_all(items: list[tuple[OutputStream, Item]]) -> None:
    for stream, item in items:
        stream.put(item)
