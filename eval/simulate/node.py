"""One serving node in virtual time: the core exactly as every runner assembles it (EngineCore: pool, KV
cache manager, tiers, scheduler, router, escalation), with the SimExecutor in the engine's place.

The real loop runs a step's two halves back to back (EngineCore.step); here they run as two events: at the
step's start begin_step (schedule, tier copies, execute, which says how long the step takes), at its end
finish_step (update), whose outputs go to the driver. Requests that arrive meanwhile are added at their arrival
time, as the real loop adds them between steps.

Devices: when the members share one device (colocated) that is the node's one timeline. When each member has
its own (the executor's members_in_parallel: per-member placement), each member is a timeline of its own: a
free device whose member has work asks the scheduler for a plan for that member alone (the scheduler's scope,
parts.StepScope, narrowed to it; the executor told the device it prices), executes it at that member's cost and
updates it at its own end, while the other devices' plans run. The scheduler never touches a request of a member
outside the scope, so a request in a step in flight is not planned again before that step's update; one
scheduler (MFS) and one scheduler per deployment alike step each device on its own.

A fleet whose nodes are homes to members (fleet.py, driver.py) moves a waiting escalated request to its new
member's home: SimCore adds that move to the core, the request unended, its tokens, progress and monitor with it.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from eval.composition import core_parts, scheduler_policies, system_family
from eval.simulate.clock import EventQueue, VirtualClock
from eval.simulate.executor import SimExecutor
from orchestrator.core.config import MFSConfig
from orchestrator.core.engine_core import EngineCore, Sink, Step
from orchestrator.core.errors import InvalidRequestError, MFSError
from orchestrator.core.events import EventKind
from orchestrator.core.family import FamilySpec
from orchestrator.core.handover import release_pin
from orchestrator.core.placement import Placement, SharedPoolPlacement
from orchestrator.core.scheduler import Scheduler
from orchestrator.core.sequence import Sequence
from orchestrator.core.types import Request, RequestOutput, RouteDecision

# Nothing runnable although work is queued (e.g. the only waiting request needs pages a finishing one still
# holds): the real loop waits 10 ms for a wake-up; so does the simulated one.
IDLE_RETRY_S = 0.01


class Device:
    """One device's timeline: the members it runs (None: every member) and whether a step is planned or running."""

    __slots__ = ("members", "name", "busy")

    def __init__(self, members: tuple[str, ...] | None) -> None:
        self.members = members
        self.name = None if members is None else "+".join(members)
        self.busy = False           # a step is running or a start is queued (a free device with work starts one)


class SharedDevice:
    """Timelines that share one device, as separate server processes do (CUDA streams or MPS): processor sharing,
    each of the k steps in flight progressing at 1/k of the device's speed. The steps' costs are charged in full
    and nothing is lost to switching between them: the most a time-shared device gives the deployments."""

    __slots__ = ("clock", "events", "_running", "_last_s", "_generation")

    def __init__(self, clock: VirtualClock, events: EventQueue) -> None:
        self.clock = clock
        self.events = events
        self._running: dict[Device, tuple[float, Callable[[], None]]] = {}   # remaining work (s alone), on done
        self._last_s = 0.0
        self._generation = 0            # finish events pushed before the last change are stale

    def start(self, device: Device, work_s: float, on_done: Callable[[], None]) -> None:
        self._advance()
        self._running[device] = (work_s, on_done)
        self._reschedule()

    def _advance(self) -> None:
        now = self.clock()
        if self._running:
            done = (now - self._last_s) / len(self._running)
            self._running = {d: (max(0.0, w - done), cb) for d, (w, cb) in self._running.items()}
        self._last_s = now

    def _reschedule(self) -> None:
        self._generation += 1
        now, share, generation = self.clock(), len(self._running), self._generation
        for device, (work_s, _cb) in self._running.items():
            self.events.push(now + work_s * share, partial(self._finish, device, generation))

    def _finish(self, device: Device, generation: int) -> None:
        if generation != self._generation or device not in self._running:
            return
        self._advance()
        _work, on_done = self._running.pop(device)
        self._reschedule()
        on_done()


class HomePlacement:
    """MFS's placement on a node of a fleet whose nodes are homes to members (eval/simulate/fleet.py): a request
    escalated to a member homed elsewhere moves to that member's home, so a warm-up for it here would not be read."""

    def __init__(self, inner: Placement, homes: frozenset[str]) -> None:
        self.inner = inner
        self.homes = homes

    def check_fits(self, request: Request) -> None:
        self.inner.check_fits(request)

    def holds(self, member: str, request: Request) -> bool:
        return self.inner.holds(member, request)

    def place(self, decision: RouteDecision, request: Request) -> RouteDecision:
        return self.inner.place(decision, request)

    def accepts_escalation(self, seq: Sequence) -> bool:
        return self.inner.accepts_escalation(seq)

    def warms_up(self, member: str) -> bool:
        return member in self.homes


def homed_scheduler(homes: frozenset[str]) -> Callable[..., Scheduler]:
    """MFS's scheduler (with the system's switches) on a node that is home to `homes` (EngineCore's
    scheduler_factory signature)."""
    def build(family, config, pool, kv, estimator, tiers=None, events=None, stats=None) -> Scheduler:
        capacity = {m.name: pool.num_available_pages_total(m.name) for m in family.members}
        placement = HomePlacement(SharedPoolPlacement(family, kv, capacity), homes)
        return Scheduler(family, config, pool, kv, estimator, tiers, events, stats,
                         policies=scheduler_policies(family, config, placement=placement))
    return build


class SimCore(EngineCore):
    """The core as EngineCore assembles it, and the move of a waiting request between two nodes' cores."""

    def move_out(self, seq: Sequence) -> Sequence:
        """Takes a waiting request out without ending it (no output; the source pages it kept go back), for
        another node's core to move_in with its tokens, progress and monitor: the request continues there."""
        scheduler = self.scheduler
        with self.lock:
            if scheduler.lifecycle.by_id.get(seq.request_id) is not seq or seq.kv is not None or seq.is_warmup:
                raise ValueError(f"request {seq.request_id} is not a waiting request of this scheduler")
            release_pin(seq, scheduler.kv, scheduler.running)
            seq.drop_draft(scheduler.kv)
            scheduler.waiting.remove(seq)
            scheduler.lifecycle.forget(seq)
            seq.warmup_member = None        # a warm-up it had here is no use there
        self.detach(seq.request_id)
        return seq

    def move_in(self, seq: Sequence, sink: Sink) -> None:
        """Adopts a request another node's core moved out, its outputs to sink: it resumes first, on the member it
        was moved for (prefilling its prompt and generated tokens there, from this node's cache where it has
        them)."""
        self._enqueue(seq.request_id, sink, lambda: self._adopt(seq))

    def _adopt(self, seq: Sequence) -> None:
        scheduler = self.scheduler
        if seq.request_id in scheduler.lifecycle.by_id:
            raise InvalidRequestError(f"duplicate request id {seq.request_id}", param="request_id")
        scheduler.placement.check_fits(seq.request)
        seq.count_query = True
        scheduler.lifecycle.register(seq)
        scheduler.waiting.push(seq, front=True)
        scheduler.events.emit(EventKind.ROUTE, self.clock(), seq.request_id, seq.member, reason="moved in")


def moved_out(scheduler: Scheduler, homes: frozenset[str]) -> list[Sequence]:
    """The escalated requests waiting for a member outside `homes`, which that member's home serves better."""
    return [seq for seq in scheduler.waiting if seq.num_escalations and seq.kv is None and not seq.is_warmup
            and seq.member not in homes]


class SimNode:
    def __init__(self, name: str, config: MFSConfig, family: FamilySpec | None, clock: VirtualClock,
                 events: EventQueue, make_executor: Callable[[FamilySpec, int, int], SimExecutor],
                 on_output: Callable[[RequestOutput, float], None], scheduler_factory=None,
                 share_device: bool = False, homes: tuple[str, ...] | None = None, tiers=None) -> None:
        """share_device: on one device, each member is a timeline of its own sharing it (SharedDevice): separate
        deployments' processes; else the members on one device step together (one scheduler, one loop).
        homes: the members this node is home to in a fleet with member homes (None: every member). tiers: the
        tiers source when not the config's own (EngineCore's `tiers`)."""
        from orchestrator.serve.tokenizer import family_estimator

        if homes is not None:
            assert scheduler_factory is None, "member homes are a placement of MFS's one scheduler per node"
            scheduler_factory = homed_scheduler(frozenset(homes))
        self.homes = None if homes is None else frozenset(homes)

        self.name = name
        self.clock = clock
        self.events = events
        self.on_output = on_output
        # The family is loaded as the bench loads it when none is given; routing scores prompts with the
        # tokenizer's estimator, as serving does. No thread, no asyncio: this node steps the core itself.
        core = SimCore(config, family if family is not None else system_family(config), clock=clock,
                       estimator=family_estimator, make_executor=make_executor,
                       **core_parts(config, scheduler_factory, tiers))
        assert isinstance(core, SimCore)
        self.core = core
        self.family = self.core.family
        self.scheduler = self.core.scheduler
        executor = self.core.executor
        assert isinstance(executor, SimExecutor)
        self.executor = executor
        self.executor.attach_clock(clock)       # it sees the idle gaps between its steps
        # one timeline per device: the whole family on one device (members None: every member), else one per member
        # (on its own device, or sharing the one device)
        per_member = self.executor.members_in_parallel or share_device
        self.devices = ([Device(None)] if not per_member else [Device((name,)) for name in self.family.member_names])
        self.shared = SharedDevice(clock, events) if share_device and not self.executor.members_in_parallel else None
        self.num_in_flight = 0          # requests submitted and not finished (the front router's load)
        # a fleet with member homes: where an escalated request for a member homed elsewhere goes (driver.py)
        self.on_move_out: Callable[[SimNode, Sequence], None] | None = None

    # ------------------------------------------------------------------ requests
    def submit(self, request: Request) -> None:
        """Adds the request now (raises the scheduler's InvalidRequestError / QueueFullError at once)."""
        self.core.add_request(request, self._deliver)
        self.num_in_flight += 1
        self._wake_idle()

    def _wake_idle(self, but: Device | None = None) -> None:
        """Every idle device whose members have work starts a step now."""
        for device in self.devices:
            if device is not but and not device.busy and self._on(device).has_work():
                device.busy = True
                self.events.push(self.clock(), partial(self._start_step, device))

    def adequate_member(self, request: Request) -> str:
        """The member this node's router would judge the request is for, before load and affinity (the front
        router's member homes need it)."""
        return self.scheduler.routing.router.adequate_member(self.scheduler.complexity_of(request))

    def moved_out(self) -> list[Sequence]:
        return [] if self.homes is None else moved_out(self.scheduler, self.homes)

    def move_out(self, seq: Sequence) -> None:
        self.core.move_out(seq)
        self.num_in_flight -= 1

    def move_in(self, seq: Sequence) -> None:
        self.core.move_in(seq, self._deliver)
        self.num_in_flight += 1
        self._wake_idle()

    # ------------------------------------------------------------------ steps
    def _on(self, device: Device) -> Scheduler:
        """The scheduler, its plans (and has_work) for `device`'s members alone, the executor pricing `device`."""
        self.scheduler.scope.members = device.members
        self.executor.device = device.name
        return self.scheduler

    def _start_step(self, device: Device) -> None:
        now = self.clock()
        self._on(device)
        step = self.core.begin_step()
        if not step.ran:
            if self._on(device).has_work():
                self.events.push(now + IDLE_RETRY_S, lambda: self._start_step(device))
            else:
                device.busy = False
            return
        if self.shared is not None:
            self.shared.start(device, self.executor.last_step_s, lambda: self._finish_step(device, step))
        else:
            self.events.push(now + self.executor.last_step_s, lambda: self._finish_step(device, step))

    def _finish_step(self, device: Device, step: Step) -> None:
        self.core.finish_step(step)
        if self.on_move_out is not None:
            for seq in self.moved_out():
                self.on_move_out(self, seq)
        if self._on(device).has_work():
            self._start_step(device)
        else:
            device.busy = False
        if len(self.devices) > 1:
            self._wake_idle(but=device)     # an escalation to another member, or pages its step returned

    def _deliver(self, out: RequestOutput | MFSError) -> None:
        """Every request's sink: the driver gets each output at the node's time (a step never fails here: an
        error raises out of the event loop instead)."""
        assert isinstance(out, RequestOutput)
        if out.finished:
            self.num_in_flight -= 1
        self.on_output(out, self.clock())

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        return self.scheduler.snapshot(self.clock())
