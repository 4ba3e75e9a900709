"""Independent deployments (eval/baseline/deployments.py, the benchmark's baseline: the core's scheduler with the
deployments' policies): re-route instead of refuse, one deployment per step, per-deployment batch caps,
escalations only to a slice that holds the request. Fakes, exact states."""
from __future__ import annotations

from functools import partial

import pytest

from eval.baseline.deployments import Deployments, deployments_scheduler
from orchestrator.core.complexity import ComplexityEstimator
from orchestrator.core.errors import InvalidRequestError
from orchestrator.core.types import MemberName, Request, RequestId, SamplingParams
from tests.fakes import fake_vocab
from tests.test_scheduler import Harness

# 120 pages: s 60, m 30, l 30. Pages are 4 tokens of one layer; s/m/l have 2/4/6 layers, no residuals.
BASELINE = {"pool.num_pages": 120, "comparison.static_split": {"s": 0.5, "m": 0.25, "l": 0.25},
            "comparison.use_affinity": False, "comparison.use_load": False, "comparison.cold_handover": True,
            "comparison.reuse_shared_layers": False, "comparison.warmup": False}


def deployments(low_confidence=(), **overrides) -> Harness:
    return Harness(low_confidence=low_confidence, scheduler_factory=deployments_scheduler,
                   **{**BASELINE, "router.sticky_sessions": False, **overrides})


def deployments_of(h: Harness) -> Deployments:
    return h.scheduler.placement


def submit(h: Harness, rid: str, num_prompt_tokens: int, complexity: float, max_tokens: int = 8, start: int = 10):
    request = Request(request_id=RequestId(rid), prompt_token_ids=list(range(start, start + num_prompt_tokens)),
                      sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_s=h.now,
                      complexity_hint=complexity)
    return h.add(request)


def test_a_request_the_routed_slice_cannot_hold_goes_to_a_deployment_that_can():
    h = deployments()
    # 20 + 8 tokens = 7 blocks: s 14 pages, m 28 (<= 30), l 42 (> 30)
    decision = submit(h, "big", 20, complexity=0.9)               # routed to l, which cannot hold it
    assert decision.member == "m" and decision.rerouted_from == "l"
    assert decision.reason.startswith("re-routed l->m (slice too small)")
    small = submit(h, "small", 20, complexity=0.1, start=50)
    assert small.member == "s" and small.rerouted_from is None            # fits where routed: unchanged
    assert deployments_of(h).num_reroutes == 1
    h.run()
    assert h.final("big").spans[0].member == "m" and len(h.tokens("big")) == 8
    # 120 + 8 tokens = 32 blocks: s needs 64 > 60, m 128, l 192: no deployment can hold it
    with pytest.raises(InvalidRequestError, match="no deployment can hold"):
        submit(h, "huge", 120, complexity=0.1, start=200)
    # the shared scheduler refuses what any member cannot hold (the old baseline's refusals)
    shared = Harness(**BASELINE)
    with pytest.raises(InvalidRequestError):
        shared.submit("big", list(range(10, 30)), max_tokens=8)


def test_rerouting_prefers_a_larger_member_over_a_smaller_one():
    h = deployments(**{"comparison.static_split": {"s": 0.25, "m": 0.25, "l": 0.5}})   # s 30, m 30, l 60
    # 24 + 8 tokens = 8 blocks: s 16, m 32 (> 30), l 48 (<= 60): routed to m -> l, not s
    assert submit(h, "a", 24, complexity=0.5).member == "l"


def test_deployments_take_turns_on_the_device():
    h = deployments()
    submit(h, "a", 8, complexity=0.1, max_tokens=6)
    submit(h, "b", 8, complexity=0.5, max_tokens=6, start=60)
    members_per_step = []
    h.run(on_step=lambda plan: members_per_step.append(sorted({b.member for b in plan.batches})))
    assert all(len(m) <= 1 for m in members_per_step)            # never two deployments in one step
    ran = [m[0] for m in members_per_step if m]
    assert ran[:4] == ["s", "m", "s", "m"]                        # round robin while both have work
    assert ran.count("s") == ran.count("m") == 6                 # one prefill (+ first token) and 5 decodes each
    assert len(h.tokens("a")) == len(h.tokens("b")) == 6
    # the shared scheduler runs both members in every step
    shared = Harness(**BASELINE)
    shared.submit("a", list(range(10, 18)), max_tokens=6, pinned_member=MemberName("s"))
    shared.submit("b", list(range(60, 68)), max_tokens=6, pinned_member=MemberName("m"))
    assert sorted(b.member for b in shared.step().batches) == ["m", "s"]


def test_each_deployment_has_its_own_batch_cap():
    h = deployments(**{"scheduler.max_running_requests": 1})
    submit(h, "s1", 8, complexity=0.1)
    submit(h, "s2", 8, complexity=0.1, start=40)
    submit(h, "m1", 8, complexity=0.5, start=80)
    h.step()
    running = {seq.request_id: seq.member for seq in h.scheduler.running}
    assert running == {"s1": "s", "m1": "m"}                     # one per deployment; s2 waits for s1
    h.run()
    assert all(len(h.tokens(r)) == 8 for r in ("s1", "s2", "m1"))


def test_escalation_only_to_a_deployment_that_can_hold_the_request():
    esc = {"escalation.min_tokens": 1, "escalation.window_tokens": 1}
    h = deployments(low_confidence=("s",), **esc)
    submit(h, "fits", 20, complexity=0.1)          # 28 tokens: m's slice holds 28 pages of 30
    submit(h, "too_big", 24, complexity=0.1, start=60)   # 32 tokens: m needs 32 pages > 30, l 48 > 30
    h.run()
    assert [s.member for s in h.final("fits").spans][:2] == ["s", "m"]
    assert [s.member for s in h.final("too_big").spans] == ["s"] and len(h.tokens("too_big")) == 8
    assert deployments_of(h).num_escalations_skipped == 1
    assert h.scheduler.stats.snapshot(time_s=0.0, family="f", members=["s", "m", "l"], pages={}, queue_depth=0,
                                      running={}, waiting={})["counters"]["escalations_refused"] == 1   # in the JSON


def test_independent_deployments_need_a_static_split():
    h = Harness()
    with pytest.raises(ValueError, match="static split"):
        deployments_scheduler(h.family, h.config, h.pool, h.kv, ComplexityEstimator(fake_vocab()))


def submit_session(h: Harness, rid: str, session: str, num_prompt_tokens: int, complexity: float, start: int = 10):
    request = Request(request_id=RequestId(rid), prompt_token_ids=list(range(start, start + num_prompt_tokens)),
                      sampling=SamplingParams(max_tokens=4, ignore_eos=True), arrival_s=h.now,
                      complexity_hint=complexity, session_id=session)
    return h.add(request)


def sticky_deployments(**overrides) -> Harness:
    return Harness(scheduler_factory=deployments_scheduler, **{**BASELINE, "router.sticky_sessions": True, **overrides})


def test_a_session_stays_on_the_member_of_its_first_turn_while_that_member_can_hold_it():
    h = sticky_deployments(**{"comparison.static_split": {"s": 0.1, "m": 0.3, "l": 0.6}})   # s 12, m 36, l 72 pages
    assert submit_session(h, "t0", "chat", 8, complexity=0.1).member == "s"
    h.run()
    later = submit_session(h, "t1", "chat", 12, complexity=0.9)            # would route to l on its own
    assert later.member == "s" and later.reason.startswith("session kept on s")
    h.run()
    # a turn the first member cannot hold goes where routing and placement send it: 28 + 4 tokens are 8 blocks,
    # 16 pages on s (> 12), 48 on l (<= 72)
    too_long = submit_session(h, "t2", "chat", 28, complexity=0.9, start=100)
    assert too_long.member == "l" and not too_long.reason.startswith("session kept")
    # another session, and per-turn routing, are not kept
    assert submit_session(h, "u0", "other", 8, complexity=0.9, start=300).member == "l"
    per_turn = deployments()
    submit_session(per_turn, "t0", "chat", 8, complexity=0.1)
    assert submit_session(per_turn, "t1", "chat", 12, complexity=0.9, start=40).member == "l"


def test_elastic_deployments_draw_from_one_pool():
    elastic = {k: v for k, v in BASELINE.items() if k != "comparison.static_split"}
    h = Harness(scheduler_factory=partial(deployments_scheduler, elastic=True), **elastic)
    # 20 + 8 tokens on l: 42 pages, more than l's static slice (30) but within the pool (120): no re-route
    decision = submit(h, "big", 20, complexity=0.9)
    assert decision.member == "l" and decision.rerouted_from is None
    h.run()
    assert len(h.tokens("big")) == 8 and h.pool.num_used_pages() == 0
    with pytest.raises(ValueError, match="elastic"):
        deployments_scheduler(h.family, h.config, h.pool, h.kv, ComplexityEstimator(fake_vocab()))   # no split
