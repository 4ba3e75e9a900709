"""Draft-target speculation in the core (orchestrator/core/speculation.py): drafts, verifies and their bookkeeping
on a fake executor that checks every page it reads, the draft's pages through the request's life, and the
draft-length policy on a fake step-cost estimate."""
from __future__ import annotations

import pytest

from orchestrator.core.draft_length import AcceptanceEstimates, expected_tokens, pair_name
from orchestrator.core.types import (FinishReason, MemberName, RequestId, SampledToken, StepPlan)
from tests.fakes import EOS, VOCAB_SIZE, FakeExecutor, independent_family
from tests.test_scheduler import PROMPT, Harness

LARGE = 0.95            # complexity hint that routes to the largest member


def model_token(context: list[int]) -> int:
    """FakeExecutor's next token after `context` (its deterministic model; never EOS)."""
    return (sum(context[-3:]) * 7 + 3) % (VOCAB_SIZE - 3) + 3


class DraftingExecutor(FakeExecutor):
    """FakeExecutor that runs the step-plan contract's drafts: the draft member writes its catch-up tokens and
    drafts into its own tables (every position before them checked, as the target's), proposes the model's own
    tokens for the first `accept(request_id)` drafts and wrong ones after, and the target keeps its drafts while
    they are its own next token (greedy acceptance), then adds its own."""

    def __init__(self, *args, accept=lambda request_id: 99, **kwargs):
        super().__init__(*args, **kwargs)
        self.accept = accept
        self.drafts_seen: list = []

    def _write(self, member: str, tables, pos: int, token: int) -> None:
        size = self._block(member)
        for table in tables:
            self.slots[(table[pos // size], pos % size)] = (token, pos)

    def _check(self, member: str, tables, upto: int, context: list[int], what: str) -> None:
        size = self._block(member)
        for layer, table in enumerate(tables):
            for pos in range(upto):
                got = self.slots.get((table[pos // size], pos % size))
                assert got == (context[pos], pos), f"{what} layer {layer} pos {pos}: {got} != {context[pos]}"

    def execute(self, plan: StepPlan) -> list[SampledToken]:
        plain = StepPlan(batches=plan.batches, released_requests=plan.released_requests)
        drafts = {c.request_id: (b.member, c) for b in plan.batches for c in b.chunks if c.draft is not None}
        for _, chunk in drafts.values():
            chunk.sample = False            # the parent writes and checks the chunk; the verify is done here
        try:
            super().execute(plain)
        finally:
            for _, chunk in drafts.values():
                chunk.sample = True
        out = []
        for batch in plan.batches:
            for chunk in batch.chunks:
                if not chunk.sample:
                    continue
                if chunk.draft is None:
                    context = self._context[chunk.request_id]
                    out.append(SampledToken(chunk.request_id, model_token(context), -0.1, 0.9, (), 0))
                    continue
                out.extend(self._verify(batch.member, chunk))
        return out

    def _verify(self, member: str, chunk) -> list[SampledToken]:
        spec = chunk.draft
        k = spec.num_tokens
        context = list(self._context[chunk.request_id])          # through the chunk's last token
        assert spec.token_ids == context[spec.start_pos:] and spec.token_ids[-1] == chunk.token_ids[0]
        self._check(spec.member, spec.block_tables, spec.start_pos, context, f"{chunk.request_id} draft")
        self.drafts_seen.append((member, chunk.request_id, spec.member, k, spec.start_pos, len(spec.token_ids)))
        for offset, token in enumerate(spec.token_ids):
            self._write(spec.member, spec.block_tables, spec.start_pos + offset, token)
        right = self.accept(chunk.request_id)
        drafted, proposal = [], list(context)
        for i in range(k):
            token = model_token(proposal)
            token = token if i < right else (token - 3 + 1) % (VOCAB_SIZE - 3) + 3     # another non-EOS token
            drafted.append(token)
            proposal.append(token)
            if i < k - 1:
                self._write(spec.member, spec.block_tables, chunk.start_pos + 1 + i, token)
        # the target's k + 1 rows: [last, d1..dk] at start_pos.. start_pos + k (and their residuals, where it
        # records them for a nested handover)
        for i, token in enumerate(drafted):
            self._write(member, chunk.block_tables, chunk.start_pos + 1 + i, token)
            if chunk.residual_table_out is not None:
                self._write(member, [chunk.residual_table_out], chunk.start_pos + 1 + i, token)
        kept, verified = [], list(context)
        for token in drafted:
            own = model_token(verified)
            kept.append(own)
            verified.append(own)
            if own != token:
                break
        else:
            kept.append(model_token(verified))
        return [SampledToken(chunk.request_id, token, -0.1, 0.9, (), k if i == 0 else 0) for i, token in enumerate(kept)]


class SpecHarness(Harness):
    def __init__(self, accept=lambda request_id: 99, **overrides):
        super().__init__(**{"speculation.enabled": True, "comparison.warmup": False, **overrides})
        self.core.executor = self.executor = DraftingExecutor(self.family, self.config.pool.num_pages,
                                                              self.config.pool.page_bytes, accept=accept)


def _plain_tokens(rid: str, prompt, max_tokens: int) -> list[int]:
    h = Harness(**{"comparison.warmup": False})
    h.submit(rid, prompt, max_tokens=max_tokens, complexity_hint=LARGE)
    h.run()
    return h.tokens(rid)


@pytest.mark.parametrize("accept", [99, 0, 1, 2])
def test_speculation_gives_what_decoding_alone_gives_and_counts_what_it_drafted(accept):
    h = SpecHarness(accept=lambda request_id: accept)
    h.submit("a", PROMPT, max_tokens=17, complexity_hint=LARGE)
    h.run()
    assert h.tokens("a") == _plain_tokens("a", PROMPT, 17)
    k = h.config.speculation.fixed_k
    drafted = h.executor.drafts_seen
    assert drafted and all(d[0] == "l" and d[2] == "s" for d in drafted)
    final = h.final("a")
    counters = h.scheduler.snapshot(h.now)["counters"]
    assert final.num_drafted_tokens == counters["drafted_tokens"]["s->l"] == sum(d[3] for d in drafted)
    assert final.num_accepted_tokens == counters["accepted_draft_tokens"]["s->l"]
    per_verify = min(accept, k)
    if accept == 0:
        # one token per verify, as decoding; the last token has nothing after it to draft for
        assert final.num_accepted_tokens == 0 and len(drafted) == 15
    else:
        assert final.num_accepted_tokens == sum(min(per_verify, d[3]) for d in drafted)
    assert counters["draft_length_steps"] == {str(k): len(drafted)}
    assert h.pool.counts()["used"] == 0


def _admitted_and_decoding(h: SpecHarness, rid: str, prompt=PROMPT, max_tokens: int = 12, **kw):
    h.submit(rid, prompt, max_tokens=max_tokens, complexity_hint=LARGE, **kw)
    for _ in range(50):
        seq = h.scheduler.running.get(RequestId(rid))
        if seq is not None and seq.is_decoding():
            return seq
        h.step()
    raise AssertionError("never decoded")


def _verify_plan(h: SpecHarness, rid: str):
    h.now += 0.01
    plan, _ = h.scheduler.schedule(h.now)
    chunk = next(c for b in plan.batches for c in b.chunks if c.request_id == rid)
    assert chunk.draft is not None
    return plan, chunk


def _tokens(rid: str, ids: list[int], k: int, eos_at: int | None = None) -> list[SampledToken]:
    return [SampledToken(RequestId(rid), EOS if i == eos_at else t, -0.1, 0.9, (), k if i == 0 else 0)
            for i, t in enumerate(ids)]


@pytest.mark.parametrize("returned", [1, 2, 4])          # k = 3: accept none, one, all (+ the bonus)
def test_update_moves_both_members_computed_positions_by_what_the_verify_accepted(returned):
    h = SpecHarness()
    seq = _admitted_and_decoding(h, "a")
    plan, chunk = _verify_plan(h, "a")
    k, last = chunk.draft.num_tokens, chunk.start_pos
    assert k == 3 and chunk.token_ids == [seq.token_ids[-1]] and last == len(seq.token_ids) - 1
    # the verify's k + 1 rows have pages on the target, the draft's k - 1 new positions on the draft
    assert len(chunk.block_tables[0]) * 4 >= last + 1 + k
    assert len(chunk.draft.block_tables[0]) * 4 >= chunk.draft.start_pos + len(chunk.draft.token_ids) + k - 1
    outputs = h.scheduler.update(plan, _tokens("a", [40 + i for i in range(returned)], k), h.now)
    n = returned - 1
    assert seq.token_ids[-returned:] == [40 + i for i in range(returned)]
    assert seq.num_computed_tokens == last + 1 + n and seq.is_decoding()
    assert seq.draft.num_computed_tokens == min(last + 1 + n, last + 1 + k - 1)
    assert [len(o.new_token_ids) for o in outputs] == [returned]          # one output for the step's tokens
    assert outputs[0].num_drafted_tokens == 3 and outputs[0].num_accepted_tokens == n
    counters = h.scheduler.snapshot(h.now)["counters"]
    assert counters["drafted_tokens"] == {"s->m": 0, "s->l": 3}
    assert counters["accepted_draft_tokens"] == {"s->m": 0, "s->l": n}
    # the next step's draft catches up from where the draft stopped, through the new last token
    _, chunk = _verify_plan(h, "a")
    assert chunk.draft.start_pos == seq.draft.num_computed_tokens
    assert chunk.draft.token_ids == seq.token_ids[seq.draft.num_computed_tokens:]
    assert len(chunk.draft.token_ids) == (2 if n == k else 1)


def test_a_stop_among_the_verified_tokens_keeps_the_tokens_up_to_it_and_returns_every_page():
    h = SpecHarness()
    seq = _admitted_and_decoding(h, "a", ignore_eos=False)
    generated = seq.num_generated
    plan, chunk = _verify_plan(h, "a")
    outputs = h.scheduler.update(plan, _tokens("a", [40, 41, 42, 43], chunk.draft.num_tokens, eos_at=1), h.now)
    assert [o.finished for o in outputs] == [True]
    assert outputs[0].finish_reason is FinishReason.STOP
    assert seq.num_generated == generated + 2 and seq.token_ids[-2:] == [40, EOS]
    assert h.pool.num_used_pages() == 0 and seq.draft is None
    h.pool.check_invariants()


def _pages(h: SpecHarness, seq) -> tuple[int, int]:
    return seq.kv.num_pages(), seq.draft.kv.num_pages()


def test_draft_pages_are_the_pools_exact_count_and_return_on_finish():
    h = SpecHarness()
    seq = _admitted_and_decoding(h, "a", max_tokens=9)
    own, draft = _pages(h, seq)
    # l: 6 pages a block, no residual (largest); the draft s: 2 pages a block for the prompt it was admitted with,
    # no residual (it records none as a draft)
    assert own == 6 * -(-seq.num_computed_tokens // 4) and draft == 2 * -(-len(PROMPT) // 4)
    assert h.pool.num_used_pages() == own + draft
    assert h.pool.num_used_pages("s") == draft and h.pool.num_used_pages("l") == own
    h.run()
    assert h.pool.num_used_pages() == 0


@pytest.mark.parametrize("end", ["cancel", "preempt", "escalate"])
def test_draft_pages_return_when_the_request_is_cancelled_preempted_or_escalated(end):
    h = SpecHarness(**({"router.complexity_thresholds": [0.3, 0.99]} if end == "escalate" else {}))
    seq = _admitted_and_decoding(h, "a", max_tokens=30)
    h.step()                               # one verify: the draft's tables grew past the prompt
    assert seq.draft is not None and seq.member == ("m" if end == "escalate" else "l")
    own, draft = _pages(h, seq)
    assert h.pool.num_used_pages() == own + draft
    if end == "cancel":
        h.scheduler.abort(RequestId("a"))
        h.step()
        assert h.final("a").finish_reason is FinishReason.CANCELLED
    elif end == "preempt":
        h.scheduler.preemption.preempt(seq, h.now)
    else:
        h.scheduler.handover.escalate(seq, h.now)
        assert seq.member == "l"
        assert h.pool.num_used_pages() == own      # its own pages stay pinned until the target admits it
    assert seq.draft is None
    assert h.pool.num_used_pages() == (own if end == "escalate" else 0)
    h.pool.check_invariants()
    if end != "cancel":
        h.run()                            # it resumes (re-matching its cached blocks) and finishes
        assert h.tokens("a") == _plain_tokens("a", PROMPT, 30) or end == "escalate"
        assert h.pool.num_used_pages() == 0


def test_a_decode_short_of_pages_gives_up_drafts_before_it_preempts_anyone():
    h = SpecHarness()
    seq = _admitted_and_decoding(h, "a", max_tokens=30)
    h.step()
    own, draft = _pages(h, seq)
    # something else holds every other page but the ones its own decode needs to its end (51 tokens: 13 blocks)
    taken = h.pool.allocate("m", h.pool.counts()["free"] - (6 * 13 - own))
    assert taken is not None
    h.run()
    assert seq.draft is None and h.scheduler.snapshot(h.now)["counters"]["preemptions"] == 0
    assert h.tokens("a") == _plain_tokens("a", PROMPT, 30)
    assert h.pool.num_used_pages() == len(taken)


def test_a_waiting_request_refused_pages_gets_them_from_the_running_drafts():
    h = SpecHarness(**{"pool.num_pages": 140})
    first = _admitted_and_decoding(h, "a", max_tokens=20)      # l grows to 11 blocks: 66 pages; its draft 22
    assert first.draft is not None
    h.submit("b", [3] + PROMPT, max_tokens=20, complexity_hint=LARGE)
    h.step()
    second = h.scheduler.running.get(RequestId("b"))
    assert second is not None and first.draft is None          # admitted beside a, in the draft's pages
    h.run()
    assert h.tokens("a") == _plain_tokens("a", PROMPT, 20)
    assert h.tokens("b") == _plain_tokens("b", [3] + PROMPT, 20)


def test_a_draft_that_does_not_fit_is_not_held_and_the_request_decodes_plainly():
    h = SpecHarness(**{"pool.num_pages": 36})        # l grows to 6 x 6 = 36 pages: nothing left for a draft
    seq = _admitted_and_decoding(h, "a", max_tokens=3)
    assert seq.draft is None and h.pool.num_used_pages() == seq.kv.num_pages()
    h.run()
    assert h.tokens("a") == _plain_tokens("a", PROMPT, 3) and not h.executor.drafts_seen


def test_the_draft_reuses_what_the_small_member_cached_for_the_session():
    h = SpecHarness()
    h.submit("turn1", PROMPT, max_tokens=8, pinned_member=MemberName("s"))
    h.run()
    second = PROMPT + h.tokens("turn1") + [5, 6, 7]            # 31 tokens; s holds the first 27's 6 full blocks
    h.submit("turn2", second, max_tokens=4, complexity_hint=LARGE)
    h.run()
    first = [d for d in h.executor.drafts_seen if d[1] == "turn2"][0]
    assert first[4] == 24 and first[5] == len(second) + 1 - 24     # catch-up: 7 prompt tokens, the first reply one


def test_private_drafts_read_no_other_servers_cache_and_take_pages_from_their_own_slice():
    split = {"comparison.static_split": {"s": 0.2, "m": 0.2, "l": 0.6}, "comparison.private_drafts": True,
             "comparison.cross_member_sharing": False, "comparison.reuse_shared_layers": False}
    h = SpecHarness(family=independent_family(), **{**split, "router.complexity_thresholds": [0.5]})
    h.submit("turn1", PROMPT, max_tokens=8, pinned_member=MemberName("s"))
    h.run()
    second = PROMPT + h.tokens("turn1") + [5, 6, 7]
    seq = _admitted_and_decoding(h, "turn2", second, max_tokens=8)
    assert seq.draft.num_computed_tokens == 0             # the small server's cache is not its draft's
    assert h.pool.num_used_pages("s") == 0                # the draft's pages are the large server's
    assert h.pool.num_used_pages("l") == seq.kv.num_pages() + seq.draft.kv.num_pages()
    h.run()
    third = second + h.tokens("turn2") + [8, 9]
    seq = _admitted_and_decoding(h, "turn3", third, max_tokens=4)   # its own draft cache serves its next turn
    assert seq.draft.num_computed_tokens >= 4 * (len(second) // 4)


def test_acceptance_estimate_starts_at_the_prior_and_follows_the_verifies():
    from orchestrator.core.config import SpeculationConfig

    estimates = AcceptanceEstimates(SpeculationConfig(acceptance={"s->l": 0.8}, default_acceptance=0.5))
    assert estimates.acceptance("s->l") == pytest.approx(0.8) and estimates.acceptance("s->m") == pytest.approx(0.5)
    for _ in range(2000):
        estimates.observe("s->l", 4, 1)        # one accepted, then a rejection: a = 1/2
    assert estimates.acceptance("s->l") == pytest.approx(0.5, abs=0.01)
    assert expected_tokens(0.76, 3) == pytest.approx(1 + 0.76 + 0.76 ** 2 + 0.76 ** 3)
    assert expected_tokens(0.5, 0) == 1.0 and pair_name("s", "l") == "s->l"


class FakeStepCost:
    """Seconds of a step: a fixed cost per forward (weights read), plus per row; drafts cost `draft_share` of it."""

    def __init__(self, per_forward_s: float, per_row_s: float, draft_share: float = 0.2):
        self.per_forward_s, self.per_row_s, self.draft_share = per_forward_s, per_row_s, draft_share
        self.calls = 0

    def estimate_step_s(self, forwards) -> float:
        self.calls += 1
        total = 0.0
        for f in forwards:
            rows = len(f.decode_contexts) + sum(r for r, _ in f.verifies) + sum(n for n, _ in f.prefills)
            cost = self.per_forward_s + self.per_row_s * rows
            total += cost * (self.draft_share if f.is_draft else 1.0)
        return total


@pytest.mark.parametrize("per_forward_s, per_row_s, pays", [(0.020, 0.0001, True), (0.001, 0.01, False)])
def test_draft_length_is_zero_where_the_verify_costs_more_than_it_gives(per_forward_s, per_row_s, pays):
    h = SpecHarness(**{"pool.num_pages": 1024})
    cost = FakeStepCost(per_forward_s, per_row_s)
    h.scheduler.speculation.use_step_cost(cost.estimate_step_s)
    for i in range(4):
        h.submit(f"r{i}", [i + 3] + PROMPT, max_tokens=12, complexity_hint=LARGE)
    h.run()
    assert cost.calls > 0
    steps = h.scheduler.snapshot(h.now)["counters"]["draft_length_steps"]
    chosen = {int(k) for k in steps}
    if pays:        # memory-bound: rows are nearly free, the draft's forwards cheap: the longest draft pays
        assert chosen == {h.config.speculation.max_k} or max(chosen) == h.config.speculation.max_k
    else:           # compute-bound: every verified row costs as much as a forward: never draft
        assert chosen == {0} and not h.executor.drafts_seen
    for i in range(4):
        assert h.tokens(f"r{i}") == _plain_tokens(f"r{i}", [i + 3] + PROMPT, 12)


def test_draft_length_is_zero_while_the_estimate_has_no_figure_yet():
    """An engine still measuring its first steps (engines/local/step_costs.py) gives None: nothing is drafted
    rather than a guess; once it prices steps, the policy drafts where that pays."""
    h = SpecHarness(**{"pool.num_pages": 1024})
    priced = FakeStepCost(0.020, 0.0001)
    calls = {"n": 0}

    def estimate(forwards):
        calls["n"] += 1
        return None if calls["n"] <= 6 else priced.estimate_step_s(forwards)

    h.scheduler.speculation.use_step_cost(estimate)
    h.submit("a", PROMPT, max_tokens=16, complexity_hint=LARGE)
    h.run()
    steps = h.scheduler.snapshot(h.now)["counters"]["draft_length_steps"]
    assert steps.get("0", 0) >= 6 and max(int(k) for k in steps) >= 2
    assert h.tokens("a") == _plain_tokens("a", PROMPT, 16)


def test_a_planned_steps_forwards_are_those_its_draft_length_priced():
    """plan_forwards (what a measuring engine fits on) reads back from the DraftSpecs the shapes step_forwards
    priced for the k the policy chose."""
    from orchestrator.core.draft_length import plan_forwards

    h = SpecHarness(**{"pool.num_pages": 1024})
    priced = FakeStepCost(0.020, 0.0001)
    seen = []

    def estimate(forwards):
        seen.append(list(forwards))
        return priced.estimate_step_s(forwards)

    h.scheduler.speculation.use_step_cost(estimate)
    for i in range(3):
        _admitted_and_decoding(h, f"r{i}", [i + 3] + PROMPT, max_tokens=20)
    for _ in range(3):
        h.step()                                        # every draft caught up: the catch-ups are one token
    seen.clear()
    h.now += 0.01
    plan, _ = h.scheduler.schedule(h.now)
    assert any(c.draft is not None for b in plan.batches for c in b.chunks)
    assert plan_forwards(plan) in seen                  # the chosen k's forwards, as priced
    assert any(f.is_draft for f in plan_forwards(plan))
    specs = [c.draft for b in plan.batches for c in b.chunks if c.draft is not None]
    draft_contexts = [n for f in plan_forwards(plan) if f.is_draft for n in f.decode_contexts]
    furthest = max(d.start_pos + len(d.token_ids) + d.num_tokens - 2 for d in specs)     # the last draft row's
    assert max(draft_contexts) == furthest


class _DecodingSeq:
    """What DraftLength reads of a request: its member, its tokens, its draft's member and computed count."""

    def __init__(self, member: str, position: int):
        self.member = member
        self.token_ids = [0] * (position + 1)
        self.draft = type("D", (), {"member": "s", "num_computed_tokens": position})()


def test_each_target_member_drafts_its_own_length():
    """The draft's forward is cheap beside the large member's forward, and a verify row is dear beside the middle
    member's: the large member's requests draft, the middle one's do not. One k for the whole step could only
    draft for both or for neither, and either costs more per token."""
    from orchestrator.core.config import SpeculationConfig
    from orchestrator.core.draft_length import Candidate, DraftLength, step_forwards
    from orchestrator.core.types import MemberBatch, SamplingParams, SeqChunk

    weight_s = {"s": 0.001, "m": 0.002, "l": 0.020}
    row_s = {"s": 0.00001, "m": 0.020, "l": 0.0001}

    def estimate(forwards):
        total = 0.0
        for f in forwards:
            rows = len(f.decode_contexts) + sum(r for r, _ in f.verifies) + sum(n for n, _ in f.prefills)
            total += weight_s[f.member] + row_s[f.member] * rows
        return total

    def chunk(name: str) -> SeqChunk:
        return SeqChunk(request_id=RequestId(name), token_ids=[5], start_pos=100, block_tables=[[0]], sample=True,
                        sampling=SamplingParams(temperature=0.0))

    plan = StepPlan(batches=[MemberBatch(MemberName(m), [chunk(f"{m}{i}"), chunk(f"{m}{i + 2}")])
                             for i, m in enumerate(("m", "l"))])
    candidates = [Candidate(c, _DecodingSeq(b.member, 100), 4, 0.8) for b in plan.batches for c in b.chunks]
    policy = DraftLength(SpeculationConfig(enabled=True, max_k=4))
    ks = policy.choose(plan, candidates, estimate)
    assert ks["m"] == 0 and ks["l"] >= 2

    def time_per_token(choice):
        tokens = sum(expected_tokens(0.8, choice[c.seq.member]) for c in candidates)
        return estimate(step_forwards(plan, candidates, choice, 4)) / tokens

    assert all(time_per_token(ks) < time_per_token({"m": k, "l": k}) for k in range(5))
    assert policy.choose(plan, candidates, None) == {"m": 3, "l": 3}      # no estimator: the fixed k for all


def test_drafts_must_save_more_than_the_estimates_own_error():
    """A saving inside the step-cost estimate's error (a fit of noisy measured steps) is no evidence: no drafts."""
    from orchestrator.core.config import SpeculationConfig
    from orchestrator.core.draft_length import Candidate, DraftLength, step_forwards
    from orchestrator.core.types import MemberBatch, SamplingParams, SeqChunk

    def estimate(forwards):             # a target forward 10 ms, a draft forward 2 ms, rows nearly free
        return sum((0.002 if f.is_draft else 0.010) + 0.00001 * (len(f.decode_contexts) + sum(r for r, _ in f.verifies))
                   for f in forwards)

    chunk = SeqChunk(request_id=RequestId("a"), token_ids=[5], start_pos=100, block_tables=[[0]], sample=True,
                     sampling=SamplingParams(temperature=0.0))
    plan = StepPlan(batches=[MemberBatch(MemberName("l"), [chunk])])
    candidates = [Candidate(chunk, _DecodingSeq("l", 100), 4, 0.5)]
    policy = DraftLength(SpeculationConfig(enabled=True, max_k=4))
    ks = policy.choose(plan, candidates, estimate)
    saving = 1 - (estimate(step_forwards(plan, candidates, ks, 4)) / expected_tokens(0.5, ks["l"])) / estimate(
        step_forwards(plan, candidates, {"l": 0}, 4))
    assert ks["l"] >= 1 and 0.1 < saving < 0.5
    assert policy.choose(plan, candidates, estimate, margin=saving * 0.9) == ks
    assert policy.choose(plan, candidates, estimate, margin=saving * 1.1) == {"l": 0}
