"""Router decisions on a fake 3-member family: pinning, complexity, affinity, session, load, downgrade."""
from __future__ import annotations


import pytest

from orchestrator.core.config import RouterConfig
from orchestrator.core.router import FitPenalties, MemberLoad, Router
from tests.fakes import named_nested_family
from orchestrator.core.types import MemberName, Profile, Request, RequestId, SamplingParams


FAMILY = named_nested_family()
IDLE = MemberLoad(num_running=0, num_waiting=0, running_tokens=0, queued_tokens=0)
IDLE_LOADS = {name: IDLE for name in FAMILY.member_names}


def _request(prompt_tokens: int = 500, *, profile: Profile = Profile.LATENCY, pinned: str | None = None) -> Request:
    return Request(request_id=RequestId("r1"), prompt_token_ids=list(range(prompt_tokens)), sampling=SamplingParams(),
                   arrival_s=0.0, pinned_member=MemberName(pinned) if pinned else None, profile=profile)


def _route(router: Router, request: Request, complexity: float, *, matched: dict | None = None,
           loads: dict | None = None, session: str | None = None):
    return router.route(request, complexity=complexity, matched_prefix_tokens=matched or {},
                        loads=loads or IDLE_LOADS, session_member=session)


@pytest.fixture
def router() -> Router:
    return Router(FAMILY, RouterConfig())


def test_adequate_member_follows_thresholds(router):
    assert [router.adequate_member(c) for c in (0.0, 0.39, 0.4, 0.69, 0.7, 1.0)] == \
        ["tiny-s", "tiny-s", "tiny-m", "tiny-m", "tiny-l", "tiny-l"]


def test_pinned_member_wins_regardless(router):
    decision = _route(router, _request(pinned="tiny-l"), 0.05, matched={"tiny-s": 500}, session="tiny-s")
    assert decision.member == "tiny-l"
    assert decision.reason == "pinned"
    assert decision.downgraded_from is None
    assert set(decision.components) == set(FAMILY.member_names)


def test_pinned_to_unknown_member_is_an_error(router):
    with pytest.raises(ValueError, match="not in family"):
        _route(router, _request(pinned="tiny-xl"), 0.5)


def test_simple_prompt_goes_to_smallest(router):
    decision = _route(router, _request(), 0.1)
    assert decision.member == "tiny-s"
    assert decision.reason == "complexity 0.10 -> tiny-s"


def test_complex_prompt_goes_to_largest(router):
    decision = _route(router, _request(), 0.9)
    assert decision.member == "tiny-l"
    assert decision.downgraded_from is None


def test_mid_complexity_goes_to_middle(router):
    assert _route(router, _request(), 0.62).member == "tiny-m"


def test_affinity_overrides_complexity_when_larger_member_holds_most_of_prompt(router):
    decision = _route(router, _request(500), 0.62, matched={"tiny-l": 480})
    assert decision.member == "tiny-l"
    assert decision.reason == "complexity 0.62 -> tiny-m; 480 cached tokens on tiny-l outweighed it"
    assert decision.matched_prefix_tokens == {"tiny-l": 480}


def test_small_cache_hit_does_not_override_complexity(router):
    # 20 cached tokens are below affinity_min_tokens: no affinity at all.
    decision = _route(router, _request(500), 0.62, matched={"tiny-l": 20})
    assert decision.member == "tiny-m"
    assert decision.components["tiny-l"]["affinity"] == 0.0


def test_affinity_never_pulls_to_a_too_small_member(router):
    decision = _route(router, _request(500), 0.9, matched={"tiny-s": 500})
    assert decision.member == "tiny-l"


def test_session_bonus_breaks_a_near_tie():
    # The bonus is off by default for nested families; set explicitly it still works.
    router = Router(FAMILY, RouterConfig(session_bonus=0.2))
    without = _route(router, _request(500), 0.62, matched={"tiny-l": 70})
    with_session = _route(router, _request(500), 0.62, matched={"tiny-l": 70}, session="tiny-l")
    assert without.member == "tiny-m"
    assert with_session.member == "tiny-l"
    assert with_session.components["tiny-l"]["session"] == pytest.approx(0.2)
    assert "session" in with_session.reason


def test_session_bonus_defaults_to_zero_for_nested_and_applies_to_independent_families(router):
    from tests.fakes import independent_family
    decision = _route(router, _request(500), 0.62, matched={"tiny-l": 70}, session="tiny-l")
    assert router.session_bonus == 0.0
    assert decision.member == "tiny-m" and decision.components["tiny-l"]["session"] == 0.0
    assert Router(independent_family(), RouterConfig()).session_bonus == 0.2


def _delayed(router, large_delay_s: float, medium_delay_s: float = 0.0) -> dict:
    return {"tiny-s": IDLE, "tiny-m": MemberLoad(1, 0, 10, 0, expected_delay_s=medium_delay_s),
            "tiny-l": MemberLoad(1, 3, 100, 300, expected_delay_s=large_delay_s)}   # under downgrade_running


def test_expected_delay_downgrade_fires_within_the_complexity_gap_and_says_so(router):
    trigger = router.config.downgrade_delay_s
    decision = _route(router, _request(500), 0.75, loads=_delayed(router, trigger))   # band of m ends at 0.7
    assert decision.member == "tiny-m" and decision.downgraded_from == "tiny-l"
    assert "expected wait" in decision.reason and "downgraded to tiny-m" in decision.reason


def test_expected_delay_downgrade_respects_the_quality_guard_and_the_trigger(router):
    trigger = router.config.downgrade_delay_s
    far = _route(router, _request(500), 0.7 + router.config.downgrade_max_gap + 0.01, loads=_delayed(router, trigger))
    assert far.member == "tiny-l" and far.downgraded_from is None        # too far above tiny-m's band
    below = _route(router, _request(500), 0.75, loads=_delayed(router, trigger * 0.99))
    assert below.member == "tiny-l" and below.downgraded_from is None    # wait under the trigger
    both = _route(router, _request(500), 0.75, loads=_delayed(router, trigger, medium_delay_s=trigger))
    assert both.member == "tiny-l" and both.downgraded_from is None      # the smaller one is no better


def test_running_count_downgrade_fires_on_a_busy_winner_within_the_gap():
    router = Router(FAMILY, RouterConfig(downgrade_running=2))
    busy = {"tiny-s": IDLE, "tiny-m": MemberLoad(1, 0, 10, 0), "tiny-l": MemberLoad(2, 0, 100, 0)}
    decision = _route(router, _request(500), 0.75, loads=busy)
    assert decision.member == "tiny-m" and decision.downgraded_from == "tiny-l"
    assert "tiny-l runs 2 >= 2 requests, tiny-m within the complexity gap" in decision.reason
    quiet = {**busy, "tiny-l": MemberLoad(1, 0, 100, 0)}
    assert _route(router, _request(500), 0.75, loads=quiet).member == "tiny-l"          # under the count
    far = _route(router, _request(500), 0.7 + router.config.downgrade_max_gap + 0.01, loads=busy)
    assert far.member == "tiny-l" and far.downgraded_from is None                        # the quality guard
    assert RouterConfig().downgrade_running == 2                                         # the default
    off = Router(FAMILY, RouterConfig(downgrade_running=None))
    assert _route(off, _request(500), 0.75, loads=busy).member == "tiny-l"


def test_expected_delay_and_pool_pressure_enter_the_score(router):
    loads = {"tiny-s": MemberLoad(0, 0, 0, 0, pool_pressure=0.5, pages_per_token=0.25),
             "tiny-m": MemberLoad(0, 0, 0, 0, expected_delay_s=0.5, pool_pressure=0.5, pages_per_token=0.5)}
    decision = _route(router, _request(500), 0.5, loads=loads)
    cfg = router.config
    assert decision.components["tiny-m"]["load"] == pytest.approx(-0.6 * 0.5 / cfg.delay_saturation_s)
    assert decision.components["tiny-m"]["pressure"] == pytest.approx(-cfg.pressure_weight * 0.5)
    assert decision.components["tiny-s"]["pressure"] == pytest.approx(-cfg.pressure_weight * 0.5 * 0.5)


def _saturated_large_loads(config: RouterConfig) -> dict[str, MemberLoad]:
    saturation = config.load_saturation_tokens
    return {"tiny-s": IDLE,
            "tiny-m": MemberLoad(num_running=2, num_waiting=0, running_tokens=saturation // 2, queued_tokens=0),
            "tiny-l": MemberLoad(num_running=8, num_waiting=4, running_tokens=saturation, queued_tokens=100)}


def test_saturated_target_is_downgraded_under_latency(router):
    decision = _route(router, _request(profile=Profile.LATENCY), 0.9, loads=_saturated_large_loads(router.config))
    assert decision.member == "tiny-m"
    assert decision.downgraded_from == "tiny-l"
    assert "saturated" in decision.reason and "downgraded to tiny-m" in decision.reason
    assert decision.scores["tiny-l"] > decision.scores["tiny-m"]  # the downgrade, not the score, moved it


def test_saturated_target_is_kept_under_quality(router):
    decision = _route(router, _request(profile=Profile.QUALITY), 0.9, loads=_saturated_large_loads(router.config))
    assert decision.member == "tiny-l"
    assert decision.downgraded_from is None


def test_downgrade_skips_saturated_smaller_members(router):
    full = MemberLoad(1, 1, router.config.load_saturation_tokens, 0)
    decision = _route(router, _request(), 0.9, loads={"tiny-s": IDLE, "tiny-m": full, "tiny-l": full})
    assert decision.member == "tiny-s"
    assert decision.downgraded_from == "tiny-l"


def test_everyone_saturated_stays_put(router):
    full = MemberLoad(1, 1, router.config.load_saturation_tokens, 0)
    decision = _route(router, _request(), 0.9, loads={name: full for name in FAMILY.member_names})
    assert decision.member == "tiny-l"
    assert decision.downgraded_from is None


def test_use_affinity_false_ignores_cache_and_session():
    router = Router(FAMILY, RouterConfig(), use_affinity=False)
    decision = _route(router, _request(500), 0.62, matched={"tiny-l": 500}, session="tiny-l")
    assert decision.member == "tiny-m"
    assert all(c["affinity"] == 0.0 and c["session"] == 0.0 for c in decision.components.values())


def test_use_load_false_ignores_load_and_never_downgrades():
    router = Router(FAMILY, RouterConfig(), use_load=False)
    decision = _route(router, _request(), 0.9, loads=_saturated_large_loads(router.config))
    assert decision.member == "tiny-l"
    assert decision.downgraded_from is None
    assert all(c["load"] == 0.0 for c in decision.components.values())


def test_load_moves_a_borderline_request_and_says_why(router):
    busy = MemberLoad(4, 0, router.config.load_saturation_tokens - 1, 0)  # busy but not saturated
    decision = _route(router, _request(), 0.45, loads={"tiny-s": IDLE, "tiny-m": busy, "tiny-l": IDLE})
    assert decision.member == "tiny-l"
    assert decision.downgraded_from is None
    assert "tiny-m is loaded" in decision.reason


def test_load_sends_no_request_up_a_size_in_an_independent_family_unless_configured():
    """router.load_in_score: on by default for a nested family (above), off for an independent one, where the
    loaded adequate member keeps the request (a larger member's tokens cost more of the device they share)."""
    from tests.fakes import independent_family

    family = independent_family()
    small, large = family.member_names
    config = RouterConfig()
    busy = MemberLoad(4, 0, config.load_saturation_tokens - 1, 0)
    loads = {small: busy, large: IDLE}
    kept = _route(Router(family, config), _request(), 0.2, loads=loads)
    assert kept.member == small
    assert all(c["load"] == 0.0 for c in kept.components.values())
    moved = _route(Router(family, RouterConfig(load_in_score=True)), _request(), 0.2, loads=loads)
    assert moved.member == large and f"{small} is loaded" in moved.reason
    assert Router(FAMILY, RouterConfig(load_in_score=False)).load_in_score is False


def test_ties_go_to_the_smaller_member():
    # Equal fit penalties both ways make tiny-s and tiny-l tie around an adequate tiny-m that is loaded.
    config = RouterConfig()
    router = Router(FAMILY, config, fit=FitPenalties(smaller_per_step=0.15, larger_per_step=0.15))
    busy = MemberLoad(4, 0, config.load_saturation_tokens - 1, 0)
    decision = _route(router, _request(), 0.5, loads={"tiny-s": IDLE, "tiny-m": busy, "tiny-l": IDLE})
    assert decision.scores["tiny-s"] == pytest.approx(decision.scores["tiny-l"])
    assert decision.member == "tiny-s"


def test_components_and_scores_are_complete_and_consistent(router):
    decision = _route(router, _request(500), 0.62, matched={"tiny-m": 200, "tiny-l": 480}, session="tiny-m",
                      loads=_saturated_large_loads(router.config))
    assert set(decision.scores) == set(decision.components) == set(FAMILY.member_names)
    for name, parts in decision.components.items():
        assert set(parts) == {"complexity", "affinity", "load", "session", "pressure"}
        assert decision.scores[name] == pytest.approx(sum(parts.values()))
    assert decision.reason.startswith("complexity 0.62 -> tiny-m")
    assert decision.complexity == 0.62
    assert decision.request_id == "r1"


def test_unknown_profile_falls_back_to_config_profile():
    config = RouterConfig(profile="quality")
    config.profiles = {"quality": config.profiles["quality"]}  # no 'latency' entry
    router = Router(FAMILY, config)
    decision = _route(router, _request(profile=Profile.LATENCY), 0.9, loads=_saturated_large_loads(config))
    assert decision.member == "tiny-l"  # quality weights: no downgrade


def test_missing_loads_and_matches_count_as_idle_and_uncached(router):
    decision = router.route(_request(), complexity=0.1, matched_prefix_tokens={}, loads={},
                            session_member=None)
    assert decision.member == "tiny-s"


def test_empty_prompt_does_not_divide_by_zero(router):
    decision = _route(router, _request(0), 0.1, matched={"tiny-l": 0})
    assert decision.member == "tiny-s"


def test_session_affinity_remembers_the_last_member_and_forgets_the_least_recent():
    from orchestrator.core.router import SessionAffinity

    sessions = SessionAffinity(max_sessions=2)
    sessions.record("a", "tiny-s")
    sessions.record("b", "tiny-m")
    sessions.record("a", "tiny-l")          # a is now the most recent, answered by tiny-l
    sessions.record("c", "tiny-s")          # over the bound: b (least recent) goes
    assert (sessions.get("a"), sessions.get("b"), sessions.get("c")) == ("tiny-l", None, "tiny-s")
    assert len(sessions) == 2


def test_downgrade_skips_a_member_that_escalates_too_many_of_its_requests():
    # tiny-l is busy (2 running, downgrade_running 2); tiny-m is within the gap. With the escalation guard at
    # 0.5, tiny-m is a target only while at most half of its recent requests escalated out of it.
    router = Router(FAMILY, RouterConfig(downgrade_running=2, downgrade_max_escalation_rate=0.5))
    trigger = router.config.downgrade_delay_s

    def loads(rate_m, running_l=1, delay_l=trigger):
        return {"tiny-s": IDLE, "tiny-m": MemberLoad(1, 0, 10, 0, escalation_rate=rate_m),
                "tiny-l": MemberLoad(running_l, 0, 100, 0, expected_delay_s=delay_l)}
    assert _route(router, _request(500), 0.75, loads=loads(0.5)).member == "tiny-m"
    kept = _route(router, _request(500), 0.75, loads=loads(0.51))
    assert kept.member == "tiny-l" and kept.downgraded_from is None
    # A busy (2 running) but not slow winner: the running-count rule ignores the escalation guard.
    assert _route(router, _request(500), 0.75, loads=loads(0.9, running_l=2, delay_l=0.0)).member == "tiny-m"
    # Busy and slow: the wait is a reason, so the guard applies.
    assert _route(router, _request(500), 0.75, loads=loads(0.9, running_l=2)).member == "tiny-l"
    # The saturation rule (no quality guard) skips it too and goes on to the next smaller member.
    full = router.config.load_saturation_tokens
    saturated = {"tiny-s": IDLE, "tiny-m": MemberLoad(1, 0, 10, 0, escalation_rate=0.9),
                 "tiny-l": MemberLoad(8, 4, full, 100)}
    assert _route(router, _request(500), 0.9, loads=saturated).member == "tiny-s"
    worse = {**saturated, "tiny-s": MemberLoad(0, 0, 0, 0, escalation_rate=0.6)}
    assert _route(router, _request(500), 0.9, loads=worse).member == "tiny-l"
    # Off (the default): the rate is ignored.
    assert RouterConfig().downgrade_max_escalation_rate is None
    assert _route(Router(FAMILY, RouterConfig(downgrade_running=2)), _request(500), 0.75,
                  loads=loads(1.0)).member == "tiny-m"

