"""Speculation through the whole local path: the core plans drafts and verifies, the local engine runs them, and a
greedy request gets exactly the tokens it gets without speculation (tiny family, CPU); every page comes back."""
from __future__ import annotations

from orchestrator.core.draft_length import plan_forwards

import itertools

import pytest

from orchestrator.core.config import load_config
from orchestrator.core.engine_core import EngineCore, drain
from orchestrator.core.types import Request, RequestId, SamplingParams
from orchestrator.serve.local_engine import local_executor_factory
from orchestrator.serve.tokenizer import family_estimator

PROMPTS = [[5, 17, 42, 99, 7, 311, 12, 64], list(range(30, 75)), [9, 9, 9, 120, 400, 33]]


COMPLEXITY = {"tiny-m": 0.5, "tiny-l": 0.95}       # routed there (escalation off): a pinned request never drafts


def _tiny_core(speculate: bool, measured: bool = False, rides: bool = False) -> EngineCore:
    config = load_config(overrides={"family": "tiny", "pool.num_pages": 512, "pool.host_tier_mb": 0,
                                    "escalation.enabled": False, "speculation.enabled": speculate,
                                    "speculation.fixed_k": 3})
    ticks = itertools.count()
    core = EngineCore(config, clock=lambda: float(next(ticks)) * 1e-3, estimator=family_estimator,
                      make_executor=local_executor_factory(config))
    core.scheduler.speculation.rides = rides    # rides: tiny-s's decodes ride as a family of separate weights' do
    if not measured:
        core.scheduler.speculation.use_step_cost(None)
    return core


def run(speculate: bool, member: str, temperature: float = 0.0, seed: int | None = None,
        measured: bool = False, max_tokens: int = 24) -> tuple[dict, EngineCore]:
    """measured: the draft length priced by the engine's measured step costs, as served (what it chooses then
    depends on this machine's timings); otherwise the fixed k of 3, so that every verify path runs."""
    core = _tiny_core(speculate, measured)
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        rid = f"r{i}"
        outputs[rid] = []
        request = Request(request_id=RequestId(rid), prompt_token_ids=prompt,
                          sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True),
                          arrival_s=0.0, complexity_hint=COMPLEXITY[member])
        core.add_request(request, lambda out, rid=rid: outputs[rid].extend(out.new_token_ids))
    drain(core, 500)
    return outputs, core


@pytest.mark.parametrize("member", ["tiny-m", "tiny-l"])
def test_greedy_tokens_with_speculation_equal_those_without(member):
    plain, _ = run(False, member)
    speculated, core = run(True, member)
    assert speculated == plain and all(len(tokens) == 24 for tokens in plain.values())
    counters = core.snapshot()["counters"]
    drafted = counters["drafted_tokens"][f"tiny-s->{member}"]
    accepted = counters["accepted_draft_tokens"][f"tiny-s->{member}"]
    assert drafted > 0 and 0 < accepted <= drafted
    assert core.num_steps < len(PROMPTS) * 24, "verifies gave some requests several tokens in one step"
    assert core.pool.num_used_pages() == 0                  # target and draft pages all returned


def test_a_seeded_sampled_request_is_not_drafted_for_and_keeps_its_tokens():
    """The core drafts only where a verify reproduces decoding alone (speculation.draftable): not seeded sampling."""
    plain, _ = run(False, "tiny-l", temperature=1.0, seed=7)
    speculated, core = run(True, "tiny-l", temperature=1.0, seed=7)
    assert speculated == plain
    assert core.snapshot()["counters"]["drafted_tokens"]["tiny-s->tiny-l"] == 0


def test_with_the_measured_draft_length_greedy_tokens_are_still_those_without_speculation():
    """As served: the engine measures its steps and the core drafts whatever length its fit says pays (0 before
    MIN_STEPS steps, and wherever drafting costs more than it gives on this machine); the tokens never change."""
    from engines.local.step_costs import MIN_STEPS

    plain, _ = run(False, "tiny-l", max_tokens=64)
    speculated, core = run(True, "tiny-l", measured=True, max_tokens=64)
    assert speculated == plain and all(len(tokens) == 64 for tokens in plain.values())
    assert core.executor.step_costs.num_steps == core.num_steps >= MIN_STEPS
    steps = core.snapshot()["counters"]["draft_length_steps"]
    assert steps.get("0", 0) >= MIN_STEPS // 2                     # nothing drafted before the fit has a figure
    assert core.pool.num_used_pages() == 0


def _mixed(speculate: bool, rides: bool = False, max_tokens: int = 20,
           stop: tuple[int, ...] = ()) -> tuple[dict, EngineCore, list[int]]:
    """Requests on tiny-s and on tiny-l in the same steps, the members run as separate forwards (as an independent
    family's do: no nested merge); returns the tokens, the core, and per step how many batches rode in the drafts'
    catch-up forward."""
    core = _tiny_core(speculate, rides=rides)
    executor = core.executor
    executor.nested_pairs = set()
    rode: list[int] = []
    run_drafts, execute = executor.run_drafts, executor.execute
    core.riders = []            # per step: (the riders the step-cost estimate expects, the batches that rode)
    core.ridden = []            # per step: request -> tokens it took riding the draft forwards

    def spy(batches, riders=None):
        drafted, logits, ridden = run_drafts(batches, riders)
        rode.append(len(logits))
        core.ridden.append({rid: len(tokens) for rid, tokens in ridden.items()})
        return drafted, logits, ridden

    def spy_execute(plan):
        expected = executor.riders_of(plan_forwards(plan))
        sampled = execute(plan)
        core.riders.append((expected, set(executor.last_riders)))
        return sampled

    executor.run_drafts, executor.execute = spy, spy_execute
    outputs: dict[str, list[int]] = {}
    for i, (prompt, complexity) in enumerate(zip(PROMPTS, (0.05, 0.95, 0.05))):
        rid = f"r{i}"
        outputs[rid] = []
        request = Request(request_id=RequestId(rid), prompt_token_ids=prompt,
                          sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                  stop_token_ids=tuple(stop)),
                          arrival_s=0.0, complexity_hint=complexity)
        core.add_request(request, lambda out, rid=rid: outputs[rid].extend(out.new_token_ids))
    drain(core, 500)
    return outputs, core, rode


def test_the_draft_members_own_batch_rides_in_the_drafts_catch_up_forward_and_keeps_its_tokens():
    """One engine running the whole family reads the draft member's weights once for its own requests' decodes and
    the drafts' catch-up (a separate deployment's draft copy cannot): the tokens of both members are those
    without speculation, and every page returns."""
    plain, _, _ = _mixed(False)
    speculated, core, rode = _mixed(True)
    assert speculated == plain and all(len(tokens) == 20 for tokens in plain.values())
    assert sum(rode) > 0, "tiny-s's batch rode in some step's catch-up forward"
    # the measured step-cost fit prices a step as the engine runs it: one forward where the batch rode
    assert all(expected == actual for expected, actual in core.riders) and any(a for _, a in core.riders)
    assert core.snapshot()["counters"]["drafted_tokens"]["tiny-s->tiny-l"] > 0
    assert core.pool.num_used_pages() == 0


@pytest.mark.parametrize("max_tokens", [20, 13])
def test_the_draft_members_own_decodes_ride_every_draft_forward_and_keep_their_tokens(max_tokens):
    """Riding every draft forward, tiny-s's own requests decode a token in each of the k draft forwards the engine runs
    for tiny-l's request (k tokens in the step, no forward of their own): every request's tokens are still those
    without speculation, to the last one (13: a ride cut short by max_tokens), and every page returns."""
    plain, _, _ = _mixed(False, max_tokens=max_tokens)
    speculated, core, _ = _mixed(True, rides=True, max_tokens=max_tokens)
    assert speculated == plain and all(len(tokens) == max_tokens for tokens in plain.values())
    rides = [n for step in core.ridden for rid, n in step.items()]
    assert rides and max(rides) == 3 and {rid for step in core.ridden for rid in step} == {"r0", "r2"}
    assert core.snapshot()["counters"]["ride_tokens"]["tiny-s"] == sum(rides)
    # the measured step-cost fit prices a step as the engine runs it
    assert all(expected == actual for expected, actual in core.riders)
    assert core.pool.num_used_pages() == 0


def test_a_ride_ends_where_plain_decoding_would_stop_on_a_stop_token():
    """A stop token among a ride's tokens ends the request where plain decoding ends it (the ride's later forwards
    leave it out), and its pages return."""
    free, _, _ = _mixed(False, max_tokens=30)
    stop = free["r0"][7]
    plain, _, _ = _mixed(False, max_tokens=30, stop=(stop,))
    speculated, core, _ = _mixed(True, rides=True, max_tokens=30, stop=(stop,))
    assert speculated == plain and len(plain["r0"]) <= 8
    assert core.pool.num_used_pages() == 0



@pytest.mark.parametrize("family_name,overrides,expect", [
    ("independent", {}, True), ("independent", {"speculation.drafts_ride": False}, False),
    ("independent", {"comparison.private_drafts": True}, False), ("nested", {}, False)])
def test_rides_are_for_a_family_of_separate_weights_drafting_with_its_own_draft_member(family_name, overrides,
                                                                                         expect):
    """A family of separate weights rides where its draft member's batch rides at all and drafts are its own; a
    nested family's draft member has its batch merged into its host's forward instead."""
    from tests.fakes import independent_family, nested_family
    from tests.test_scheduler import Harness

    family = independent_family() if family_name == "independent" else nested_family()
    h = Harness(family=family, **{"speculation.enabled": True, **overrides})
    assert h.scheduler.speculation.rides is expect
