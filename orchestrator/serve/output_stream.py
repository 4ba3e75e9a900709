"""Per-request output streams on the asyncio side of a serving engine, fed once per engine step.

The engine (a thread, or a separate process through its reader thread) hands ALL of a step's outputs to the
event loop in one `call_soon_threadsafe` (`StreamTable.dispatch_threadsafe`), instead of one wake-up per request
per token. A consumer that fell behind gets the outputs that queued up merged into one (`merge_outputs`): one
text delta and one SSE frame for several tokens, which is what keeps the edge's per-token work bounded under load.
"""
from __future__ import annotations

import asyncio
from collections import deque
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
                   route=later.route or first.route)


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


class StreamTable:
    """request id -> (event loop, OutputStream). Written on the event loop; the engine side only dispatches."""

    def __init__(self) -> None:
        self._streams: dict[RequestId, tuple[asyncio.AbstractEventLoop, OutputStream]] = {}

    def __contains__(self, request_id: RequestId) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def ids(self) -> list[RequestId]:
        return list(self._streams)

    def open(self, request_id: RequestId) -> OutputStream:
        stream = OutputStream()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        return stream

    def close(self, request_id: RequestId) -> None:
        self._streams.pop(request_id, None)

    def dispatch_threadsafe(self, items: list[tuple[RequestId, Item]]) -> None:
        """From any thread: one loop wake-up for a whole step's outputs (per loop; normally there is one)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, Item]]] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:     # that caller's loop is gone: its streams can never be read again
                for request_id in [r for r, (l, _) in self._streams.items() if l is loop]:
                    self._streams.pop(request_id, None)


def _put_all(batch: list[tuple[OutputStream, Item]]) -> None:
    for stream, item in batch:
        stream.put(item)
