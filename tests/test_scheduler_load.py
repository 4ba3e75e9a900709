"""The global scheduler under load, exact states over the fakes (fake clock: 0.01 s per step).

Starvation and aging, demand reservation, victim order, escalated requests protected, no admission in a
preempting step, swap vs recompute, escalation pins, stall-aware prefill budget, delay-aware downgrade.
"""
from __future__ import annotations

from orchestrator.core.preemption import VICTIM_ORDERS
from orchestrator.core.events import EventKind
from orchestrator.core.sequence import Sequence
from orchestrator.core.host_tier import HostTier
from orchestrator.core.tiers import TieredStore
from orchestrator.core.types import MemberName, Request, RequestId, SamplingParams
from tests.test_scheduler import PROMPT, Harness

BIG_PROMPT = list(range(3, 103))     # 100 tokens: 25 blocks x 6 pages on l = 150 pages of 256


def _admitted_step(h: Harness, rid: str) -> float | None:
    times = [e.time_s for e in h.scheduler.events.recent() if e.kind is EventKind.ADMIT and e.request_id == rid]
    return round(times[0] / 0.01) if times else None


def _starvation(stop_step: int = 270, **overrides) -> Harness:
    """The issue's scenario: 256 pages, a small-member request every 3 steps until stop_step, one
    100-token large-member request arriving at step 20."""
    h = Harness(**{"pool.num_pages": 256, **overrides})
    for step in range(1, 400):
        if step < stop_step and step % 3 == 0:
            h.submit(f"s{step}", [step % 40 + 3] + PROMPT, max_tokens=16, pinned_member=MemberName("s"))
        if step == 20:
            h.submit("big", BIG_PROMPT, max_tokens=8, pinned_member=MemberName("l"))
        h.step()
    return h


def test_single_server_policy_starves_the_large_member_until_the_small_stream_stops():
    # Per-member head-of-line bypass
    # lets every freed page go to the small stream.
    h = _starvation(**{"scheduler.aging_steps": None, "scheduler.decode_reservation": "block"})
    assert _admitted_step(h, "big") == 272
    assert _admitted_step(_starvation(stop_step=330, **{"scheduler.aging_steps": None}), "big") == 335


def test_aging_holds_pages_for_the_starved_request_and_admits_it_within_the_bound():
    h = _starvation()
    aging = h.config.scheduler.aging_steps
    holds = [e for e in h.scheduler.events.recent() if e.kind is EventKind.HOLD]
    assert [(e.request_id, e.data["waited_steps"]) for e in holds] == [("big", aging)]
    # Held at step 20 + 64; the small requests running then need at most 18 more steps to drain.
    assert _admitted_step(h, "big") == 89 <= 20 + aging + 18
    waits = h.scheduler.snapshot(h.now)["queue_wait_s"]
    assert waits["l"]["count"] == 1 and abs(waits["l"]["p50"] - 0.70) < 1e-9    # arrived 0.19 s, admitted 0.89 s
    assert waits["s"]["count"] > 50 and waits["s"]["p99"] >= waits["s"]["p50"]


def test_aging_bound_is_configurable():
    assert _admitted_step(_starvation(**{"scheduler.aging_steps": 16}), "big") == 41


def _seq(rid, priority=0, generated=0, computed=0, escalations=0, admit_order=0, warmup=False) -> Sequence:
    request = Request(request_id=RequestId(rid), prompt_token_ids=[5] * 8, sampling=SamplingParams(),
                      arrival_s=0.0, priority=priority)
    seq = Sequence(request=request, member=MemberName("m"), token_ids=[5] * (8 + generated), num_prompt_tokens=8,
                   num_computed_tokens=computed, admit_order=admit_order, num_escalations=escalations,
                   is_warmup=warmup)
    return seq


def test_victim_order_priority_then_fresh_before_escalated_then_least_progress():
    seqs = [_seq("escalated", generated=1, computed=4, escalations=1, admit_order=9),
            _seq("much", generated=30, computed=40, admit_order=1),
            _seq("little", generated=2, computed=30, admit_order=2),
            _seq("little-cheap", generated=2, computed=10, admit_order=3),
            _seq("important", priority=-1, generated=0, computed=0, admit_order=8),
            _seq("unimportant", priority=3, generated=50, computed=60, admit_order=0),
            _seq("warmup", priority=100, warmup=True, admit_order=4)]
    order = [s.request_id for s in sorted(seqs, key=VICTIM_ORDERS["priority_progress"])]
    assert order == ["warmup", "unimportant", "little-cheap", "little", "much", "escalated", "important"]
    assert [s.request_id for s in sorted(seqs, key=VICTIM_ORDERS["youngest"])][:2] == ["escalated", "important"]


def _preempt_events(h):
    return [e for e in h.scheduler.events.recent() if e.kind is EventKind.PREEMPT]


def _contention(victim_order: str, tiers=None, host_room=True) -> Harness:
    """An older low-priority request on l, then a fresh important one: the one-block reserve
    overcommits 84 pages, so one must be preempted."""
    h = Harness(tiers=tiers, **{"pool.num_pages": 84, "scheduler.decode_reservation": "block",
                                "scheduler.victim_order": victim_order})
    h.submit("old-low", [3] + PROMPT, max_tokens=20, pinned_member=MemberName("l"), priority=1)
    for _ in range(3):
        h.step()
    h.submit("new-high", [4] + PROMPT, max_tokens=20, pinned_member=MemberName("l"))
    h.submit("queued", [5] + PROMPT, max_tokens=4, pinned_member=MemberName("l"))
    h.run(2000)
    return h


def test_victims_by_priority_not_age_and_no_admission_in_a_preempting_step():
    h = _contention("priority_progress")
    assert {e.request_id for e in _preempt_events(h)} == {"old-low"}
    old = _contention("youngest")
    assert _preempt_events(old)[0].request_id == "new-high"     # the single-server rule (youngest)
    for run in (h, old):
        events = run.scheduler.events.recent()
        preempting = {e.time_s for e in events if e.kind is EventKind.PREEMPT}
        assert preempting and not any(e.kind is EventKind.ADMIT and e.time_s in preempting for e in events)


def test_escalated_request_is_preempted_after_a_fresh_one():
    overrides = {"pool.num_pages": 110, "scheduler.decode_reservation": "block", "escalation.min_tokens": 4,
                 "escalation.window_tokens": 4, "comparison.warmup": False,
                 "router.complexity_thresholds": [0.99, 0.995]}
    victims = {}
    for order in ("priority_progress", "youngest"):
        h = Harness(low_confidence=("s",), **{**overrides, "scheduler.victim_order": order})
        h.submit("fresh", [9] + PROMPT, max_tokens=40, pinned_member=MemberName("m"))
        h.submit("esc", PROMPT, max_tokens=40)
        h.run(3000)
        assert [s.member for s in h.final("esc").spans][:2] == ["s", "m"]
        victims[order] = _preempt_events(h)[0].request_id
    assert victims == {"priority_progress": "fresh", "youngest": "esc"}


def test_preemption_swaps_to_the_host_tier_when_it_has_room_else_recomputes():
    reference = _contention("priority_progress")
    kinds = {}
    for name, capacity in (("room", 1 << 20), ("none", 1)):
        h = _contention("priority_progress", tiers=TieredStore(HostTier(capacity), None))
        counters = h.scheduler.snapshot(h.now)["counters"]
        kinds[name] = counters["preemptions_by_kind"]
        assert counters["preemptions"] == sum(kinds[name].values()) > 0
        for rid in ("old-low", "new-high", "queued"):
            assert h.tokens(rid) == reference.tokens(rid)
    assert kinds["room"]["recompute"] == 0 and kinds["none"]["swap"] == 0
    assert reference.scheduler.snapshot(reference.now)["counters"]["preemptions_by_kind"]["swap"] == 0  # no tier


def test_escalation_keeps_the_source_pages_pinned_until_the_target_admits():
    h = Harness(low_confidence=("s",), **{"escalation.min_tokens": 4, "escalation.window_tokens": 4,
                                          "comparison.warmup": False, "router.complexity_thresholds": [0.99, 0.995]})
    h.submit("e", PROMPT, max_tokens=12)
    while not any(e.kind is EventKind.ESCALATE for e in h.scheduler.events.recent()):
        h.step()
    seq = h.scheduler.lifecycle.by_id["e"]
    assert seq.member == "m" and seq.kv is None and seq.pinned_kv is not None
    pinned = seq.pinned_kv.all_pages()
    assert all(h.pool.refcount(p) >= 1 for p in pinned) and h.pool.num_used_pages("s") == len(pinned)
    h.step()                               # the target admits it, reusing the pinned lower layers
    kept = set(seq.kv.all_pages())
    assert seq.pinned_kv is None and set(pinned) & kept             # the shared layers moved to the target
    assert all(h.pool.refcount(p) == 0 for p in pinned if p not in kept)   # the rest is released now
    handover = [c for m, c in h.executor.chunks_seen if c.request_id == "e" and m == "m"][0]
    assert handover.start_layer == 2


def test_stall_aware_budget_caps_prefill_while_requests_decode():
    chunks = {}
    for budget in (None, 20):
        h = Harness(**{"scheduler.max_batch_tokens": 64, "scheduler.prefill_chunk_tokens": 64,
                       "scheduler.decode_step_token_budget": budget})
        h.submit("decoding", PROMPT, max_tokens=30, pinned_member=MemberName("m"))
        h.step()
        h.step()
        h.submit("long", list(range(3, 103)), max_tokens=2, pinned_member=MemberName("m"))
        h.step()
        chunks[budget] = [len(c.token_ids) for m, c in h.executor.chunks_seen if c.request_id == "long"]
    assert chunks == {None: [63], 20: [19]}     # the budget minus the one decode token


def test_expected_delay_downgrade_fires_in_the_scheduler_and_is_counted():
    # A long l request holds most of the pool and another waits behind it; a request of complexity
    # 0.75 (l's band, 0.05 above m's) would wait for pages on l but fits on m now.
    h = Harness(**{"router.complexity_thresholds": [0.4, 0.7], "router.downgrade_delay_s": 0.05,
                   "escalation.enabled": False})
    h.submit("hog", BIG_PROMPT, max_tokens=44, pinned_member=MemberName("l"))      # 36 blocks = 216 pages
    for _ in range(3):
        h.step()
    h.submit("behind", [4] * 100, max_tokens=4, pinned_member=MemberName("l"))      # does not fit beside it
    h.step()
    loads = h.scheduler.routing.loads(Request(RequestId("probe"), list(PROMPT), SamplingParams(max_tokens=8), h.now))
    assert loads["l"].expected_delay_s >= 0.05 > loads["m"].expected_delay_s
    decision = h.submit("mid", PROMPT, max_tokens=8, complexity_hint=0.75)
    assert decision.member == "m" and decision.downgraded_from == "l"
    assert "downgraded to m" in decision.reason
    far = h.submit("far", [8] * 20, max_tokens=8, complexity_hint=0.9)      # outside the gap
    assert far.member == "l" and far.downgraded_from is None
    snap = h.scheduler.snapshot(h.now)
    assert snap["counters"]["downgrades"] == {"l->m": 1}
    assert any("downgraded to m" in r["reason"] for r in snap["recent_routes"])


def _growth_at(profile, t: int) -> int:
    """The pages a decoding request has allocated beyond now at step t: DecodeProfile's definition, computed plainly."""
    covered = min(profile.final_tokens, profile.tokens_now + t + profile.slack_tokens)
    return max(0, profile.pages_for(covered) - profile.held_pages)


def test_peak_growth_counts_what_ends_before_the_peak():
    from orchestrator.core.demand import DecodeProfile, peak_growth

    def pages(n):               # 4 tokens a block, 2 pages a block
        return -(-n // 4) * 2
    # A: 8 tokens now (4 pages held, all private), ends after 4 steps at 12 tokens: grows 2 pages, then frees 4+2.
    a = DecodeProfile(4, 8, 12, 4, 4, pages, slack_tokens=1, tokens_per_block=4)
    # B: 4 tokens now, grows to 24 over 20 steps (10 more pages), nothing private (a shared prefix).
    b = DecodeProfile(20, 4, 24, 2, 0, pages, slack_tokens=1, tokens_per_block=4)
    assert [_growth_at(a, t) for t in range(4)] == [2, 2, 2, 2] and _growth_at(b, 19) == 10
    # Summing both ends would reserve 12; A's 4 private pages are back before B needs its last ones.
    assert peak_growth([a, b]) == max(2 + _growth_at(b, 3), _growth_at(b, 19) - 4) == 6
    assert peak_growth([]) == 0


def test_pool_demand_pages_rule_is_the_layouts():
    """PoolDemand computes pages_for_tokens per member as one expression (hot at GPU scale): the layout's rule."""
    h = Harness()
    demand = h.scheduler.reservation
    for member in h.family.member_names:
        context = h.family.member(member).context_tokens
        for n in (0, 1, 3, 4, 5, 17, context - 1, context, context + 9):
            assert demand._pages_for[member](n) == h.kv.pages_for_tokens(member, n), (member, n)


def test_the_reservation_bound_and_the_delay_inputs_match_their_definitions():
    """reserved_pages_bound and the router's running demands, read per arrival, against the definitions they
    inline (expected_final_tokens, future_pages) on a running mix: decoding, prefilling, open length."""
    from orchestrator.core.demand import expected_final_tokens, is_length_fixed

    h = Harness(**{"scheduler.prefill_chunk_tokens": 8})
    h.submit("a", PROMPT, max_tokens=20, pinned_member=MemberName("m"))
    h.submit("b", PROMPT[:10], max_tokens=9, ignore_eos=False, pinned_member=MemberName("m"))
    h.submit("c", PROMPT[:7], max_tokens=30, pinned_member=MemberName("s"))
    for steps in range(8):
        h.step()
        demand, kv = h.scheduler.reservation, h.kv
        h.scheduler.running.changed()
        running = list(h.scheduler.running)
        assert running
        expected = 0
        for seq in running:
            ctx = h.family.member(seq.member).context_tokens
            held = seq.kv.num_blocks * kv.pages_per_block(seq.member)
            if seq.is_decoding() and is_length_fixed(seq):
                expected += max(0, kv.pages_for_tokens(seq.member, expected_final_tokens(seq, 1.0, ctx)) - held)
            else:
                expected += max(0, kv.pages_for_tokens(seq.member, expected_final_tokens(seq, demand.ratio.value, ctx))
                                - held)
        assert demand.reserved_pages_bound("m") == expected
        assert [(d.held_pages, d.future_pages, d.remaining_steps) for d in demand._running_demands("m")] == [
            (s.kv.num_blocks * kv.pages_per_block(s.member), demand.future_pages(s),
             max(0, expected_final_tokens(s, demand.ratio.value, h.family.member(s.member).context_tokens)
                 - len(s.token_ids)) + 1) for s in running]


# ----------------------------------------------------------------------------- reservation edge cases
HANDOVER_PROMPT = list(range(40, 52))      # 12 tokens: 3 blocks of 4


def _shared_prefix_run(num_pages: int, c_max: int, b_max: int, b_tail: list[int], b_step: int = 2) -> tuple[Harness, list]:
    """a (s, 2 tokens) finishes at step 2 holding private pages; c (m, fixed length) grows long after;
    b (m) arrives at b_step with a's prompt, so its lower layers and residual are a prefix hit on a's pages.
    Returns the harness and (step, reserved, available, running) after every step."""
    h = Harness(**{"pool.num_pages": num_pages})
    h.submit("c", list(range(60, 68)), max_tokens=c_max, pinned_member=MemberName("m"))
    h.submit("a", HANDOVER_PROMPT, max_tokens=2, pinned_member=MemberName("s"))
    states = []
    for step in range(1, 80):
        if step == b_step:
            h.submit("b", HANDOVER_PROMPT + b_tail, max_tokens=b_max, pinned_member=MemberName("m"))
        h.step()
        h.scheduler.running.changed()
        states.append((step, h.scheduler.reservation.reserved_pages("m"), h.pool.num_available_pages("m"),
                       sorted(str(s.request_id) for s in h.scheduler.running)))
        if not h.scheduler.has_work():
            break
    return h, states


def test_peak_reservation_does_not_credit_pages_an_admission_shares():
    # The stateful test's bug (seed 314148103300451312151391228776905994476, minimal form): the peak
    # reservation credits a's 21 private pages as returned when a ends (step 2), and c's late growth
    # needs them. b's prefix hit shares 6 of them (2 blocks x 2 lower layers + 2 residual inputs), so
    # they are not returned; before the fix b was admitted in step 2 on that credit and the reservation
    # then exceeded the available pages (25 reserved, 16 available).
    h, states = _shared_prefix_run(54, c_max=20, b_max=4, b_tail=[3])
    assert all(reserved <= available for _, reserved, available, _ in states), states
    assert states[0] == (1, 16, 35, ["a", "c"])
    assert states[1] == (2, 20, 39, ["c"])               # b waits: beside c's growth it does not fit
    assert _admitted_step(h, "b") == 21                  # c finished at step 20
    assert h.scheduler.snapshot(h.now)["counters"]["preemptions"] == 0


def test_reservation_with_shared_pages_counts_them_as_kept():
    # The same, at the level of PoolDemand: claiming a running request's private page raises the
    # reservation by exactly the lost credit; claiming a cached or already shared page changes nothing.
    h = Harness(**{"pool.num_pages": 54})
    h.submit("c", list(range(60, 68)), max_tokens=20, pinned_member=MemberName("m"))
    h.submit("a", HANDOVER_PROMPT, max_tokens=3, pinned_member=MemberName("s"))
    h.step()
    demand = h.scheduler.reservation
    a_pages = h.scheduler.running.get(RequestId("a")).kv.all_pages()
    base = demand.reserved_pages("m")
    assert base == 16
    one = demand.reserved_pages("m", [a_pages[0]])
    two = demand.reserved_pages("m", a_pages[:2])
    assert (one, two) == (base + 1, base + 2)
    assert demand.reserved_pages("m") == base             # claims are never cached


def test_handover_reuse_that_would_outgrow_the_pool_recomputes_the_lower_layers():
    # b alone (admitted without a reserve) with a's 3 blocks as a shared prefix would hold 3 residual
    # input pages to its end beside pages_for_tokens(40 tokens) = 50 pages: 53 > 50. Before the fix it
    # preempted itself at step 35 although its length is fixed; now it recomputes the lower layers.
    h, states = _shared_prefix_run(50, c_max=12, b_max=24, b_tail=[3] * 4)
    assert all(reserved <= available for _, reserved, available, _ in states), states
    admits = [e for e in h.scheduler.events.recent() if e.kind is EventKind.ADMIT and e.request_id == "b"]
    assert [(round(e.time_s / 0.01), e.data["shared_tokens"]) for e in admits] == [(13, 0)]
    assert h.scheduler.snapshot(h.now)["counters"]["preemptions"] == 0
    assert h.final("b").finish_reason.value == "length" and len(h.tokens("b")) == 24
    # With room for the residual inputs the handover still reuses the shared layers.
    h2, states2 = _shared_prefix_run(56, c_max=12, b_max=24, b_tail=[3] * 4)
    admits2 = [e for e in h2.scheduler.events.recent() if e.kind is EventKind.ADMIT and e.request_id == "b"]
    assert [e.data["shared_tokens"] for e in admits2] == [12]
    assert h2.scheduler.snapshot(h2.now)["counters"]["preemptions"] == 0


def test_peak_growth_is_the_maximum_over_every_candidate_step():
    """peak_growth sweeps the steps where a request starts a block or ends: the same maximum as visiting every
    candidate step over every request (the plain O(n^2) definition), on random decoding requests."""
    import random

    from orchestrator.core.demand import DecodeProfile, peak_growth

    def every_candidate(profiles):
        best = 0
        for candidate in profiles:
            t = candidate.steps_left - 1
            best = max(best, sum(_growth_at(p, t) if t < p.steps_left else -p.private_pages for p in profiles))
        return best

    rng = random.Random(7)
    for _ in range(300):
        block, per_block = rng.choice([(4, 3), (16, 5), (32, 36)])
        context = rng.choice([10**6, rng.randint(8, 260)])      # pages_for caps at the member's context

        def pages(n, block=block, per_block=per_block, context=context):
            return -(-min(n, context) // block) * per_block
        profiles = []
        for _ in range(rng.randint(0, 12)):
            now = rng.randint(1, 200)
            final = now + rng.randint(0, 90)
            slack = rng.choice([1, block, rng.randint(0, 2 * block)])
            held = pages(now + rng.choice([0, 1, slack]))
            profile = DecodeProfile(final - now + 1, now, final, held, rng.randint(0, held), pages, slack, block)
            # the sweep reads growth only where a block starts: it must change nowhere else
            changes = {t for t in range(1, profile.steps_left) if _growth_at(profile, t) != _growth_at(profile, t - 1)}
            assert changes <= set(profile.growth_steps())
            profiles.append(profile)
        assert peak_growth(profiles) == every_candidate(profiles)


def test_an_aged_requests_held_pages_keep_a_later_small_request_waiting():
    """A long l request ("hog", 140 tokens = 210 pages of 256) runs; a second l request ("aged", 60 pages)
    cannot fit beside it and ages past scheduler.aging_steps (its pages held); at step 80 a small s request
    arrives that fits in the 46 free pages but not beside the aged request's held pages: it waits for the hog."""
    h = Harness(**{"escalation.enabled": False})
    h.submit("hog", [3] * 20, max_tokens=120, pinned_member=MemberName("l"))
    h.step()
    h.submit("aged", [4] * 20, max_tokens=20, pinned_member=MemberName("l"))
    for step in range(2, 400):
        if step == 80:
            h.submit("small", PROMPT[:8], max_tokens=8, pinned_member=MemberName("s"))
        h.step()
        if not h.scheduler.has_work():
            break
    assert _admitted_step(h, "small") == _admitted_step(h, "aged") == 122
    assert h.scheduler.snapshot(h.now)["counters"]["preemptions"] == 0
    assert [e.request_id for e in h.scheduler.events.recent() if e.kind is EventKind.HOLD] == ["aged"]


def test_scheduler_feeds_each_members_escalation_rate_to_the_router():
    # Every s request escalates (low confidence on s); m requests finish there. Pinned requests cannot
    # escalate and count for nothing.
    h = Harness(low_confidence=("s",), **{"escalation.min_tokens": 4, "escalation.window_tokens": 4,
                                          "comparison.warmup": False, "router.complexity_thresholds": [0.99, 0.995]})
    h.submit("e1", PROMPT, max_tokens=12)
    h.submit("pinned", [7] + PROMPT, max_tokens=12, pinned_member=MemberName("s"))
    h.run(2000)
    loads = h.scheduler.routing.loads()
    assert [s.member for s in h.final("e1").spans][:2] == ["s", "m"]
    assert loads["s"].escalation_rate == 1.0 and loads["m"].escalation_rate == 0.0   # e1 finished on m
    h.submit("e2", [8] + PROMPT, max_tokens=12)
    h.run(2000)
    assert h.scheduler.routing.loads()["s"].escalation_rate == 1.0
    assert h.scheduler.routing.loads()["m"].escalation_rate == 0.0
    assert h.scheduler.handover.rates._count == {"s": 2, "m": 2}


def test_reservation_bound_kept_across_admissions_equals_a_fresh_sum():
    """PoolDemand.admitted adds the new request's term to the cached bound instead of recomputing it: after
    every admission of a burst (prefix sharing, nested handovers, a pool tight enough to wait) the cached
    bound must equal the sum over the running requests computed from scratch."""
    h = Harness(low_confidence=("s",), **{"pool.num_pages": 400, "escalation.min_tokens": 4,
                                          "escalation.window_tokens": 4, "comparison.warmup": False,
                                          "router.complexity_thresholds": [0.3, 0.6]})
    demand, admission = h.scheduler.reservation, h.scheduler.admission
    original = admission.try_admit
    checked = []

    def checked_admit(seq, *args, **kwargs):
        admitted = original(seq, *args, **kwargs)
        scope = demand.scope_of(seq.member)
        if admitted and scope in demand._bounds:
            fresh = sum(demand.future_pages(s) for s in h.scheduler.running)
            assert demand._bounds[scope] == fresh, seq.request_id
            checked.append(seq.request_id)
        return admitted

    admission.try_admit = checked_admit
    for step in range(60):
        if step % 10 == 0:
            for i in range(4):      # a burst: several admissions in one step, some sharing a prefix
                h.submit(f"b{step}-{i}", PROMPT + [i % 2 + 3] * (i + 1), max_tokens=6 + 3 * i)
        h.step()
    h.run(3000)
    assert len(checked) >= 5


def _pins_versus_a_victim(num_pages: int = 74) -> Harness:
    """b and a (priority 1: the first victim) decode on m; e starts on s, escalates to m and waits there with
    its s pages pinned; then b's next block does not fit (one-block reserve, 74 pages)."""
    h = Harness(low_confidence=("s",), **{"pool.num_pages": num_pages, "scheduler.decode_reservation": "block",
                                          "escalation.min_tokens": 4, "escalation.window_tokens": 4,
                                          "comparison.warmup": False, "router.complexity_thresholds": [0.99, 0.995]})
    h.submit("b", [9] + PROMPT, max_tokens=30, pinned_member=MemberName("m"))
    h.submit("a", [7] * 8, max_tokens=30, pinned_member=MemberName("m"), priority=1)
    h.step()
    h.step()
    h.submit("e", PROMPT, max_tokens=12)
    return h


def test_escalation_pins_are_released_before_any_request_is_preempted():
    h = _pins_versus_a_victim()
    preemption = h.scheduler.preemption
    preempt, seen = preemption.preempt, []

    def recorded(seq, now_s, plan=None):      # the victim, and the waiting requests holding pins at that moment
        seen.append((seq.request_id, round(now_s, 2),
                     [s.request_id for s in h.scheduler.waiting if s.pinned_kv is not None]))
        preempt(seq, now_s, plan)

    preemption.preempt = recorded
    e = h.scheduler.lifecycle.by_id["e"]
    for _ in range(7):      # to step 9
        h.step()
    assert e.pinned_kv is not None and e.member == "m" and "e" not in h.scheduler.running   # escalated at 7
    h.step()
    # Step 10: b's next block does not fit while e waits with its s pages pinned: the pins go (e will recompute
    # its lower layers on m), a keeps running. a is preempted at steps 14 and 38, with nothing pinned to give.
    assert e.pinned_kv is None and seen == []
    h.run(3000)
    assert seen == [("a", 0.14, []), ("a", 0.38, [])]
    assert [s.member for s in h.final("e").spans][:2] == ["s", "m"]
    assert len(h.tokens("a")) == len(h.tokens("b")) == 30 and len(h.tokens("e")) == 12
