"""Members on devices of their own step on their own timelines (eval/simulate/node.py), for MFS's one scheduler
and the baseline's deployments alike; a plan for some members never touches another member's requests
(the scheduler's scope, parts.StepScope, narrowed to them). A fake cost model with a fixed cost per member step gives exact times."""
from __future__ import annotations

import pytest

from eval.simulate.clock import EventQueue, VirtualClock
from eval.simulate.cost_model import BatchShape
from eval.simulate.executor import SimExecutor
from eval.simulate.node import SimNode
from eval.systems import system_config, system_scheduler
from orchestrator.core.types import MemberName, Request, RequestId, SamplingParams
from tests.fakes_serving import family_dir
from tests.test_simulate import library

STEP_S = {"tiny-s": 1.0, "tiny-m": 3.0, "tiny-l": 5.0}     # one step of each member, whatever its batch
SPLIT = {"tiny-s": 0.2, "tiny-m": 0.3, "tiny-l": 0.5}       # per-member placement: each device's own pages


class PerMemberCost:
    name = "fixed-per-member"
    saves_overlap = False

    def batch_s(self, shape: BatchShape) -> float:
        return STEP_S[shape.member]

    def step_overhead_s(self) -> float:
        return 0.0

    def copy_s(self, num_bytes: int) -> float:
        return 0.0

    def describe(self) -> dict:
        return {"name": self.name, "source": "test"}


class RecordingExecutor(SimExecutor):
    """Records when each step starts, on which device, and which members it ran."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[float, str | None, list[str]]] = []

    def execute(self, plan):
        assert self._clock is not None
        self.steps.append((self._clock(), self.device, sorted(b.member for b in plan.batches)))
        return super().execute(plan)


def run_node(system: str, requests: list[tuple[str, str, float, int]], members_in_parallel: bool = True,
             share_device: bool = False):
    """requests: (id, pinned member, arrival s, max_tokens). Returns the executor and each request's token times."""
    config = system_config(system, str(family_dir()), 512, SPLIT,
                           {"comparison.static_split": SPLIT, "pool.host_tier_mb": 0, "escalation.enabled": False})
    clock = VirtualClock()
    events = EventQueue(clock)
    token_times: dict[str, list[float]] = {}

    def on_output(out, now):
        token_times.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))

    def make_executor(family, num_pages, page_bytes):
        return RecordingExecutor(family, num_pages, page_bytes, PerMemberCost(), library(), vocab_size=4096,
                                 members_in_parallel=members_in_parallel)

    node = SimNode("n0", config, None, clock, events, make_executor, on_output, system_scheduler(system),
                   share_device=share_device)
    for rid, member, arrival_s, max_tokens in requests:
        request = Request(request_id=RequestId(rid), prompt_token_ids=list(range(10, 18)),
                          sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_s=arrival_s,
                          pinned_member=MemberName(member))
        events.push(arrival_s, lambda request=request: node.submit(request))
    events.run()
    return node.executor, token_times


REQUESTS = [("a", "tiny-s", 0.0, 4), ("b", "tiny-m", 0.0, 3), ("c", "tiny-s", 1.5, 2)]


@pytest.mark.parametrize("system", ["mfs", "baseline"])
def test_each_member_steps_on_its_own_device_at_its_own_pace(system):
    executor, tokens = run_node(system, REQUESTS)
    # tiny-s: a's prefill at 0, its decodes at 1, 2, 3; c arrives at 1.5 while tiny-s is mid-step and joins its
    # next step (2). tiny-m: b's prefill at 0, decodes at 3 and 6, never waiting for tiny-s nor holding it back.
    assert [(t, d) for t, d, _ in executor.steps if d == "tiny-s"] == [(0.0, "tiny-s"), (1.0, "tiny-s"),
                                                                        (2.0, "tiny-s"), (3.0, "tiny-s")]
    assert [(t, d) for t, d, _ in executor.steps if d == "tiny-m"] == [(0.0, "tiny-m"), (3.0, "tiny-m"),
                                                                        (6.0, "tiny-m")]
    assert all(members == [device] for _, device, members in executor.steps)     # a plan is one device's
    assert tokens == {"a": [1.0, 2.0, 3.0, 4.0], "b": [3.0, 6.0, 9.0], "c": [3.0, 4.0]}
    assert executor.busy_s == 4 * 1.0 + 3 * 3.0          # device-seconds: each device's own steps


def test_on_one_device_mfs_steps_its_members_together_and_the_deployments_take_turns():
    """Colocated (members share the device): MFS's one step runs both members' batches one after the other;
    the deployments time-slice the device, one deployment per step."""
    requests = [("a", "tiny-s", 0.0, 2), ("b", "tiny-m", 0.0, 2)]
    executor, tokens = run_node("mfs", requests, members_in_parallel=False)
    assert [(t, members) for t, _, members in executor.steps] == [(0.0, ["tiny-m", "tiny-s"]), (4.0, ["tiny-m", "tiny-s"])]
    assert tokens == {"a": [4.0, 8.0], "b": [4.0, 8.0]}
    executor, tokens = run_node("baseline", requests, members_in_parallel=False)
    assert [(t, members) for t, _, members in executor.steps] == [(0.0, ["tiny-s"]), (1.0, ["tiny-m"]),
                                                                  (4.0, ["tiny-s"]), (5.0, ["tiny-m"])]
    assert tokens == {"a": [1.0, 5.0], "b": [4.0, 8.0]}


def on(h, member):
    """h's scheduler, its plans narrowed to `member` (a device of its own)."""
    h.scheduler.scope.members = (member,)
    return h.scheduler


def test_a_plan_for_one_member_leaves_the_others_requests_alone():
    """While tiny-s's step is in flight, a plan for tiny-m neither steps, grows, preempts nor admits tiny-s's
    requests; tiny-s's own plan then admits its waiting request."""
    from tests.test_scheduler import Harness

    h = Harness(**{"comparison.static_split": {"s": 0.5, "m": 0.25, "l": 0.25}})
    h.submit("a", list(range(10, 18)), max_tokens=3, pinned_member=MemberName("s"))
    h.submit("b", list(range(30, 38)), max_tokens=3, pinned_member=MemberName("m"))
    plan_s, _ = on(h, "s").schedule(0.0)
    assert [b.member for b in plan_s.batches] == ["s"]
    h.submit("c", list(range(50, 58)), max_tokens=3, pinned_member=MemberName("s"))
    a = h.scheduler.running.get(RequestId("a"))
    pages_a = list(a.kv.all_pages())
    plan_m, _ = on(h, "m").schedule(0.5)
    assert [b.member for b in plan_m.batches] == ["m"]
    assert [c.request_id for b in plan_m.batches for c in b.chunks] == ["b"]
    assert list(a.kv.all_pages()) == pages_a                               # not grown for a step it is not in
    assert h.scheduler.running.get(RequestId("c")) is None                 # tiny-s's queue waits for tiny-s
    assert on(h, "s").has_work() and on(h, "m").has_work() and not on(h, "l").has_work()
    h.scheduler.update(plan_s, h.executor.execute(plan_s), 1.0)
    plan_s, _ = on(h, "s").schedule(1.0)
    assert sorted(c.request_id for b in plan_s.batches for c in b.chunks) == ["a", "c"]
    assert h.scheduler.running.get(RequestId("b")).num_generated == 0      # b's step is still in flight


def test_an_abort_of_a_request_in_another_members_step_waits_for_that_members_plan():
    from tests.test_scheduler import Harness

    h = Harness(**{"comparison.static_split": {"s": 0.5, "m": 0.25, "l": 0.25}})
    h.submit("a", list(range(10, 18)), max_tokens=3, pinned_member=MemberName("s"))
    plan_s, _ = on(h, "s").schedule(0.0)
    h.scheduler.abort(RequestId("a"))
    _, outputs = on(h, "m").schedule(0.5)
    assert outputs == [] and h.scheduler.running.get(RequestId("a")) is not None
    assert on(h, "s").has_work() and not on(h, "m").has_work()
    h.scheduler.update(plan_s, h.executor.execute(plan_s), 1.0)
    _, outputs = on(h, "s").schedule(1.0)
    assert [o.request_id for o in outputs] == ["a"] and outputs[0].finished


def test_deployments_sharing_one_device_progress_at_its_speed_divided_among_the_steps_in_flight():
    """Processor sharing (separate processes on one device): tiny-s (1 s a step) and tiny-m (3 s) start at 0 and
    each runs at half speed while both are in flight: tiny-s's steps end at 2 and 4 (tiny-m has done 1 s of its 3
    by 2, 2 s by 4); from 4 both have 1 s left and end together at 6; tiny-m's second step then runs alone, 6 to 9."""
    requests = [("a", "tiny-s", 0.0, 3), ("b", "tiny-m", 0.0, 2)]
    executor, tokens = run_node("baseline", requests, members_in_parallel=False, share_device=True)
    assert [(t, d) for t, d, _ in executor.steps] == [(0.0, "tiny-s"), (0.0, "tiny-m"), (2.0, "tiny-s"),
                                                      (4.0, "tiny-s"), (6.0, "tiny-m")]
    assert tokens["a"] == pytest.approx([2.0, 4.0, 6.0])
    assert tokens["b"] == pytest.approx([6.0, 9.0])
