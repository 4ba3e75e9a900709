"""Per-request output streams on the asyncio side of a serving engine, fed once per engine step.

The one output-coalescing layer of every serving path: the engine's sinks collect a step's outputs
(`StepOutputs`) and hand them over once per step: to the event loop in one `call_soon_threadsafe` per loop
(`hand_to_loops`: LocalServing's engine thread, the engine process's pipe reader), or as one pipe message (the
engine and Triton child processes), instead of one wake-up per request per token. A consumer that fell behind gets
the outputs that queued up merged into one (`OutputStream.get`, `merge_outputs`): one text delta and one SSE frame
for several tokens, which keeps the edge's per-token work bounded under load.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import replace
from typing import Generic, NamedTuple, TypeVar

from orchestrator.core.types import RequestId, RequestOutput

Item = RequestOutput | BaseException
T = TypeVar("T")


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


class StreamTarget(NamedTuple):
    """Where one request's outputs go: its stream, read on its event loop."""

    request_id: RequestId
    loop: asyncio.AbstractEventLoop
    stream: OutputStream

    @classmethod
    def here(cls, request_id: RequestId) -> StreamTarget:
        """A fresh stream for request_id, read on the running event loop (call it there)."""
        return cls(request_id, asyncio.get_running_loop(), OutputStream())


class StepOutputs(Generic[T]):
    """A step's outputs, collected from the engine's sinks as they come and handed over in ONE go at flush()
    (EngineCore.on_delivered, once per step), not one hand-over per request per token. Each item is kept with the
    target its sink was made for: a StreamTarget in the HTTP process, a request id where the step's outputs cross a
    pipe. hand_over(items) must use the list before it returns (it is cleared and reused)."""

    def __init__(self, hand_over: Callable[[list[tuple[T, Item]]], None]):
        self._pending: list[tuple[T, Item]] = []
        self._hand_over = hand_over

    def sink(self, target: T) -> Callable[[Item], None]:
        """The engine's sink for one request (EngineCore.add_request)."""
        pending = self._pending

        def put(item: Item) -> None:
            pending.append((target, item))
        return put

    def put(self, target: T, item: Item) -> None:
        self._pending.append((target, item))

    def flush(self) -> None:
        if self._pending:
            self._hand_over(self._pending)
            self._pending.clear()


def hand_to_loops(items: Iterable[tuple[StreamTarget, Item]]) -> list[RequestId]:
    """Puts each item into its stream with ONE call_soon_threadsafe per event loop (normally one). Returns the
    requests whose loop is gone: nobody reads their streams any more."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[StreamTarget, Item]]] = {}
    for target, item in items:
        by_loop.setdefault(target.loop, []).append((target, item))
    gone: list[RequestId] = []
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(put_all, batch)
        except RuntimeError:     # that loop is closed
            gone.extend(target.request_id for target, _ in batch)
    return gone


def put_all(items: list[tuple[StreamTarget, Item]]) -> None:
    for target, item in items:
        target.stream.put(item)
