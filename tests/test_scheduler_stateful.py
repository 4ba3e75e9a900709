"""Hypothesis stateful test of the whole ledger path: random submit / step / cancel sequences under page
pressure (admission waits, preemption, eviction, escalation), checked against the fake executor's page
contents and the pool's accounting after every step."""
from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

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
        held = Counter(p for seq in scheduler._running.values() for p in seq.kv.all_pages())
        # Issue 13: an escalated request keeps its source pages pinned while it waits for the target.
        held.update(p for queue in scheduler._waiting.values() for seq in queue if seq.pinned_kv is not None
                    for p in seq.pinned_kv.all_pages())
        for page in range(pool.num_pages):
            assert pool.refcount(page) == held.get(page, 0), f"page {page}: refcount {pool.refcount(page)} vs {held.get(page, 0)}"
        counts = pool.counts()
        assert counts["free"] + counts["used"] + counts["cached"] == pool.num_pages

    def teardown(self):
        for _ in range(3000):
            if not self.h.scheduler.has_work():
                break
            self.h.step()
        assert not self.h.scheduler.has_work(), "requests never finished"
        assert self.h.pool.counts()["used"] == 0
        for outs in self.h.outputs.values():
            assert outs[-1].finished


LedgerMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestLedger = LedgerMachine.TestCase
