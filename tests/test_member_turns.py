"""Token-level member scheduling (orchestrator/core/member_turns.py): frequencies, the TPOT guard, the turns."""
from __future__ import annotations

import math

import pytest

from orchestrator.core.member_turns import MemberTurns
from orchestrator.core.request_queue import RunningSet
from orchestrator.core.types import Request, SamplingParams
from tests.fakes import independent_family


def turns(max_slowdown: float, costs: dict[str, float]) -> MemberTurns:
    return MemberTurns(independent_family(), max_slowdown, cost=lambda member, _n: costs[member])


def test_frequencies_follow_the_square_root_rule_with_the_largest_at_one():
    freq = turns(10.0, {"s": 1.0, "l": 9.0}).frequencies({"s": 10, "l": 10})
    assert freq == pytest.approx({"s": 1.0, "l": 1 / 3})
    # more requests on the large member: it steps more often
    assert turns(10.0, {"s": 1.0, "l": 9.0}).frequencies({"s": 10, "l": 90}) == pytest.approx({"s": 1.0, "l": 1.0})


@pytest.mark.parametrize("slowdown", [1.0, 1.05, 1.1, 2.0])
def test_the_guard_bounds_every_members_period(slowdown):
    costs = {"s": 1.0, "l": 9.0}
    freq = turns(slowdown, costs).frequencies({"s": 10, "l": 10})
    step = sum(freq[m] * costs[m] for m in freq)
    every_step = sum(costs.values())
    assert all(step / f <= slowdown * every_step * (1 + 1e-9) for f in freq.values())
    if slowdown == 1.0:
        assert freq == pytest.approx({"s": 1.0, "l": 1.0})            # no member may slow down: all step
    elif 12.0 > slowdown * every_step:       # unguarded, l's period would be 12: the guard binds exactly
        assert step / freq["l"] == pytest.approx(slowdown * every_step)
    else:
        assert freq["l"] == pytest.approx(1 / 3)


class _Seq:
    def __init__(self, member: str, decoding: bool, rid: str, max_tokens: int = 100) -> None:
        self.member, self._decoding, self.request_id = member, decoding, rid
        self.num_computed_tokens = 300 if member == "l" else 100
        self.request = Request(request_id=rid, prompt_token_ids=[1], arrival_s=0.0,
                               sampling=SamplingParams(max_tokens=max_tokens))

    def is_decoding(self) -> bool:
        return self._decoding


def _running(*seqs) -> RunningSet:
    running = RunningSet()
    for seq in seqs:
        running.add(seq)
    return running


def test_a_member_steps_at_its_frequency_and_at_once_with_prefill_work():
    policy = turns(10.0, {"s": 1.0, "l": 9.0})
    running = _running(*[_Seq("s", True, f"s{i}") for i in range(10)], *[_Seq("l", True, f"l{i}") for i in range(10)])
    large_steps = sum(any(q.member == "l" for q in policy.select(running)) for _ in range(10))
    assert large_steps == 3            # f = 1/3 at first (its realized share of the steps moves it: a test below)
    prefill = _running(_Seq("s", True, "a"), _Seq("l", False, "b"))
    assert {q.member for q in policy.select(prefill)} == {"s", "l"}
    alone = _running(_Seq("l", True, "c"))
    assert [q.member for q in policy.select(alone)] == ["l"]        # one member: it steps every time


def test_without_a_cost_function_the_shape_orders_the_members():
    from orchestrator.core.member_turns import shape_weight_bytes

    family = independent_family()
    small, large = (shape_weight_bytes(m) for m in family.members)
    assert large > small > 0
    assert not math.isnan(MemberTurns(family, 2.0).frequencies({"s": 4, "l": 4})["l"])
    with pytest.raises(ValueError, match=">= 1"):
        MemberTurns(family, 0.5)


@pytest.mark.parametrize("family_name,setting,expect", [("independent", None, True), ("independent", 0.0, False),
                                                        ("nested", None, False), ("nested", 3.0, True)])
def test_member_turns_are_on_by_default_for_independent_families_only(family_name, setting, expect):
    from tests.fakes import nested_family
    from tests.test_scheduler import Harness

    family = independent_family() if family_name == "independent" else nested_family()
    h = Harness(family=family, **{"scheduler.member_turns": setting})
    assert isinstance(h.scheduler.batches.step_members, MemberTurns) == expect


def test_each_request_counts_once_whatever_its_length():
    """The weights are the members' request rates: twice the requests in flight, each twice as long, is the same
    rate, so equal costs give equal turns; twice the requests of the same length, twice the weight."""
    equal = turns(10.0, {"s": 1.0, "l": 1.0})
    longer = _running(*[_Seq("s", True, f"s{i}", 100) for i in range(10)],
                      *[_Seq("l", True, f"l{i}", 200) for i in range(20)])
    assert all(sum(any(q.member == m for q in equal.select(longer)) for _ in range(20)) == 20 for m in "sl")
    more = _running(*[_Seq("s", True, f"s{i}", 100) for i in range(10)],
                    *[_Seq("l", True, f"l{i}", 100) for i in range(20)])
    policy = turns(10.0, {"s": 1.0, "l": 1.0})
    small_steps = sum(any(q.member == "s" for q in policy.select(more)) for _ in range(10))
    assert small_steps in (6, 7)                     # f = 1 / sqrt(2) at first


def test_a_members_realized_share_of_the_steps_scales_its_requests():
    """The requests in flight on a member that steps at f are w / f (Little's law): weighted by the share it has
    taken, a fixed running set settles where f = w / c over the largest such ratio, not sqrt of it."""
    policy = turns(100.0, {"s": 1.0, "l": 9.0})
    running = _running(*[_Seq("s", True, f"s{i}") for i in range(10)], *[_Seq("l", True, f"l{i}") for i in range(10)])
    for _ in range(2000):
        policy.select(running)
    assert policy.step_share["s"] == pytest.approx(1.0)
    assert policy.step_share["l"] == pytest.approx(1 / 9, rel=0.1)
    large_steps = sum(any(q.member == "l" for q in policy.select(running)) for _ in range(90))
    assert 8 <= large_steps <= 12


def _three_members() -> MemberTurns:
    from orchestrator.core.family import FamilySpec
    from tests.fakes import fake_member
    return FamilySpec(name="indep3", members=(fake_member("s", 0, 2, ("a0", "a1")),
                                              fake_member("m", 1, 3, ("b0", "b1", "b2")),
                                              fake_member("l", 2, 4, ("c0", "c1", "c2", "c3"))))


@pytest.mark.parametrize("shared_drafts", [False, True])
def test_drafting_members_join_each_others_steps_at_the_same_frequency(shared_drafts):
    """With shared drafts, a drafting member (m, l: above the draft member s) with a quarter of its turn joins a
    step the other takes, so their drafts share the draft forwards: over 400 steps each steps as often as without
    joining (within one step), and m steps beside l far more often."""
    costs = {"s": 1.0, "m": 4.0, "l": 16.0}
    policy = MemberTurns(_three_members(), 10.0, cost=lambda member, _n: costs[member], shared_drafts=shared_drafts)
    running = _running(*[_Seq(member, True, f"{member}{i}") for member in costs for i in range(10)])
    steps = [{q.member for q in policy.select(running)} for _ in range(400)]
    freq = policy.frequencies({m: 10 * policy.step_share[m] / 100 for m in costs})
    assert 0 < freq["l"] < freq["m"] < 1
    counts = {m: sum(m in step for step in steps) for m in costs}
    plain = MemberTurns(_three_members(), 10.0, cost=lambda member, _n: costs[member])
    plain_steps = [{q.member for q in plain.select(running)} for _ in range(400)]
    expected = {m: sum(m in step for step in plain_steps) for m in costs}
    together = sum({"m", "l"} <= step for step in steps)
    if shared_drafts:
        assert all(abs(counts[m] - expected[m]) <= 1 for m in costs)
        assert together >= 0.9 * counts["l"]
    else:
        assert counts == expected and together < 0.7 * counts["l"]


def test_the_executors_estimate_prices_the_forwards_and_the_cost_function_stands_in_until_it_has_one():
    """By default (not priced by weights alone) each decoding member's forward is priced by the executor's estimate
    at its batch and mean context (here l's forward is 9x s's, unlike the cost function's 1:1, so l steps at 1/3);
    while the estimate has no figure for a member, the cost function prices every member (seconds and cost-function
    units do not mix)."""
    asked: list[tuple[str, tuple[int, ...]]] = []
    known = {"s": 1e-3, "l": 9e-3}

    def estimate(forwards):
        (forward,) = forwards
        asked.append((forward.member, forward.decode_contexts))
        return known.get(forward.member)

    running = _running(*[_Seq("s", True, f"s{i}") for i in range(10)], *[_Seq("l", True, f"l{i}") for i in range(10)])
    policy = turns(10.0, {"s": 1.0, "l": 1.0})
    policy.use_step_cost(estimate)
    large_steps = sum(any(q.member == "l" for q in policy.select(running)) for _ in range(10))
    assert large_steps == 3            # f = 1/3 at first, as test_a_member_steps_at_its_frequency... prices it
    assert ("s", (100,) * 10) in asked and ("l", (300,) * 10) in asked
    del known["l"]
    fallback = turns(10.0, {"s": 1.0, "l": 1.0})
    fallback.use_step_cost(estimate)
    assert all(any(q.member == "l" for q in fallback.select(running)) for _ in range(10))  # 1:1: every step


@pytest.mark.parametrize("by_weights,wired", [(True, False), (False, True)])
def test_the_scheduler_hands_its_step_cost_to_member_turns_unless_they_are_priced_by_weights(by_weights, wired):
    from tests.test_scheduler import Harness

    h = Harness(family=independent_family(), **{"comparison.member_turns_by_weights": by_weights})

    def estimate(forwards):
        return 1e-3

    h.scheduler.use_step_cost(estimate)
    assert h.scheduler.speculation.estimate is estimate
    assert (h.scheduler.batches.step_members.estimate is estimate) == wired


def test_a_riding_draft_member_steps_whenever_it_decodes_and_the_turns_are_the_others():
    """riding_draft_member: the draft member s steps in every step it has decodes, even where its turn alone would
    be rarer (few requests, a dear forward here), and m and l share the steps as they would without s."""
    costs = {"s": 4.0, "m": 4.0, "l": 16.0}

    def policy(riding: bool) -> MemberTurns:
        return MemberTurns(_three_members(), 10.0, cost=lambda member, _n: costs[member], shared_drafts=True,
                           riding_draft_member=riding)

    without_s = [_Seq(member, True, f"{member}{i}") for member in "ml" for i in range(10)]
    running = _running(_Seq("s", True, "s0"), *without_s)
    taking_turns = policy(riding=False)
    assert sum(any(q.member == "s" for q in taking_turns.select(running)) for _ in range(100)) < 50
    riding = policy(riding=True)
    steps = [{q.member for q in riding.select(running)} for _ in range(400)]
    assert all("s" in step for step in steps)
    alone, others = policy(riding=False), _running(*without_s)
    expected = [{q.member for q in alone.select(others)} for _ in range(400)]
    assert [step - {"s"} for step in steps] == expected
    assert sum("m" in step for step in steps) == 400          # the top of the others steps every step


@pytest.mark.parametrize("setting,speculation,private,expect", [
    (True, True, False, True), (False, True, False, False), (True, False, False, False), (True, True, True, False)])
def test_the_draft_member_steps_every_step_only_where_it_rides_the_shared_drafts(setting, speculation, private,
                                                                                  expect):
    from tests.test_scheduler import Harness
    h = Harness(family=independent_family(), **{"comparison.draft_member_every_step": setting,
                                                "speculation.enabled": speculation,
                                                "comparison.private_drafts": private})
    policy = h.scheduler.batches.step_members
    assert isinstance(policy, MemberTurns)
    assert (policy.riding_member == independent_family().members[0].name) == expect
