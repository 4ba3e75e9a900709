"""Hypothesis stateful test of the whole ledger path: random submit / step / cancel sequences under page
pressure (admission waits, preemption, eviction, escalation), checked against the fake executor's page
contents and the pool's accounting after every step."""
from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from orchestrator.core.events import EventKind
from orchestrator.core.host_tier import HostTier
from orchestrator.core.tiers import TieredStore
from orchestrator.core.types import MemberName, RequestId
from tests.test_scheduler import Harness

PREFIXES = [list(range(10, 26)), list(range(30, 38)), [7] * 12]


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.h = Harness(low_confidence=("s",), **{"pool.num_pages": 90, "escalation.min_tokens": 3,
                                                   "escalation.window_tokens": 3, "scheduler.max_running_requests": 6})
        self.counter = 0
        self.live: set[str] = set()

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), tail=st.lists(st.integers(3, 40), max_size=10),
          max_tokens=st.integers(1, 12), member=st.sampled_from([None, "s", "m", "l"]))
    def submit(self, prefix, tail, max_tokens, member):
        rid = f"r{self.counter}"
        self.counter += 1
        self.h.submit(rid, PREFIXES[prefix] + tail, max_tokens=max_tokens,
                      pinned_member=MemberName(member) if member else None)
        self.live.add(rid)

    @rule()
    def step(self):
        self.h.step()
        self.live -= {rid for rid, outs in self.h.outputs.items() if outs[-1].finished}

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cancel(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.h.scheduler.abort(RequestId(rid))

    @invariant()
    def pages_are_owned_exactly_once(self):
        pool, scheduler = self.h.pool, self.h.scheduler
        pool.check_invariants()
        held = Counter(p for seq in scheduler.running for p in seq.kv.all_pages())
        # An escalated request keeps its source pages pinned while it waits for the target.
        held.update(p for seq in scheduler.waiting if seq.pinned_kv is not None
                    for p in seq.pinned_kv.all_pages())
        for page in range(pool.num_pages):
            assert pool.refcount(page) == held.get(page, 0), f"page {page}: refcount {pool.refcount(page)} vs {held.get(page, 0)}"
        counts = pool.counts()
        assert counts["free"] + counts["used"] + counts["cached"] == pool.num_pages

    def teardown(self):
        self.h.run(3000)                         # raises when requests never finish
        assert self.h.pool.counts()["used"] == 0
        for outs in self.h.outputs.values():
            assert outs[-1].finished


LedgerMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestLedger = LedgerMachine.TestCase


# ----------------------------------------------------------------------------- reservation
class ReservationMachine(RuleBasedStateMachine):
    """Under page pressure with escalation and priorities. `exact` requests have fixed lengths
    (ignore_eos): their remaining decode pages are reserved exactly, so no running request may ever be
    preempted (nothing reserved for it was handed to anyone else). Open-length requests are reserved by
    the decaying ratio and can run short: then every preemption must take the victim the policy names
    (priority, fresh before escalated, least progress), and a step that preempted admits nobody."""

    exact = True

    def __init__(self):
        super().__init__()
        self.h = Harness(low_confidence=("s",), tiers=TieredStore(HostTier(40 * 1024), None),
                         **{"pool.num_pages": 120, "escalation.min_tokens": 3, "escalation.window_tokens": 3,
                            "scheduler.max_running_requests": 6, "scheduler.aging_steps": 8,
                            "scheduler.new_token_ratio_decay": 0.05})
        self.counter = 0
        self.live: set[str] = set()
        scheduler = self.h.scheduler
        original = scheduler.preemption.preempt

        def checked_preempt(seq, now_s, plan=None):
            if plan is None:      # drop_failed_loads: a tier block was lost, not a policy choice
                return original(seq, now_s, plan)
            candidates = [s for s in scheduler.running if scheduler.reservation.shares_pages(s, seq.member)]
            assert seq is min(candidates, key=scheduler.preemption.victim_key), "victim out of policy order"
            if seq.num_escalations:
                assert not any(c.num_escalations == 0 and c.request.priority >= seq.request.priority
                               for c in candidates), "an escalated request went before a fresh one"
            original(seq, now_s, plan)
        scheduler.preemption.preempt = checked_preempt

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), tail=st.lists(st.integers(3, 40), max_size=10),
          max_tokens=st.integers(1, 40), member=st.sampled_from([None, "s", "m", "l"]),
          priority=st.sampled_from([0, 1]), fixed=st.booleans())
    def submit(self, prefix, tail, max_tokens, member, priority, fixed):
        rid = f"r{self.counter}"
        self.counter += 1
        self.h.submit(rid, PREFIXES[prefix] + tail, max_tokens=max_tokens, ignore_eos=self.exact or fixed,
                      pinned_member=MemberName(member) if member else None, priority=priority)
        self.live.add(rid)

    @rule()
    def step(self):
        self.h.step()
        self.live -= {rid for rid, outs in self.h.outputs.items() if outs[-1].finished}
        events = self.h.scheduler.events.recent(200)
        preempting = {e.time_s for e in events if e.kind is EventKind.PREEMPT}
        assert not any(e.kind is EventKind.ADMIT and e.time_s in preempting for e in events), \
            "admitted in a step that preempted"

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cancel(self, data):
        self.h.scheduler.abort(RequestId(data.draw(st.sampled_from(sorted(self.live)))))

    @invariant()
    def reservations_hold(self):
        scheduler, pool = self.h.scheduler, self.h.pool
        pool.check_invariants()
        # Admission tries the one-pass bound before the exact peak: it must never be below it.
        scheduler.running.changed()
        bound = scheduler.reservation.reserved_pages_bound("s")
        assert scheduler.reservation.reserved_pages("s") <= bound
        counters = scheduler.snapshot(self.h.now)["counters"]
        assert counters["preemptions"] == sum(counters["preemptions_by_kind"].values())
        if self.exact:
            assert counters["preemptions"] == 0, "a running request with exact length was preempted"
            pinned = sum(len(seq.pinned_kv.all_pages()) for seq in scheduler.waiting if seq.pinned_kv is not None)
            assert scheduler.reservation.reserved_pages("s") <= pool.num_available_pages("s") + pinned

    def teardown(self):
        self.h.run(3000)                         # raises when requests never finish
        assert self.h.pool.counts()["used"] == 0


class OpenLengthMachine(ReservationMachine):
    exact = False


# Random, as every property test should be: a random run (seed 314148103300451312151391228776905994476) found
# that the `peak` reservation credited a finishing request's private pages although an admission had just
# shared them as its prefix (fixed in PoolDemand.reserved_pages(claimed_pages); the minimal case is
# tests/test_scheduler_load.py::test_peak_reservation_does_not_credit_pages_an_admission_shares).
ReservationMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
OpenLengthMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
TestReservation = ReservationMachine.TestCase
TestOpenLength = OpenLengthMachine.TestCase
