"""The local engine's measured step costs (engines/local/step_costs.py): a fit of a step's seconds on its forwards'
shapes that speculation's draft length prices steps with, and its wiring into the core."""
from __future__ import annotations

import random

import pytest

from engines.local.step_costs import MIN_STEPS, WINDOW, MeasuredStepCosts, ride
from orchestrator.core.types import ForwardShape, MemberName

MEMBERS = ["s", "m", "l"]
COSTS = {  # seconds: per forward, per row, per thousand context reads, per draft forward, per draft row
    "s": (0.0010, 0.00002, 0.00001, 0.0012, 0.00003),
    "m": (0.0018, 0.00004, 0.00002, 0.0, 0.0),
    "l": (0.0034, 0.00008, 0.00004, 0.0, 0.0),
}
STEP_S = 0.0003


def true_cost(forwards) -> float:
    total = STEP_S
    for f in forwards:
        forward, row, read, draft, draft_row = COSTS[f.member]
        rows = len(f.decode_contexts) + sum(r for r, _ in f.verifies) + sum(n for n, _ in f.prefills)
        if f.is_draft:
            total += draft + draft_row * rows
        else:
            reads = sum(f.decode_contexts) + sum(r * (b + r) for r, b in f.verifies) + sum(n * (b + n) for n, b in f.prefills)
            total += forward + row * rows + read * reads / 1024
    return total


def random_step(rng: random.Random, drafts: bool) -> list[ForwardShape]:
    forwards = []
    if drafts:
        forwards.append(ForwardShape(MemberName("s"), tuple(rng.randrange(10, 400) for _ in range(rng.randint(1, 4))),
                                     (), (), True))
    for member in MEMBERS:
        if rng.random() < 0.3:
            continue
        decodes = tuple(rng.randrange(10, 900) for _ in range(rng.randint(0, 6)))
        verifies = tuple((rng.randint(2, 5), rng.randrange(10, 900)) for _ in range(rng.randint(0, 2)))
        prefills = tuple((rng.randint(2, 200), rng.randrange(0, 500)) for _ in range(rng.randint(0, 1)))
        if decodes or verifies or prefills:
            forwards.append(ForwardShape(MemberName(member), decodes, verifies, prefills))
    return forwards


def test_no_estimate_before_enough_steps_then_the_fitted_cost():
    costs = MeasuredStepCosts(MEMBERS)
    rng = random.Random(3)
    probe = random_step(rng, drafts=True)
    for i in range(MIN_STEPS - 1):
        step = random_step(rng, drafts=i % 3 == 0)
        costs.observe(step, true_cost(step))
        assert costs.estimate_step_s(probe) is None
    for i in range(WINDOW):
        step = random_step(rng, drafts=i % 3 == 0)
        costs.observe(step, true_cost(step))
    for _ in range(20):
        step = random_step(rng, drafts=True)
        assert costs.estimate_step_s(step) == pytest.approx(true_cost(step), rel=1e-3)


def test_a_shape_never_measured_costs_nothing_extra_until_steps_with_it_are_measured():
    """Drafts before any step drafted: the fit prices them at nothing (the core tries them), and prices them as
    they are once some steps drafted; the window's noise does not stop it."""
    costs = MeasuredStepCosts(MEMBERS)
    rng = random.Random(5)
    for _ in range(WINDOW):
        step = random_step(rng, drafts=False)
        costs.observe(step, true_cost(step) * rng.uniform(0.97, 1.03))
    plain = [f for f in random_step(rng, drafts=False)]
    drafted = [ForwardShape(MemberName("s"), (100, 200), (), (), True)] + plain
    assert costs.estimate_step_s(drafted) == pytest.approx(costs.estimate_step_s(plain), abs=1e-6)
    for _ in range(64):
        step = random_step(rng, drafts=True)
        costs.observe(step, true_cost(step) * rng.uniform(0.97, 1.03))
    extra = costs.estimate_step_s(drafted) - costs.estimate_step_s(plain)
    assert extra == pytest.approx(true_cost(drafted) - true_cost(plain), rel=0.25)


def test_the_fit_follows_a_machine_that_slows_down():
    costs = MeasuredStepCosts(MEMBERS)
    rng = random.Random(7)
    for _ in range(WINDOW):
        step = random_step(rng, drafts=False)
        costs.observe(step, true_cost(step))
    for _ in range(WINDOW):
        step = random_step(rng, drafts=False)
        costs.observe(step, 2 * true_cost(step))
    probe = random_step(random.Random(11), drafts=False)
    assert costs.estimate_step_s(probe) == pytest.approx(2 * true_cost(probe), rel=1e-3)


def test_a_batch_that_rode_in_its_drafts_forward_is_one_forward_to_the_fit():
    """A drafting member's own batch, run in its drafts' catch-up forward, costs that forward's rows, not a forward
    of its own: the fit reads the forwards as run, prices steps as they would run, and gets them right."""
    draft = ForwardShape(MemberName("s"), (100, 200), (), (), True)
    own = ForwardShape(MemberName("s"), (50, 60, 70), (), ())
    large = ForwardShape(MemberName("l"), (), ((3, 300),), ())
    assert ride([draft, large, own], {"s"}) == [ForwardShape(MemberName("s"), (100, 200, 50, 60, 70), (), (), True),
                                                large]
    assert ride([draft, large, own], ()) == [draft, large, own]
    assert ride([large, own], {"s"}) == [large, own]                 # nothing to ride in

    def riders_of(forwards):
        return {"s"} if any(f.is_draft for f in forwards) and any(f.member == "s" and not f.is_draft
                                                                    for f in forwards) else set()

    costs = MeasuredStepCosts(MEMBERS, riders_of)
    rng = random.Random(13)
    for i in range(WINDOW):
        step = random_step(rng, drafts=i % 2 == 0)
        ran = ride(step, riders_of(step))
        costs.observe(ran, true_cost(ran))
    for _ in range(20):
        step = random_step(rng, drafts=True)
        assert costs.estimate_step_s(step) == pytest.approx(true_cost(ride(step, riders_of(step))), rel=1e-3)


class PricedExecutor:
    def __init__(self, step_costs):
        self.step_costs = step_costs


def test_the_core_prices_draft_lengths_with_the_executors_step_costs_where_it_has_them():
    from orchestrator.core.complexity import ComplexityEstimator
    from orchestrator.core.engine_core import EngineCore
    from tests.fakes import FakeExecutor, fake_config, fake_vocab, independent_family

    config = fake_config(**{"speculation.enabled": True})
    family = independent_family()
    core = EngineCore(config, family, clock=lambda: 0.0, estimator=ComplexityEstimator(fake_vocab()))
    measured = MeasuredStepCosts(family.member_names)
    core.attach_executor(PricedExecutor(measured))
    assert core.scheduler.speculation.estimate == measured.estimate_step_s
    assert core.scheduler.speculation.estimate_error == measured.estimate_error     # the margin drafts must beat
    core.attach_executor(FakeExecutor(family, config.pool.num_pages, config.pool.page_bytes))
    assert core.scheduler.speculation.estimate is None          # the fixed draft length
    assert core.scheduler.speculation.estimate_error is None


def test_the_fits_error_is_its_residual_relative_to_the_step():
    """On steps that vary as a CPU's do, the fit's error is the variation it cannot explain; on exact costs 0."""
    rng = random.Random(3)
    exact, noisy = MeasuredStepCosts(MEMBERS), MeasuredStepCosts(MEMBERS)
    for _ in range(WINDOW):
        step = random_step(rng, drafts=rng.random() < 0.5)
        exact.observe(step, true_cost(step))
        noisy.observe(step, true_cost(step) * rng.uniform(0.8, 1.2))
    assert exact.estimate_error() == pytest.approx(0.0, abs=1e-3)
    assert 0.05 < noisy.estimate_error() < 0.2          # uniform +-20%: about 11.5% RMS
