"""Per-request streams fed once per step: outputs that queued up while the reader was busy come back as one
(tokens concatenated in order, state from the latest), an error is never merged away, nothing after a final
output is merged into it, one flush hands a whole step to the loop, and a closed loop's requests are named."""
from __future__ import annotations

import asyncio

from orchestrator.core.errors import MFSError
from orchestrator.core.types import FinishReason, MemberSpan, RequestId, RequestOutput, RouteDecision
from orchestrator.serve.output_stream import OutputStream, StepOutputs, StreamTarget, hand_to_loops

ROUTE = RouteDecision(RequestId("r"), "tiny-s", "complexity", {}, {}, {}, 0.2)


def out(tokens, finished=False, spans=(), route=None, cached=0):
    return RequestOutput(RequestId("r"), list(tokens), [-0.5] * len(tokens), [], "tiny-s", finished=finished,
                         finish_reason=FinishReason.LENGTH if finished else None, num_cached_prompt_tokens=cached,
                         spans=spans, route=route)


def test_queued_outputs_merge_into_one():
    async def scenario():
        stream = OutputStream()
        stream.put(out([1], route=ROUTE, cached=16))
        stream.put(out([2, 3], spans=(MemberSpan("tiny-s", 3),)))
        stream.put(out([4], finished=True, spans=(MemberSpan("tiny-s", 4),)))
        stream.put(out([9]))                     # nothing may follow a final output into it
        return await stream.get(), await stream.get()
    merged, after = asyncio.run(scenario())
    assert merged.new_token_ids == [1, 2, 3, 4] and merged.new_logprobs == [-0.5] * 4
    assert merged.finished and merged.finish_reason is FinishReason.LENGTH
    assert merged.route is ROUTE and merged.num_cached_prompt_tokens == 16
    assert merged.spans == (MemberSpan("tiny-s", 4),)
    assert after.new_token_ids == [9]


def test_an_error_is_delivered_after_the_outputs_before_it():
    async def scenario():
        stream = OutputStream()
        stream.put(out([1]))
        stream.put(MFSError("engine step failed"))
        stream.put(out([2]))
        return [await stream.get() for _ in range(3)]
    first, error, last = asyncio.run(scenario())
    assert first.new_token_ids == [1] and isinstance(error, MFSError) and last.new_token_ids == [2]


def test_one_flush_wakes_the_loop_once_for_a_whole_step():
    async def scenario():
        loop = asyncio.get_running_loop()
        calls = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: (calls.append(args), original(*args))[1]
        gone: list = []
        outputs = StepOutputs(lambda items: gone.extend(hand_to_loops(items)))
        targets = [StreamTarget.here(RequestId(f"r{i}")) for i in range(8)]
        sinks = [outputs.sink(target) for target in targets]
        for sink in sinks:
            sink(out([7]))
        outputs.flush()
        outputs.flush()                           # nothing pending: no wake-up
        got = [await target.stream.get() for target in targets]
        assert gone == []
        return len(calls), got
    num_calls, got = asyncio.run(scenario())
    assert num_calls == 1 and all(o.new_token_ids == [7] for o in got)


def test_until_finished_aborts_only_a_consumer_that_left_early():
    from contextlib import aclosing

    async def consume(stream, take):
        abandoned = []
        got = []
        async with aclosing(stream.until_finished(lambda: abandoned.append(True))) as items:
            async for item in items:
                got.append(item.new_token_ids)
                if len(got) == take:
                    break
        return got, abandoned

    async def scenario():
        left = OutputStream()
        left.put(out([1]))
        early = asyncio.create_task(consume(left, take=1))
        await asyncio.sleep(0)
        left.put(out([2]))               # arrives after the consumer left
        got, abandoned = await early
        assert got == [[1]] and abandoned == [True]

        done = OutputStream()
        done.put(out([1]))
        done.put(out([2], finished=True))   # merged with [1] on one get()
        got, abandoned = await consume(done, take=99)
        assert got == [[1, 2]] and abandoned == []
    asyncio.run(scenario())


def test_a_closed_loops_requests_are_returned_and_the_others_still_delivered():
    async def make_target(request_id):
        return StreamTarget.here(RequestId(request_id))
    closed = asyncio.new_event_loop()
    gone_target = closed.run_until_complete(make_target("gone"))
    closed.close()

    async def scenario():
        live = StreamTarget.here(RequestId("live"))
        gone = hand_to_loops([(gone_target, out([1])), (live, out([2])), (gone_target, out([3]))])
        return gone, await live.stream.get()
    gone, got = asyncio.run(scenario())
    assert gone == ["gone", "gone"] and got.new_token_ids == [2]
