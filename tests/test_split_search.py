"""The split search's shortlist: its ranking model of independent deployments, step by step, and the ranking."""
from __future__ import annotations

import math

import pytest

from eval.baseline.split_search import SimSession, SimTurn, SplitSimulator, candidate_splits, search_split

LAYERS = {"s": 1, "l": 2}


def simulator(num_pages=40) -> SplitSimulator:
    # 4 tokens per block; a block holds one page per layer (the shape of KVCacheManager.pages_for_tokens)
    return SplitSimulator(["s", "l"], lambda m, n: math.ceil(n / 4) * LAYERS[m], num_pages,
                          step_s={"s": 1.0, "l": 2.0}, block_tokens={"s": 4, "l": 4})


def one(prompt, max_tokens, routed, spans=(), arrival=0.0):
    return SimSession(arrival, [SimTurn(prompt, max_tokens, 0.0, routed, list(spans))])


def test_one_request_prefill_then_decodes():
    result = simulator().run({"s": 0.5, "l": 0.5}, [one(4, 3, "s")])
    # prefill of 4 tokens: 1 x (1 + 3/16) = 1.1875 s (samples token 1), then two decode steps of 1 s
    assert result["mean_token_latency_s"] == pytest.approx(3.1875 / 3)
    assert (result["num_requests"], result["reroutes"], result["escalations"]) == (1, 0, 0)


def test_deployments_take_turns():
    result = simulator().run({"s": 0.5, "l": 0.5}, [one(4, 2, "s"), one(4, 2, "l")])
    # s prefill 1.1875, l prefill 2.375 (-> 3.5625), s decode 1 (-> 4.5625: s done), l decode 2 (-> 6.5625)
    assert result["mean_token_latency_s"] == pytest.approx((4.5625 / 2 + 6.5625 / 2) / 2)


def test_reroute_when_the_routed_slice_cannot_hold_the_request():
    sim = simulator()
    split = {"s": 0.75, "l": 0.25}                   # s 30 pages, l 10: 23 tokens need 12 pages on l
    assert sim.placement({"s": 30, "l": 10}, "l", 23) == "s"
    result = sim.run(split, [one(20, 3, "l")])
    assert result["reroutes"] == 1 and result["num_requests"] == 1
    assert not sim.feasible(split, [one(20, 3, "l")])    # re-routed down to s: not a split to pick
    assert sim.feasible(split, [one(20, 3, "s")])
    assert not sim.feasible({"s": 0.1, "l": 0.9}, [one(300, 4, "s")])    # needs 76 pages on s, 152 on l


def test_escalation_replays_the_pilot_spans_with_a_cold_handover():
    result = simulator().run({"s": 0.5, "l": 0.5}, [one(4, 3, "s", spans=[("s", 1), ("l", 2)])])
    # s prefill 1.1875 (token 1, hands over), l recomputes prompt + 1 token: 2 x (1 + 4/16) = 2.5 (token 2),
    # one l decode of 2 s (token 3)
    assert result["escalations"] == 1
    assert result["mean_token_latency_s"] == pytest.approx((1.1875 + 2.5 + 2.0) / 3)
    # an escalation whose target slice cannot hold the request is skipped: all three tokens on s
    # (l's 4 pages cannot hold 8 + 3 tokens: 3 blocks x 2 layers) - not a split the search would pick:
    sessions = [one(8, 3, "s", spans=[("s", 1), ("l", 2)])]
    assert not simulator().feasible({"s": 0.9, "l": 0.1}, sessions) and simulator().feasible({"s": 0.5, "l": 0.5}, sessions)
    skipped = simulator().run({"s": 0.9, "l": 0.1}, [one(8, 3, "s", spans=[("s", 1), ("l", 2)])])
    assert skipped["escalations"] == 0 and skipped["mean_token_latency_s"] == pytest.approx((1 + 7 / 16 + 2) / 3)


def test_a_short_slice_preempts_the_youngest_and_everything_still_finishes():
    sim = simulator(num_pages=20)
    sessions = [one(8, 12, "s", arrival=0.0), one(8, 12, "s", arrival=0.0), one(8, 12, "s", arrival=0.0)]
    result = sim.run({"s": 0.5, "l": 0.5}, sessions)   # s has 10 pages; each needs up to 6
    assert result["num_requests"] == 3 and result["preemptions"] >= 1


def test_search_ranks_the_splits_without_reroutes_first_by_the_models_score():
    assert len(candidate_splits(["s", "l"], grid=10)) == 9
    assert len(candidate_splits(["a", "b", "c"], grid=20)) == 171
    sessions = [one(40, 8, "l", arrival=0.1 * i) for i in range(6)] + [one(8, 4, "s", arrival=0.05)]
    search = search_split(simulator(num_pages=100), {1.0: sessions}, grid=10, extra=[{"s": 0.5, "l": 0.5}])
    assert search["num_candidates"] == 9                 # the extra split is one of the grid's: counted once
    # l's requests need 24 pages on l: splits giving l less (s at 0.8, 0.9) would need re-routes (up, to l)
    assert search["num_without_reroutes"] == 7
    first = search["ranked"][:7]
    assert all(e["rule"] == "no re-route" for e in first)
    assert [e["model_score_s"] for e in first] == sorted(e["model_score_s"] for e in first)
    assert {e["split"]["s"] for e in first} == {0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7}
    assert first[0]["split"]["l"] > 0.5                  # the l-heavy traffic gets most of the pages
    # s at 0.8 and 0.9 leave l's slice short of l's requests: l's can only go down, so they are never ranked
    assert len(search["ranked"]) == 7


def test_search_ranks_upward_reroutes_after_the_splits_that_need_none():
    sim = simulator(num_pages=40)
    # s's request (44 tokens) needs 11 pages on s or 22 on l; l's (64 tokens) 32 on l: no split of 40 pages
    # holds both where routed (s >= 0.3 and l >= 0.8)
    sessions = [one(40, 4, "s"), one(60, 4, "l", arrival=0.5)]
    assert not any(sim.feasible(c, sessions) for c in candidate_splits(["s", "l"], grid=10))
    search = search_split(sim, {1.0: sessions}, grid=10)
    assert search["num_without_reroutes"] == 0
    # l needs 0.8 for its own request; s's request then goes up to l (never l's down to s)
    assert sorted(e["split"]["s"] for e in search["ranked"]) == [0.1, 0.2]
    assert all(e["rule"] == "re-routes to a larger member" for e in search["ranked"])
    with pytest.raises(ValueError, match="no split"):
        search_split(sim, {1.0: [one(200, 4, "l")]}, grid=10)   # 51 blocks: no slice of 40 pages holds it
