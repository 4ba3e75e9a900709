"""Scheduler + KV cache manager with a fake executor and a fake clock: exact behaviour of every policy."""
from __future__ import annotations

import pytest

from eval.composition import core_parts
from eval.simulate.node import SimCore, homed_scheduler, moved_out
from orchestrator.core.complexity import ComplexityEstimator
from orchestrator.core.engine_core import EngineCore, drain
from orchestrator.core.errors import InvalidRequestError, QueueFullError
from orchestrator.core.scheduler import Scheduler
from orchestrator.core.host_tier import HostTier
from orchestrator.core.tiers import DiskTier, TieredStore
from orchestrator.core.types import FinishReason, MemberName, Request, RequestId, SamplingParams
from tests.fakes import FakeExecutor, fake_config, fake_vocab, independent_family, nested_family


class Harness:
    """The core as every runner builds it (the EngineCore constructor) on the fake family and executor, stepped by hand:
    each step moves the clock 10 ms and checks the pool's invariants."""

    def __init__(self, family=None, tiers=None, low_confidence=(), scheduler_factory=None, core_class=EngineCore,
                 **overrides):
        self.now = 0.0
        self.outputs: dict[str, list] = {}
        config = fake_config(**overrides)
        self.core = core_class(
            config, family or nested_family(), clock=lambda: self.now,
            estimator=ComplexityEstimator(fake_vocab()), **core_parts(config, scheduler_factory, tiers),
            make_executor=lambda family, num_pages, page_bytes: FakeExecutor(family, num_pages, page_bytes,
                                                                              low_confidence))
        core = self.core
        self.family, self.config, self.pool, self.kv, self.tiers = core.family, core.config, core.pool, core.kv, core.tiers
        self.scheduler, self.executor = core.scheduler, core.executor

    def submit(self, rid, prompt, max_tokens=8, ignore_eos=True, **kw):
        return self.add(Request(request_id=RequestId(rid), prompt_token_ids=list(prompt),
                                sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                                arrival_s=self.now, **kw))

    def add(self, request):
        """Queues the request now; its outputs are kept in self.outputs. Returns its RouteDecision."""
        rid = request.request_id
        return self.core.add_request(request, lambda out: self.outputs.setdefault(rid, []).append(out))

    def step(self):
        self.now += 0.01
        plan = self.core.step().plan
        self.pool.check_invariants()
        return plan

    def run(self, max_steps=500, on_step=None):
        """Steps until idle (drain); on_step(plan) after each step."""
        drain(self.core, max_steps, self.step if on_step is None else lambda: on_step(self.step()))

    def tokens(self, rid):
        return [t for out in self.outputs[rid] for t in out.new_token_ids]

    def final(self, rid):
        assert self.outputs[rid][-1].finished
        return self.outputs[rid][-1]


PROMPT = list(range(10, 30))   # 20 tokens = 5 blocks of 4


def test_single_request_finishes_and_pages_stay_cached():
    h = Harness()
    h.submit("a", PROMPT, max_tokens=6, pinned_member=MemberName("m"))
    h.run()
    assert len(h.tokens("a")) == 6
    assert h.final("a").finish_reason is FinishReason.LENGTH
    counts = h.pool.counts()
    assert counts["used"] == 0 and counts["cached"] > 0      # delayed reclamation: nothing freed eagerly
    h.step()   # the next plan tells the engine to drop the finished request's sampler state
    assert "a" in h.executor.released


def test_second_turn_hits_the_first_turns_cache():
    h = Harness()
    h.submit("t1", PROMPT, max_tokens=8, pinned_member=MemberName("m"))
    h.run()
    turn2 = PROMPT + h.tokens("t1") + [5, 6, 7, 8]
    h.submit("t2", turn2, max_tokens=4, pinned_member=MemberName("m"))
    h.run()
    cached = h.final("t2").num_cached_prompt_tokens
    assert cached == 24        # 20 prompt + 8 generated = 28 computed; 7 full blocks minus the last (recomputed)
    first_chunk = next(c for m, c in h.executor.chunks_seen if c.request_id == "t2")
    assert first_chunk.start_pos == 24


def test_nested_family_shares_lower_layers_across_members():
    h = Harness()
    h.submit("small", PROMPT, max_tokens=1, pinned_member=MemberName("s"))
    h.run()
    h.submit("large", PROMPT, max_tokens=1, pinned_member=MemberName("l"))
    h.step()
    chunk = next(c for m, c in h.executor.chunks_seen if c.request_id == "large")
    # tiny-s's pages for layers 0-1 and its residual let the large member skip its two lowest layers
    assert chunk.start_layer == 2 and chunk.start_pos == 0
    small_pages = {p for m, c in h.executor.chunks_seen if c.request_id == "small" for p in c.block_tables[0]}
    assert set(chunk.block_tables[0]) & small_pages


def test_independent_family_never_shares_kv():
    h = Harness(family=independent_family())
    h.submit("small", PROMPT, max_tokens=1, pinned_member=MemberName("s"))
    h.run()
    h.submit("large", PROMPT, max_tokens=1, pinned_member=MemberName("l"))
    h.run()
    chunk = next(c for m, c in h.executor.chunks_seen if c.request_id == "large")
    assert chunk.start_layer == 0 and chunk.start_pos == 0
    assert h.final("large").num_cached_prompt_tokens == 0


def test_escalation_hands_over_mid_stream_and_reuses_shared_layers():
    h = Harness(low_confidence=("s", "m"), **{"escalation.min_tokens": 4, "escalation.window_tokens": 4,
                                              "comparison.warmup": False, "router.complexity_thresholds": [0.99, 0.995]})
    decision = h.submit("e", PROMPT, max_tokens=12)
    assert decision.member == "s"
    h.run()
    final = h.final("e")
    assert len(h.tokens("e")) == 12
    assert [s.member for s in final.spans] == ["s", "m", "l"]    # s -> m -> l; never past the largest
    assert sum(s.num_tokens for s in final.spans) == 12
    handover = [c for m, c in h.executor.chunks_seen if c.request_id == "e" and m == "m"][0]
    assert handover.start_layer == 2 and handover.start_pos == 0    # only m's upper layers were computed
    stats = h.scheduler.snapshot(h.now)
    assert stats["counters"]["escalations"]["s->m"] == 1 and stats["counters"]["escalations"]["m->l"] == 1


def test_an_escalated_request_moves_to_a_node_homing_its_new_member_and_finishes_there():
    """A fleet with member homes (pooled placement) moves an escalated request, waiting for a member its node is
    not home to, to another node's core (the simulator's SimCore): no output at the move, its tokens and progress
    go with it, the source returns every page and the target finishes it."""
    settings = {"escalation.min_tokens": 4, "escalation.window_tokens": 4, "comparison.warmup": False,
                "router.complexity_thresholds": [0.99, 0.995]}
    homes = frozenset({"s"})
    a = Harness(family=independent_family(), low_confidence=("s",), scheduler_factory=homed_scheduler(homes),
                core_class=SimCore, **settings)
    b = Harness(family=independent_family(), low_confidence=("s",), core_class=SimCore, **settings)
    assert a.submit("e", PROMPT, max_tokens=12).member == "s"
    moved = []
    for _ in range(50):
        a.step()
        moved = moved_out(a.scheduler, homes)
        if moved:
            break
    assert [seq.request_id for seq in moved] == ["e"] and moved[0].member in ("m", "l")
    target = moved[0].member
    running = next(iter(a.scheduler.running), None)
    assert running is None
    seq = a.core.move_out(moved[0])
    with pytest.raises(ValueError):
        a.core.move_out(seq)                                   # no longer this scheduler's
    sent = len(a.tokens("e"))
    assert not a.outputs["e"][-1].finished and moved_out(a.scheduler, homes) == []
    b.now = a.now
    b.core.move_in(seq, lambda out: b.outputs.setdefault("e", []).append(out))
    with pytest.raises(InvalidRequestError):
        b.core.move_in(seq, lambda out: None)                  # a request id once only
    b.run()
    a.step()                                                   # the next plan tells the source's engine to forget it
    final = b.final("e")
    assert sent + len(b.tokens("e")) == 12 and [s.member for s in final.spans] == ["s", target]
    assert a.pool.counts()["used"] == 0 and b.pool.counts()["used"] == 0
    assert "e" in a.executor.released


def test_a_duplicate_request_id_is_refused_and_the_live_request_keeps_its_stream():
    h = Harness()
    h.submit("a", PROMPT, max_tokens=6, pinned_member=MemberName("m"))
    with pytest.raises(InvalidRequestError, match="duplicate"):
        h.core.add_request(Request(request_id=RequestId("a"), prompt_token_ids=list(PROMPT),
                                   sampling=SamplingParams(max_tokens=2), arrival_s=h.now), lambda out: None)
    h.run()
    assert len(h.tokens("a")) == 6 and h.final("a").finish_reason is FinishReason.LENGTH


def test_pinned_request_never_escalates():
    h = Harness(low_confidence=("s",), **{"escalation.min_tokens": 2})
    h.submit("p", PROMPT, max_tokens=10, pinned_member=MemberName("s"))
    h.run()
    assert [s.member for s in h.final("p").spans] == ["s"]


def test_preemption_under_page_pressure_gives_identical_output():
    reference = Harness()
    for i in range(4):
        reference.submit(f"r{i}", [i + 3] + PROMPT, max_tokens=20, pinned_member=MemberName("l"))
    reference.run()
    # With exact lengths (ignore_eos) the peak reservation never overcommits; the one-block reserve
    # (block) does, and preempts.
    for reservation, preempts in (("block", True), ("peak", False)):
        tight = Harness(**{"pool.num_pages": 84, "scheduler.decode_reservation": reservation})
        for i in range(4):   # l: 6 pages per block, 14 blocks; each request grows to 11
            tight.submit(f"r{i}", [i + 3] + PROMPT, max_tokens=20, pinned_member=MemberName("l"))
        tight.run(2000)
        assert (tight.scheduler.snapshot(tight.now)["counters"]["preemptions"] > 0) is preempts
        for i in range(4):
            assert tight.tokens(f"r{i}") == reference.tokens(f"r{i}")
        assert tight.pool.counts()["used"] == 0


def test_abort_returns_pages():
    h = Harness()
    h.submit("x", PROMPT, max_tokens=50, pinned_member=MemberName("m"))
    h.step()
    h.step()
    assert h.pool.counts()["used"] > 0
    h.scheduler.abort(RequestId("x"))
    h.step()
    assert h.final("x").finish_reason is FinishReason.CANCELLED
    assert h.pool.counts()["used"] == 0 and not h.scheduler.has_work()


def test_queue_bound_and_bad_requests():
    h = Harness(**{"scheduler.max_queue": 2})
    h.submit("a", PROMPT)
    h.submit("b", PROMPT)
    with pytest.raises(QueueFullError):
        h.submit("c", PROMPT)
    with pytest.raises(InvalidRequestError, match="empty"):
        h.submit("d", [])
    with pytest.raises(InvalidRequestError, match="holds"):
        Harness().submit("e", list(range(600)))


def test_request_larger_than_pool_is_refused_not_hung():
    h = Harness(**{"pool.num_pages": 12})
    with pytest.raises(InvalidRequestError, match="pages"):
        h.submit("big", PROMPT, max_tokens=20, pinned_member=MemberName("l"))


def test_a_request_beyond_what_other_members_floors_leave_is_refused_not_left_to_time_out():
    # s keeps a floor of 16 of the 48 pages, so l (6 layers, 4-token blocks, no residual page) can never
    # hold more than 32: 5 blocks. A 24-token prompt (6 blocks = 36 pages) can never be admitted; accepted,
    # it would sit at the head of l's queue, blocking every later l request until the timeout.
    h = Harness(**{"pool.num_pages": 48, "pool.member_limits": {"s": {"floor_pages": 16}},
                   "scheduler.request_timeout_s": 5.0})
    assert h.kv.pages_for_tokens("l", 26) == 42 <= 48
    with pytest.raises(InvalidRequestError, match="at most 32"):
        h.submit("big", list(range(10, 34)), max_tokens=2, pinned_member=MemberName("l"))
    # What fits (20 tokens: 5 blocks = 30 pages) is accepted and runs at once.
    h.submit("fits", list(range(10, 27)), max_tokens=3, pinned_member=MemberName("l"))
    h.step()
    assert h.pool.num_used_pages("l") == 30
    h.run()
    assert h.final("fits").finish_reason is FinishReason.LENGTH and h.final("fits").error is None


def test_static_split_isolates_members():
    h = Harness(**{"pool.num_pages": 120, "comparison.static_split": {"s": 0.5, "m": 0.25, "l": 0.25}})
    h.submit("a", PROMPT, max_tokens=4, pinned_member=MemberName("m"))
    h.run()
    owners = {h.pool.owner(p) for p in range(120) if h.pool.key_of(p) is not None}
    assert owners == {"m"}
    assert all(60 <= p < 90 for p in range(120) if h.pool.key_of(p) is not None)


def test_host_tier_serves_evicted_prefix(tmp_path):
    tiers = TieredStore(HostTier(1 << 20), DiskTier(tmp_path, 1 << 20))
    h = Harness(tiers=tiers, **{"pool.num_pages": 40})
    h.submit("first", PROMPT, max_tokens=2, pinned_member=MemberName("m"))
    h.run()
    for i in range(3):   # other prompts push the first one's pages out of the arena
        h.submit(f"other{i}", [40 + i] * 20, max_tokens=2, pinned_member=MemberName("m"))
        h.run()
    assert tiers.counts()["host"] > 0
    h.submit("again", PROMPT, max_tokens=2, pinned_member=MemberName("m"))
    h.run()
    assert h.final("again").num_cached_prompt_tokens == 16
    hits = h.scheduler.snapshot(h.now)["counters"]["prefix_hit_tokens"]["m"]
    assert hits == {"arena": 0, "host": 16, "disk": 0}    # the others flushed the arena: all from the host tier


def test_disk_tier_survives_restart_and_drops_corrupt_blocks(tmp_path):
    tiers = TieredStore(None, DiskTier(tmp_path, 1 << 20))
    h = Harness(tiers=tiers, **{"pool.num_pages": 40})
    h.submit("first", PROMPT, max_tokens=2, pinned_member=MemberName("m"))
    h.run()
    for i in range(3):
        h.submit(f"other{i}", [40 + i] * 20, max_tokens=2, pinned_member=MemberName("m"))
        h.run()
    # "restart": a new scheduler, arena and executor over the same disk directory
    restarted = Harness(tiers=TieredStore(None, DiskTier(tmp_path, 1 << 20)), **{"pool.num_pages": 40})
    restarted.submit("again", PROMPT, max_tokens=2, pinned_member=MemberName("m"))
    restarted.run()
    assert restarted.final("again").num_cached_prompt_tokens == 16
    assert restarted.tokens("again") == h.tokens("first")
    # corrupt every file: a third run recomputes instead of serving garbage
    for path in tmp_path.iterdir():
        path.write_bytes(path.read_bytes()[:-3] + b"xyz")
    third = Harness(tiers=TieredStore(None, DiskTier(tmp_path, 1 << 20)), **{"pool.num_pages": 40})
    third.submit("again", PROMPT, max_tokens=2, pinned_member=MemberName("m"))
    third.run()
    assert third.tokens("again") == h.tokens("first")


def test_warmup_prefills_next_member_and_escalation_hits_it():
    h = Harness(low_confidence=("s",), **{"escalation.min_tokens": 4, "escalation.window_tokens": 4,
                                          "escalation.warmup_band": [0.0, 1.0],
                                          "router.complexity_thresholds": [0.99, 0.995]})
    h.submit("w", PROMPT, max_tokens=8)
    h.run()
    warm = h.scheduler.snapshot(h.now)["counters"]["warmups"]
    assert warm["issued"] == 1 and warm["hit"] == 1


def test_no_warmup_for_a_member_this_node_is_not_home_to():
    """Under member homes an escalation to a member homed elsewhere moves there: a warm-up here is never read."""
    settings = {"escalation.min_tokens": 4, "escalation.window_tokens": 4, "escalation.warmup_band": [0.0, 1.0],
                "router.complexity_thresholds": [0.99, 0.995]}
    target = independent_family().member_names[1]          # s escalates to the next larger member
    issued = {}
    for homes in (None, frozenset({"s", target}), frozenset({"s"})):
        h = Harness(family=independent_family(), low_confidence=("s",),
                    scheduler_factory=None if homes is None else homed_scheduler(homes), **settings)
        h.submit("w", PROMPT, max_tokens=8)
        issued[homes] = h.scheduler.snapshot(h.now)["counters"]["warmups"]["issued"]
    assert issued == {None: 1, frozenset({"s", target}): 1, frozenset({"s"}): 0}


def test_session_ttl_makes_idle_sessions_evict_first():
    def run(ttl):
        h = Harness(**{"pool.num_pages": 72, "pool.session_ttl_s": ttl})
        h.submit("anon", PROMPT, max_tokens=2, pinned_member=MemberName("m"))   # older, no session
        h.run()
        h.submit("idle", [45] * 20, max_tokens=2, pinned_member=MemberName("m"), session_id="s1")
        h.run()
        h.now += 5.0       # the session idles past its TTL
        h.submit("next", [46] * 20, max_tokens=2, pinned_member=MemberName("m"))   # needs evictions
        h.run()
        h.submit("anon-again", PROMPT, max_tokens=2, pinned_member=MemberName("m"))
        h.run()
        return h.final("anon-again").num_cached_prompt_tokens
    assert run(ttl=None) < 16      # plain LRU: the older anonymous prefix goes first
    assert run(ttl=1.0) == 16      # TTL: the idle session's pages go first, the anonymous prefix survives


def test_rollback_drops_the_low_confidence_window_and_holds_it_back():
    h = Harness(low_confidence=("s",), **{"escalation.min_tokens": 4, "escalation.window_tokens": 4,
                                          "escalation.on_escalate": "rollback", "comparison.warmup": False,
                                          "router.complexity_thresholds": [0.99, 0.995]})
    h.submit("r", PROMPT, max_tokens=10)
    h.run()
    final = h.final("r")
    # s produced 4 tokens, all rolled back (never sent: held back); m wrote the 10 the client saw
    assert [(s.member, s.num_tokens) for s in final.spans] == [("m", 10)]
    assert len(h.tokens("r")) == 10


@pytest.mark.parametrize("on_escalate", ["rollback", "keep"])
def test_without_intermediate_outputs_a_request_gets_its_first_and_final_output_with_the_same_tokens(on_escalate):
    """Request.intermediate_outputs=False (mfs simulate): the first output at the same step as when streaming,
    then only the final one, which carries every token in between; escalation, rollback and holdback as before."""
    runs = {}
    for streamed in (True, False):
        h = Harness(low_confidence=("s",), **{"escalation.min_tokens": 4, "escalation.window_tokens": 4,
                                              "escalation.on_escalate": on_escalate, "comparison.warmup": False,
                                              "router.complexity_thresholds": [0.99, 0.995]})
        h.submit("r", PROMPT, max_tokens=12, intermediate_outputs=streamed)
        h.submit("p", PROMPT[:9], max_tokens=5, pinned_member=MemberName("m"), intermediate_outputs=streamed)
        steps = {}

        def record(_plan, h=h, steps=steps):
            for rid, outs in h.outputs.items():
                steps.setdefault(rid, {}).setdefault(len(outs), h.now)
        h.run(on_step=record)
        runs[streamed] = h, steps
    (stream, stream_steps), (quiet, quiet_steps) = runs[True], runs[False]
    for rid in ("r", "p"):
        assert len(stream.outputs[rid]) > 2 and len(quiet.outputs[rid]) == 2
        assert quiet.tokens(rid) == stream.tokens(rid)
        assert [lp for o in quiet.outputs[rid] for lp in o.new_logprobs] == \
            [lp for o in stream.outputs[rid] for lp in o.new_logprobs]
        assert quiet_steps[rid][1] == stream_steps[rid][1]          # the first token arrives at the same step
        first, final = quiet.outputs[rid]
        assert first.route is not None and final.route is None and final.finished and not first.finished
        assert final.spans == stream.final(rid).spans and final.finish_reason == stream.final(rid).finish_reason
    assert quiet.scheduler.snapshot(quiet.now)["counters"] == stream.scheduler.snapshot(stream.now)["counters"]


def test_stop_string_abort_counts_as_finished_and_double_abort_is_harmless():
    h = Harness()
    h.submit("s1", PROMPT, max_tokens=50, pinned_member=MemberName("m"))
    h.step()
    h.step()
    h.scheduler.abort(RequestId("s1"), finish_reason=FinishReason.STOP)
    h.scheduler.abort(RequestId("s1"))
    h.step()
    assert h.final("s1").finish_reason is FinishReason.STOP
    counts = h.scheduler.snapshot(h.now)["counters"]["requests"]["m"]
    assert counts["finished"] == 1 and counts["cancelled"] == 0
    assert h.pool.counts()["used"] == 0


def test_request_that_fills_its_slice_alone_is_admitted_without_a_reserve():
    # m's slice is 30 pages; the prompt takes 25, the decode reserve would need 5 more: alone it must
    # still run (its whole length fits the slice), never wait for headroom nobody else can free.
    h = Harness(**{"pool.num_pages": 120, "comparison.static_split": {"s": 0.5, "m": 0.25, "l": 0.25},
                   "scheduler.decode_reserve_blocks": 2})
    h.submit("fills", PROMPT, max_tokens=4, pinned_member=MemberName("m"))
    h.run(50)
    assert len(h.tokens("fills")) == 4


def test_scheduler_emits_into_the_log_and_counters_it_is_given():
    # An empty EventLog is falsy (it has __len__): the scheduler once replaced it with its own, so the
    # serving layer's log (what /v1/stats and the dashboard read beside its own offload events) missed
    # every route/admit/finish event.
    from orchestrator.core.events import EventKind, EventLog, Stats
    log, stats = EventLog(), Stats()

    def scheduler_with_own_log(family, config, pool, kv, estimator, tiers, _events, _stats):
        return Scheduler(family, config, pool, kv, estimator, tiers, log, stats)
    h = Harness(scheduler_factory=scheduler_with_own_log)
    h.submit("a", PROMPT, max_tokens=3)
    h.run()
    assert h.scheduler.events is log and h.scheduler.stats is stats
    kinds = {e.kind for e in log.recent()}
    assert {EventKind.ROUTE, EventKind.ADMIT, EventKind.FINISH} <= kinds


def test_chunk_tables_are_the_live_tables_cut_to_the_chunk_and_never_change_after():
    """A decode reuses one copy of its tables while it reads the same number of blocks; the core only appends to
    the live tables, so a chunk's tables stay what they were when it was planned."""
    h = Harness()
    h.submit("a", PROMPT, max_tokens=12, pinned_member=MemberName("m"))
    seen = []

    def check(plan):
        for batch in plan.batches:
            for chunk in batch.chunks:
                kv = h.scheduler.running.get(RequestId("a")).kv if "a" in h.scheduler.running else None
                blocks = -(-(chunk.start_pos + len(chunk.token_ids)) // 4)
                if kv is not None:
                    assert chunk.block_tables == [t[:blocks] for t in kv.block_tables]
                seen.append((chunk, [list(t) for t in chunk.block_tables]))
    h.run(14, on_step=check)
    assert h.final("a").finish_reason is FinishReason.LENGTH
    assert all(chunk.block_tables == copy for chunk, copy in seen)       # nothing changed them afterwards
    widths = [len(chunk.block_tables[0]) for chunk, _ in seen]
    assert widths == sorted(widths) and len(set(widths)) > 1               # the tables grew block by block
    shared = [a.block_tables is b.block_tables for (a, _), (b, _) in zip(seen, seen[1:])
              if len(a.block_tables[0]) == len(b.block_tables[0])]
    assert shared and all(shared)                                          # one copy per width


def test_timeout_still_aborts_the_oldest_request_only():
    h = Harness(**{"scheduler.request_timeout_s": 1.0, "scheduler.max_running_requests": 1})
    h.submit("old", PROMPT, max_tokens=150, pinned_member=MemberName("m"))
    h.now = 0.6
    h.submit("new", PROMPT[:8], max_tokens=4, pinned_member=MemberName("m"))
    for _ in range(45):
        h.step()
    assert h.final("old").finish_reason is FinishReason.CANCELLED and "timed out" in h.final("old").error
    assert "new" not in h.outputs or not h.outputs["new"][-1].finished or \
        h.final("new").finish_reason is not FinishReason.CANCELLED
    h.run()
    assert h.final("new").finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("scenario", ["shared_prefix", "escalation", "preemption"])
def test_memoized_private_page_count_equals_the_pools_count_at_every_step(scenario):
    """KVCacheManager.num_private_pages (memoized on the pool's sharing epoch, used by the peak reservation) must
    equal a fresh count over the request's pages whenever it is asked: requests sharing a prefix while both run
    (pages going shared and back), hand-overs that reuse a nested member's lower layers, preemption."""
    if scenario == "escalation":
        h = Harness(low_confidence=("s", "m"), **{"escalation.min_tokens": 4, "escalation.window_tokens": 4,
                                                  "comparison.warmup": False,
                                                  "router.complexity_thresholds": [0.99, 0.995]})
        for i in range(3):
            h.submit(f"e{i}", PROMPT + [i + 3], max_tokens=12)
    elif scenario == "preemption":
        h = Harness(**{"pool.num_pages": 84, "scheduler.decode_reservation": "block"})
        for i in range(4):
            h.submit(f"r{i}", [i + 3] + PROMPT, max_tokens=20, pinned_member=MemberName("l"))
    else:
        h = Harness()
        h.submit("first", PROMPT, max_tokens=30, pinned_member=MemberName("m"))
        h.step()
        h.step()
    checked = shared_seen = 0
    for step in range(2000):
        if scenario == "shared_prefix" and step in (1, 3, 6):       # same prefix while "first" still runs
            h.submit(f"late{step}", PROMPT + [step], max_tokens=4 + step, pinned_member=MemberName("m"))
        if not h.scheduler.has_work():
            break
        h.step()
        for seq in h.scheduler.running:
            if seq.kv is None:
                continue
            pages = seq.kv.all_pages()
            assert seq.kv.num_pages() == len(pages)     # whole blocks in every layer's table
            direct = h.pool.num_private(pages)
            assert h.kv.num_private_pages(seq.kv) == direct, (scenario, step, seq.request_id)
            shared_seen += direct < len(pages)
            checked += 1
    assert checked > 10
    if scenario != "preemption":
        assert shared_seen > 0          # the scenario did make pages shared between running requests
    if scenario == "preemption":
        assert h.scheduler.snapshot(h.now)["counters"]["preemptions"] > 0


@pytest.mark.parametrize("family,sticky,expect_kept", [(independent_family, None, True),
                                                        (independent_family, False, False),
                                                        (nested_family, None, False),
                                                        (nested_family, True, True)])
def test_sticky_sessions_keep_later_turns_on_the_first_turns_member(family, sticky, expect_kept):
    """router.sticky_sessions (null: on for independent families only): a later turn whose complexity routes it
    elsewhere stays on the member of the session's first turn."""
    h = Harness(family=family(), **{"router.sticky_sessions": sticky})
    first = h.submit("t0", PROMPT, max_tokens=2, session_id="chat", complexity_hint=0.1)
    h.run()
    later = h.submit("t1", PROMPT + [7] * 8, max_tokens=2, session_id="chat", complexity_hint=0.95)
    largest = h.family.member_names[-1]
    assert first.member == h.family.member_names[0]
    assert (later.member == first.member) == expect_kept
    if expect_kept:
        assert later.reason.startswith(f"session kept on {first.member}")
    else:
        assert later.member == largest
    other = h.submit("other", PROMPT, max_tokens=2, session_id="another", complexity_hint=0.95)
    assert other.member == largest                      # a new session is routed on its own complexity


def test_a_downgrade_the_sessions_home_undoes_is_not_counted():
    """A later turn the router downgrades because the large member is busy, but which its session's home (the large
    member, sticky sessions) keeps, runs on the large member: no downgrade, in the decision or the counters. A new
    session in the same state is downgraded and counted."""
    h = Harness(family=independent_family(), **{"router.downgrade_running": 1})
    first = h.submit("t0", PROMPT, max_tokens=40, session_id="chat", complexity_hint=0.95)
    h.step()
    assert first.member == "l" and h.scheduler.routing.loads()["l"].num_running == 1        # busy: downgrade_running 1
    later = h.submit("t1", PROMPT + [7] * 8, max_tokens=2, session_id="chat", complexity_hint=0.5)
    assert later.member == "l" and later.downgraded_from is None
    assert later.reason.startswith("session kept on l") and "downgraded to s" in later.reason
    other = h.submit("o0", PROMPT, max_tokens=2, session_id="another", complexity_hint=0.5)
    assert other.member == "s" and other.downgraded_from == "l"
    assert h.scheduler.snapshot(h.now)["counters"]["downgrades"] == {"l->s": 1}


def test_idle_session_records_are_bounded_whatever_the_clients_send(monkeypatch):
    from orchestrator.core import lifecycle

    monkeypatch.setattr(lifecycle, "MAX_AGED_SESSIONS", 2)
    h = Harness(**{"pool.num_pages": 72, "pool.session_ttl_s": 60.0})
    for n in range(4):
        h.submit(f"r{n}", [45 + n] * 20, max_tokens=2, pinned_member=MemberName("m"), session_id=f"s{n}")
        h.run()
    assert list(h.scheduler.lifecycle._session_pages) == ["s2", "s3"]     # the newest; the oldest just age by LRU
