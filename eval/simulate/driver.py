"""Replays a bench trace through simulated nodes in virtual time and returns what `mfs bench` measures.

The session logic is the bench's (eval/bench/sessions.py): sessions start at their arrival times; each turn is sent
when the previous one finished plus its think time; ClosedLoopSessions builds its prompt, record and request and
ends a session whose turn failed; a refused request is recorded like a failed one. Records are filled by the
bench's own record_output, so eval.bench.metrics.summarize gives the same metrics block. Where the cost model prices the serving edge (request_path_s: the measured CPU model), a request
reaches the scheduler that long after the client sent it, and the client sees each output that long after the
step that made it.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from eval.bench.metrics import RequestRecord
from eval.simulate.clock import EventQueue, VirtualClock
from eval.simulate.confidence import request_key
from eval.simulate.fleet import FrontRouter
from eval.simulate.node import SimNode
from eval.simulate.step_profile import StepProfile
from eval.bench.sessions import ClosedLoopSessions, record_output
from eval.workloads import Trace
from orchestrator.core.errors import MFSError
from orchestrator.core.events import pages_block
from orchestrator.core.scheduler import Scheduler
from orchestrator.core.sequence import Sequence
from orchestrator.core.snapshot import pages_state
from orchestrator.core.types import Request, RequestOutput

STATS_INTERVAL_S = 0.5          # the bench samples the stats snapshot every 0.5 s


@dataclass(slots=True)
class SimRun:
    records: list[RequestRecord]
    samples: list[dict]
    counters: dict
    duration_s: float
    num_steps: int
    busy_s: float
    num_events: int
    wall_s: float
    cpu_s: float                                   # this process's CPU time (wall time depends on the machine's load)
    router_decisions: dict[str, int] = field(default_factory=dict)
    step_profile: dict[str, dict] = field(default_factory=dict)     # step_profile.StepProfile.summary, every node's


NodeFactory = Callable[[VirtualClock, EventQueue, Callable[[RequestOutput, float], None]], list[SimNode]]


def simulate(tag: str, make_nodes: NodeFactory, trace: Trace, stats_interval_s: float = STATS_INTERVAL_S,
             keep_nodes: list | None = None, homes: list[tuple[str, ...]] | None = None) -> SimRun:
    """keep_nodes: where to leave the replay's nodes instead of freeing them at its end. A forked worker that
    exits right after (cli._forked_system) passes one: the OS then takes the memory back at once, where freeing
    the nodes' pools, prefix maps and tiers object by object took ~9 s of a 10,000-session fleet:8 replay."""
    with no_full_collections():
        return _simulate(tag, make_nodes, trace, stats_interval_s, keep_nodes, homes)


@contextmanager
def no_full_collections():
    """The cyclic collector is off for the replay: what exists at its start is frozen out of it, and neither
    full nor young collections run. Full collections traverse every live container, and a replay keeps many
    long ones alive (the trace's token lists and every record's prompt: ~10^7 items at 10,000 sessions), so
    their cost grew with the trace and the load; young ones scanned every step's plan, tokens and outputs
    before reference counting freed them (4% of a replay's CPU with the compiled core, at one collection per
    50,000 allocations). Nothing is lost: the core's and the simulator's per-step and per-request objects
    hold no cycle (tests/test_simulate.py checks that a replay leaves none of them to the collector), so
    reference counting frees them; what does form a cycle waits for the first collection after the replay.
    Nothing a simulation computes depends on when the collector runs."""
    was_enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()


def _simulate(tag: str, make_nodes: NodeFactory, trace: Trace, stats_interval_s: float,
              keep_nodes: list | None = None, homes: list[tuple[str, ...]] | None = None) -> SimRun:
    started, cpu_started = time.perf_counter(), time.process_time()
    clock = VirtualClock()
    events = EventQueue(clock)
    sessions = ClosedLoopSessions(trace, tag)
    records = sessions.records
    pending: dict[str, tuple[RequestRecord, int, int]] = {}      # request id -> (record, session index, turn)
    samples: list[dict] = []
    remaining = [len(trace.sessions)]

    path_in_s = path_out_s = 0.0

    def on_output(out: RequestOutput, now: float) -> None:
        entry = pending.get(out.request_id)
        if entry is None:
            return
        record, index, k = entry
        now += path_out_s
        record_output(record, out, now)
        if out.finished:
            record.output_tokens = len(record.output_token_ids)
            del pending[out.request_id]
            next_turn(index, k, now)

    nodes = make_nodes(clock, events, on_output)
    request_path = getattr(nodes[0].executor.cost, "request_path_s", None) if nodes else None
    if request_path is not None:
        path_in_s, path_out_s = request_path()
    router = FrontRouter(len(nodes), homes if len(nodes) > 1 else None)
    if router.homes is not None:
        def move(source: SimNode, seq: Sequence) -> None:
            """An escalated request continues on a home of its new member, as it would move to that member's
            own deployment."""
            index = router.move(seq.member, nodes.index(source),
                                [n.num_in_flight for n in nodes], [n.scheduler.num_waiting() for n in nodes])
            target = nodes[index]
            if target is source:
                return
            key = source.executor.request_keys.get(seq.request_id)
            source.move_out(seq)
            if key is not None:
                target.executor.request_keys[seq.request_id] = key
            target.move_in(seq)

        for node in nodes:
            node.on_move_out = move

    def next_turn(index: int, k: int, now: float) -> None:
        turns = trace.sessions[index].turns
        if k + 1 < len(turns):
            events.push(now + turns[k + 1].think_time_s, lambda: send(index, k + 1))
        else:
            remaining[0] -= 1

    def send(index: int, k: int) -> None:
        now = clock()
        # intermediate_outputs off: record_output needs the first output and the last
        record, request = sessions.start_turn(index, k, now, now, intermediate_outputs=False)
        if request is None:
            remaining[0] -= 1
            return
        session_id = trace.sessions[index].session_id
        member, waiting = None, None
        if router.homes is not None:
            member, waiting = nodes[0].adequate_member(request), [n.scheduler.num_waiting() for n in nodes]
        node = nodes[router.route(session_id, request.prompt_token_ids, [n.num_in_flight for n in nodes], member,
                                  waiting)]
        node.executor.request_keys[request.request_id] = request_key(session_id, k)
        pending[request.request_id] = (record, index, k)
        if path_in_s > 0:
            events.push(now + path_in_s, lambda: submit(node, request, record, index, k))
        else:
            submit(node, request, record, index, k)

    def submit(node: SimNode, request: Request, record: RequestRecord, index: int, k: int) -> None:
        try:
            node.submit(request)
        except MFSError as exc:          # refused (invalid for the pool, queue full): recorded
            record.error = f"{type(exc).__name__}: {exc}"
            del pending[request.request_id]
            node.executor.request_keys.pop(request.request_id, None)
            next_turn(index, k, clock() + path_out_s)

    def sample() -> None:
        samples.append({"t_s": clock(), "stats": {"pages": _sum_pages([_pages(n.scheduler) for n in nodes])}})
        if remaining[0] > 0 or pending:
            events.push(clock() + stats_interval_s, sample)

    for index, arrival_s in enumerate(trace.arrival_times_s):
        events.push(arrival_s, lambda index=index: send(index, 0))
    events.push(0.0, sample)
    events.run()
    duration = max((r.finish_s for r in records if r.finish_s is not None), default=0.0)
    counters = _sum_counters([n.stats().get("counters", {}) for n in nodes])
    run = SimRun(records=records, samples=samples, counters=counters, duration_s=duration,
                 num_steps=sum(n.executor.num_steps for n in nodes), busy_s=sum(n.executor.busy_s for n in nodes),
                 num_events=events.num_events, wall_s=time.perf_counter() - started,
                 cpu_s=time.process_time() - cpu_started,
                 router_decisions=dict(router.decisions), step_profile=_step_profile(nodes))
    # send, submit and next_turn refer to each other (a cycle through their closures, holding the nodes and the
    # trace): emptied here, the replay's state goes with the last reference to it, not at some later full collection.
    del send, next_turn, submit
    if keep_nodes is not None:
        keep_nodes.extend(nodes)
    return run


def _step_profile(nodes: list[SimNode]) -> dict[str, dict]:
    profile = StepProfile()
    for node in nodes:
        profile.merge(node.executor.profile)
    return profile.summary()


def _sum_counters(items: list[Any]) -> Any:
    """Element-wise sum of nested counter dicts (the fleet's counters are its nodes' together)."""
    first = items[0]
    if isinstance(first, dict):
        keys = list(dict.fromkeys(k for item in items for k in item))
        return {k: _sum_counters([item[k] for item in items if k in item]) for k in keys}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(items)
    return first


def _pages(scheduler: Scheduler) -> dict:
    """A node's stats snapshot's "pages" block alone (sampled every stats interval of virtual time)."""
    family = scheduler.family
    return pages_block(family.member_names, pages_state(family, scheduler.pool, scheduler.tiers,
                                                        scheduler.config.pool.page_bytes))


def _sum_pages(pages: list[dict]) -> dict:
    return pages[0] if len(pages) == 1 else _sum_counters(pages)
