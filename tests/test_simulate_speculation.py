"""Speculation in the simulator: the acceptance table and its published source, the simulated verify's tokens and
acceptance statistics, the price of drafts and verifies, and the private draft copies of baseline_spec."""
from __future__ import annotations

import pytest

from eval.simulate.acceptance import (PUBLISHED_POINTS, acceptance_table, per_token_acceptance, published_acceptance,
                                      tokens_per_verify)
from eval.simulate.cost_model import BatchShape, TableCostModel, plan_shapes
from eval.simulate.executor import SimExecutor
from eval.simulate.step_table import Grid2D, MemberCosts, StepTable
from orchestrator.core.draft_length import Candidate, Rider, step_forwards
from orchestrator.core.types import DraftSpec, MemberBatch, RequestId, SamplingParams, SeqChunk, StepPlan
from tests.fakes import independent_family
from tests.test_simulate import FakeCost, library


def test_the_published_figures_give_a_per_token_acceptance_of_about_076_greedy():
    for _, k, tokens in PUBLISHED_POINTS:
        assert tokens_per_verify(per_token_acceptance(tokens, k), k) == pytest.approx(tokens)
    assert published_acceptance(0.0) == pytest.approx(0.762, abs=0.002)
    assert published_acceptance(1.0) == pytest.approx(0.720, abs=0.002)
    table = acceptance_table("qwen3-large", ["qwen3-1.7b", "qwen3-8b", "qwen3-32b"])
    assert set(table.pairs) == {"qwen3-1.7b->qwen3-8b", "qwen3-1.7b->qwen3-32b"}
    assert table.of("qwen3-1.7b->qwen3-32b").greedy == published_acceptance(0.0)
    assert "published" in table.of("qwen3-1.7b->qwen3-8b").source
    tiny = acceptance_table("tiny", ["tiny-s", "tiny-m", "tiny-l"], measured=__import__("pathlib").Path("/none"))
    assert tiny.of("tiny-s->tiny-l").greedy == 0.7 and "assumed" in tiny.of("tiny-s->tiny-l").source
    measured = acceptance_table("tiny", ["tiny-s", "tiny-m", "tiny-l"])          # the shipped measured table
    assert "measured" in measured.of("tiny-s->tiny-l").source
    assert 0.0 < measured.of("tiny-s->tiny-l").greedy < 1.0 and measured.of("tiny-s->tiny-m").sampled > 0.0
    swept = acceptance_table("qwen3-large", ["qwen3-1.7b", "qwen3-8b", "qwen3-32b"], override=0.4)
    assert swept.of("qwen3-1.7b->qwen3-32b").sampled == 0.4 and swept.priors() == {
        "qwen3-1.7b->qwen3-8b": 0.4, "qwen3-1.7b->qwen3-32b": 0.4}


def verify_chunk(request: str, position: int, generated: int, k: int, temperature: float = 0.0,
                 catch_up: int = 1) -> SeqChunk:
    spec = DraftSpec(member="s", num_tokens=k, token_ids=[5] * catch_up, start_pos=position + 1 - catch_up,
                     block_tables=[[0], [0]])
    return SeqChunk(request_id=RequestId(request), token_ids=[5], start_pos=position, block_tables=[[0]],
                    sample=True, sampling=SamplingParams(temperature=temperature), num_generated=generated, draft=spec)


def _executor(acceptance: float | None = None, **kw) -> SimExecutor:
    family = independent_family()
    table = acceptance_table(family.name, family.member_names, override=acceptance)
    return SimExecutor(family, 64, 1024, FakeCost(), library(members=("s", "l")), vocab_size=50, acceptance=table,
                       **kw)


@pytest.mark.parametrize("acceptance", [0.3, 0.76])
def test_simulated_verifies_accept_at_the_tables_rate_and_return_the_streams_tokens(acceptance):
    """20,000 verifies of k = 4 over 4,000 requests (seeded by the request key and position): the per-token
    acceptance (accepted / (accepted + rejections)) within 0.01 of the table, the tokens per verify within 2% of
    (1 - a^5) / (1 - a); every returned token is the stream's own token at its position."""
    executor = _executor(acceptance)
    accepted = rejected = returned = 0
    for r in range(4000):
        plan = StepPlan(batches=[MemberBatch("l", [verify_chunk(f"r{r}-{g}", 100 + g, g, 4)
                                                   for g in range(0, 25, 5)])])
        tokens = executor.execute(plan)
        by_request: dict[str, list] = {}
        for token in tokens:
            by_request.setdefault(token.request_id, []).append(token)
        for chunk in plan.batches[0].chunks:
            got = by_request[chunk.request_id]
            n = len(got) - 1
            accepted += n
            rejected += n < 4
            returned += len(got)
            assert got[0].num_drafted == 4 and all(t.num_drafted == 0 for t in got[1:])
            assert [t.token_id for t in got] == [executor.token_id(chunk.request_id, chunk.num_generated + i)
                                                 for i in range(len(got))]
    assert accepted / (accepted + rejected) == pytest.approx(acceptance, abs=0.01)
    assert returned / 20000 == pytest.approx(tokens_per_verify(acceptance, 4), rel=0.02)


def test_sampled_requests_draw_from_the_sampled_figure():
    family = independent_family()
    table = acceptance_table("qwen3", ["s", "l"])          # published: greedy 0.76, sampled 0.72
    executor = SimExecutor(family, 64, 1024, FakeCost(), library(members=("s", "l")), vocab_size=50,
                           acceptance=table)
    counts = {}
    for temperature in (0.0, 1.0):
        accepted = trials = 0
        for r in range(3000):
            plan = StepPlan(batches=[MemberBatch("l", [verify_chunk(f"x{r}", 50, 0, 1, temperature)])])
            accepted += len(executor.execute(plan)) - 1
            trials += 1
        counts[temperature] = accepted / trials
    # k = 1: the share accepted is the per-token acceptance itself (the same draws: sampled keeps a subset)
    assert counts[0.0] == pytest.approx(table.default.greedy, abs=0.02)
    assert counts[1.0] == pytest.approx(table.default.sampled, abs=0.02) and counts[1.0] < counts[0.0]


def test_a_verify_stops_at_the_replys_end():
    family = independent_family()
    executor = SimExecutor(family, 64, 1024, FakeCost(), library(members=("s", "l")), vocab_size=50,
                           acceptance=acceptance_table("x", ["s", "l"], override=0.999), natural_lengths={"e": 7})
    chunk = verify_chunk("e", 40, 5, 4)
    chunk.sampling = SamplingParams(temperature=0.0, ignore_eos=False)
    tokens = executor.execute(StepPlan(batches=[MemberBatch("l", [chunk])]))
    assert [t.token_id for t in tokens][-1] == family.member("l").eos_token_ids[0] and len(tokens) == 3


def _table_model() -> TableCostModel:
    # decode_ms = batch + context / 1000; prefill_ms = 10 + tokens / 10 (prefix ignored)
    decode = Grid2D((1.0, 64.0), (0.0, 1000.0), ((1.0, 2.0), (64.0, 65.0)))
    prefill = Grid2D((1.0, 1001.0), (0.0, 1000.0), ((10.1, 10.1), (110.1, 110.1)))
    members = {n: MemberCosts(decode, prefill) for n in ("s", "l")}
    return TableCostModel(StepTable(source="test", members=members), "test")


def test_a_verify_is_priced_as_its_requests_decode_plus_its_extra_rows_and_the_drafts_as_k_draft_forwards():
    model = _table_model()
    family = independent_family()
    executor = SimExecutor(family, 64, 1024, model, library(members=("s", "l")), vocab_size=50)
    plan = StepPlan(batches=[MemberBatch("l", [verify_chunk("a", 500, 3, 3), verify_chunk("b", 700, 9, 3)])])
    shapes = plan_shapes(plan, family)
    assert [s.member for s in shapes] == ["s", "s", "s", "l"] and [s.draft for s in shapes] == [True] * 3 + [False]
    assert shapes[0].decode_contexts == (500, 700) and shapes[1].decode_contexts == (501, 701)
    assert shapes[3].verifies == ((4, 500), (4, 700)) and shapes[3].decode_contexts == ()
    decode = 2 + 600 / 1000                               # two requests' KV read once each, mean context 600
    extra = (10 + 8 / 10) - (10 + 2 / 10)                 # eight rows through the weights instead of two
    assert model.batch_s(shapes[3]) == pytest.approx((decode + extra) / 1e3)
    drafts = [2 + 600 / 1000, 2 + 601 / 1000, 2 + 602 / 1000]
    assert executor.step_s(plan) == pytest.approx((sum(drafts) + decode + extra) / 1e3)
    # the core's own description of the same step (what its draft-length policy asks the price of) costs the same
    candidates = [Candidate(c, _Seq(c), 3, 0.7) for c in plan.batches[0].chunks]
    assert executor.estimate_step_s(step_forwards(plan, candidates, {"l": 3}, 4)) == pytest.approx(executor.step_s(plan))
    # without verifies the price is the table's decode price, unchanged
    plain = BatchShape("l", (500, 700), ())
    assert model.batch_s(plain) == pytest.approx((2 + 600 / 1000) / 1e3)


def test_the_draft_members_own_batch_rides_in_the_catch_up_forward_on_one_device_only():
    """One device running the family reads the draft member's weights once for its own decodes and the drafts'
    catch-up (as the local engine runs them); members on devices of their own cannot, so they pay both."""
    model = _table_model()
    family = independent_family()
    own = [SeqChunk(request_id=RequestId(f"s{i}"), token_ids=[5], start_pos=ctx, block_tables=[[0]], sample=True,
                    sampling=SamplingParams(temperature=0.0)) for i, ctx in enumerate((300, 400))]
    plan = StepPlan(batches=[MemberBatch("s", own),
                             MemberBatch("l", [verify_chunk("a", 500, 3, 3), verify_chunk("b", 700, 9, 3)])])
    shapes = plan_shapes(plan, family)
    assert [(s.member, s.draft) for s in shapes] == [("s", True), ("s", True), ("s", True), ("l", False)]
    assert shapes[0].decode_contexts == (500, 700, 300, 400)
    one_device = SimExecutor(family, 64, 1024, model, library(members=("s", "l")), vocab_size=50)
    merged = (4 + 475 / 1000) + (2 + 601 / 1000) + (2 + 602 / 1000)         # the catch-up carries s's own decodes
    verify = (2 + 600 / 1000) + (10 + 8 / 10) - (10 + 2 / 10)
    assert one_device.step_s(plan) == pytest.approx((merged + verify) / 1e3)
    candidates = [Candidate(c, _Seq(c), 3, 0.7) for c in plan.batches[1].chunks]
    assert one_device.estimate_step_s(step_forwards(plan, candidates, {"l": 3}, 4)) == pytest.approx(
        one_device.step_s(plan))
    assert len(plan_shapes(plan, family, drafts_ride=False)) == 5
    separate = SimExecutor(family, 64, 1024, model, library(members=("s", "l")), vocab_size=50, drafts_ride=False)
    apart = (2 + 600 / 1000) + (2 + 350 / 1000) + (2 + 601 / 1000) + (2 + 602 / 1000)  # catch-up, s's own, drafts
    assert separate.step_s(plan) == pytest.approx((apart + verify) / 1e3)
    own_devices = SimExecutor(family, 64, 1024, model, library(members=("s", "l")), vocab_size=50,
                              members_in_parallel=True)
    # the drafts run on l's devices before its verify, s's own decodes on s's: l's step waits for the drafts only
    drafts = (2 + 600 / 1000) + (2 + 601 / 1000) + (2 + 602 / 1000)
    assert own_devices.step_s(plan) == pytest.approx((drafts + max(verify, 2 + 350 / 1000)) / 1e3)


def test_the_draft_members_own_decodes_riding_every_draft_forward_get_a_token_in_each():
    """A decode of the draft member with ride_tokens n is a row of the first n draft forwards (contexts 300, 301,
    302), not of its batch's forward, and gets the stream's next n tokens; the core's description of the step with
    Riders costs the same."""
    model = _table_model()
    family = independent_family()
    own = [SeqChunk(request_id=RequestId("s0"), token_ids=[5], start_pos=300, block_tables=[[0]], sample=True,
                    sampling=SamplingParams(temperature=0.0), num_generated=4),
           SeqChunk(request_id=RequestId("s1"), token_ids=[5], start_pos=400, block_tables=[[0]], sample=True,
                    sampling=SamplingParams(temperature=0.0))]
    own[0].ride_tokens = 3
    plan = StepPlan(batches=[MemberBatch("s", own),
                             MemberBatch("l", [verify_chunk("a", 500, 3, 3), verify_chunk("b", 700, 9, 3)])])
    shapes = plan_shapes(plan, family)
    assert [(s.member, s.draft) for s in shapes] == [("s", True), ("s", True), ("s", True), ("l", False)]
    # the catch-up carries the rider and s1 (riding the catch-up only); the later draft forwards the rider again
    assert sorted(shapes[0].decode_contexts) == [300, 400, 500, 700]
    assert sorted(shapes[1].decode_contexts) == [301, 501, 701] and sorted(shapes[2].decode_contexts) == [302, 502, 702]
    executor = SimExecutor(family, 64, 1024, model, library(members=("s", "l")), vocab_size=50)
    tokens = executor.execute(plan)
    rider = [t.token_id for t in tokens if t.request_id == "s0"]
    assert rider == [executor.token_id("s0", 4 + i) for i in range(3)]
    assert [t.request_id for t in tokens][:4] == ["s0", "s0", "s0", "s1"]
    candidates = [Candidate(c, _Seq(c), 3, 0.7) for c in plan.batches[1].chunks]
    own[0].ride_tokens = 0              # the policy prices the plan before the rides are set
    assert executor.estimate_step_s(step_forwards(plan, candidates, {"l": 3}, 4, [Rider(own[0], 10)])) == \
        pytest.approx(executor.last_step_s)


class _Seq:
    """What step_forwards reads of a request: its tokens and its draft's computed count."""

    def __init__(self, chunk: SeqChunk, member: str = "l"):
        self.member = member
        self.token_ids = [0] * (chunk.start_pos + 1)
        self.draft = type("D", (), {"member": chunk.draft.member, "num_computed_tokens": chunk.draft.start_pos})()



def test_a_member_on_devices_of_its_own_waits_for_its_drafts_in_its_step():
    family = independent_family()
    plan = StepPlan(batches=[MemberBatch("l", [verify_chunk("a", 500, 3, 2)])])
    executor = SimExecutor(family, 64, 1024, FakeCost(), library(members=("s", "l")), vocab_size=50,
                           members_in_parallel=True)
    # FakeCost: every batch without a prefill 0.1: two draft forwards, then l's verify
    assert executor.step_s(plan) == pytest.approx(0.01 + 0.2 + 0.1)
    plan.batches[0].chunks[0].draft.num_tokens = 6
    assert executor.step_s(plan) == pytest.approx(0.01 + 0.6 + 0.1)
    plan.batches[0].chunks[0].draft = None                             # no drafts: the member's batch alone
    assert executor.step_s(plan) == pytest.approx(0.01 + 0.1)


def test_private_draft_copies_come_out_of_each_larger_servers_memory():
    from eval.simulate.families import paper_family
    from eval.simulate.fleet import parse_placement
    from eval.simulate.setup import SimSetup, private_draft_memory
    from eval.systems import system_config
    from tests.test_simulate import hf_config

    family = paper_family("qwen3-large", [("qwen3-1.7b", hf_config(4, 512)), ("qwen3-8b", hf_config(8, 1024)),
                                          ("qwen3-32b", hf_config(16, 2048))])
    from eval.baseline.split_pool import split_pages

    split = {"qwen3-1.7b": 0.2, "qwen3-8b": 0.3, "qwen3-32b": 0.5}
    draft_pages = int(family.members[0].serving["weight_bytes"] * 0.9) // 4096
    # per-member GPUs: each larger member's own slice holds its copy
    setup = SimSetup("qwen3-large", family, family.member_names, FakeCost(), parse_placement("per-member", "colocated"),
                     num_pages=100_000, page_bytes=4096, split=split)
    spec = system_config("baseline_spec", "tiny", 100_000, split)
    assert spec.speculation.enabled and spec.comparison.private_drafts
    assert private_draft_memory(setup, spec) is not None
    pages = split_pages(spec.pool.num_pages, spec.comparison.static_split)
    assert pages == {"qwen3-1.7b": 20_000, "qwen3-8b": 30_000 - draft_pages, "qwen3-32b": 50_000 - draft_pages}
    # one GPU for every server: the copies come out of the whole, the operator's split of what is left stands
    setup = SimSetup("qwen3-large", family, family.member_names, FakeCost(), parse_placement("colocated", "colocated"),
                     num_pages=100_000, page_bytes=4096, split=None)
    spec = system_config("baseline_spec", "tiny", 100_000, split)
    assert private_draft_memory(setup, spec) is not None
    assert spec.pool.num_pages == 100_000 - 2 * draft_pages and spec.comparison.static_split == split
    # one elastic pool for every server: the copies come out of that pool
    elastic = system_config("baseline_elastic_spec", "tiny", 100_000, split)
    assert private_draft_memory(setup, elastic) is not None
    assert elastic.pool.num_pages == 100_000 - 2 * draft_pages and elastic.comparison.static_split is None
    for name in ("baseline", "baseline_elastic", "mfs_no_spec"):     # no draft copies: their memory as it was
        config = system_config(name, "tiny", 100_000, split)
        assert private_draft_memory(setup, config) is None and config.pool.num_pages == 100_000
    mfs = system_config("mfs", "tiny", 100_000, split, extra={"speculation.enabled": True})
    assert private_draft_memory(setup, mfs) is None      # one copy of every member: the draft is the member itself


def test_the_split_search_counts_a_private_drafts_pages_on_each_larger_server():
    from eval.baseline.static_split import pages_rule
    from eval.systems import system_config

    family = independent_family()                     # s: 2 layers, l: 4 layers; 4 tokens a block
    split = {"s": 0.3, "l": 0.7}
    for name, with_draft in (("baseline", False), ("baseline_spec", True)):
        config = system_config(name, "tiny", 768, split, {"pool.page_bytes": 1024})
        rule = pages_rule(family, config)
        assert rule("s", 10) == 3 * 2                 # the smallest member's server holds no draft
        assert rule("l", 10) == 3 * 4 + (3 * 2 if with_draft else 0)
        # past the contexts each part is capped at its own member's, as the core's reservation counts a draft
        s_context, l_context = family.member("s").context_tokens, family.member("l").context_tokens
        far = 10 * max(s_context, l_context)
        assert rule("l", far) == -(-l_context // 4) * 4 + (-(-s_context // 4) * 2 if with_draft else 0)
