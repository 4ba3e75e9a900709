"""scheduler.member_interleave: which members a step includes (orchestrator/core/interleave.py), exact over the
fakes."""
from __future__ import annotations

import pytest

from orchestrator.core.config import ConfigError, load_config
from orchestrator.core.interleave import MemberInterleave, member_costs
from orchestrator.core.types import MemberName
from tests.fakes import nested_family
from tests.test_scheduler import PROMPT, Harness


def _runs(chooser: MemberInterleave, running: dict[str, int], steps: int) -> dict[str, int]:
    counts = {n: 0 for n in running}
    for _ in range(steps):
        for name in chooser.choose(running):
            counts[name] += 1
    return counts


def test_lockstep_includes_every_member_with_work():
    chooser = MemberInterleave("lockstep", {"s": 1.0, "m": 2.0, "l": 8.0})
    assert chooser.choose({"s": 3, "m": 0, "l": 1}) == {"s", "l"}
    assert _runs(chooser, {"s": 1, "m": 1, "l": 1}, 10) == {"s": 10, "m": 10, "l": 10}


def test_cost_weighted_runs_each_member_at_sqrt_of_requests_over_cost():
    chooser = MemberInterleave("cost_weighted", {"s": 1.0, "m": 4.0, "l": 16.0})
    # rates sqrt(n/c): s 1, m 0.5, l 0.25 -> s every step, m every 2nd, l every 4th
    assert _runs(chooser, {"s": 1, "m": 1, "l": 1}, 40) == {"s": 40, "m": 20, "l": 10}
    assert chooser.share == {"s": 1.0, "m": 0.5, "l": 0.25}
    # 16 requests on l: its rate sqrt(16/16) = 1 ties with s; both run in every step
    assert _runs(MemberInterleave("cost_weighted", {"s": 1.0, "l": 16.0}), {"s": 1, "l": 16}, 8) == {"s": 8, "l": 8}
    # the pacer is whoever has the highest rate: here l (sqrt(64/16) = 2 against s's 1)
    assert _runs(MemberInterleave("cost_weighted", {"s": 1.0, "l": 16.0}), {"s": 1, "l": 64}, 8) == {"s": 4, "l": 8}


def test_a_member_without_work_keeps_no_credit():
    chooser = MemberInterleave("cost_weighted", {"s": 1.0, "l": 4.0})
    assert [chooser.choose({"s": 1, "l": 1}) for _ in range(3)] == [{"s"}, {"s", "l"}, {"s"}]
    assert chooser.choose({"s": 1, "l": 0}) == {"s"}      # l idle: its half turn is dropped
    assert chooser.choose({"s": 1, "l": 1}) == {"s"}      # so it starts from nothing again
    assert chooser.choose({"s": 1, "l": 1}) == {"s", "l"}
    assert chooser.choose({"s": 0, "l": 2}) == {"l"}      # alone, a member runs in every step


def test_member_costs_default_to_weight_bytes_and_check_configured_ones():
    family = nested_family()
    costs = member_costs(family)
    assert list(costs) == family.member_names and costs["s"] < costs["m"] < costs["l"]
    assert member_costs(family, {"s": 1, "m": 2, "l": 5}) == {"s": 1.0, "m": 2.0, "l": 5.0}
    with pytest.raises(ConfigError, match="not in family"):
        member_costs(family, {"s": 1, "m": 2, "l": 5, "xl": 9})
    with pytest.raises(ConfigError, match="lacks members"):
        member_costs(family, {"s": 1, "l": 5})
    with pytest.raises(ConfigError, match="positive"):
        member_costs(family, {"s": 0, "m": 2, "l": 5})
    with pytest.raises(ConfigError, match="member_interleave"):
        load_config(overrides={"scheduler.member_interleave": "fastest"})


def _run(mode: str) -> tuple[Harness, dict[str, list[int]]]:
    """A small-member and a large-member request side by side; the steps at which each got tokens."""
    h = Harness(**{"scheduler.member_interleave": mode, "scheduler.member_step_costs": {"s": 1, "m": 2, "l": 4}})
    h.submit("small", PROMPT, max_tokens=12, pinned_member=MemberName("s"))
    h.submit("large", [7] + PROMPT, max_tokens=12, pinned_member=MemberName("l"))
    steps: dict[str, list[int]] = {"small": [], "large": []}
    ran: dict[str, list[int]] = {"s": [], "l": []}        # the steps whose plan had the member's batch
    for step in range(1, 100):
        if not h.scheduler.has_work():
            break
        before = {rid: len(h.tokens(rid)) if rid in h.outputs else 0 for rid in steps}
        plan = h.step()
        for batch in plan.batches:
            ran[batch.member].append(step)
        for rid in steps:
            if rid in h.outputs and len(h.tokens(rid)) > before[rid]:
                steps[rid].append(step)
    counted = h.scheduler.snapshot(h.now)["counters"]["member_steps"]
    assert counted == {"s": len(ran["s"]), "m": 0, "l": len(ran["l"])}     # mfs_member_steps_total
    return h, steps


def test_the_scheduler_steps_a_cheap_member_more_often_and_loses_no_token():
    (lock, lock_steps), (weighted, steps) = _run("lockstep"), _run("cost_weighted")
    for h in (lock, weighted):
        assert len(h.tokens("small")) == len(h.tokens("large")) == 12 and h.final("large").finished
        assert h.pool.num_used_pages() == 0        # every page returned
    # lockstep: both get a token in the same steps; weighted: s (rate sqrt(1/1)) runs in every step and
    # l (sqrt(1/4)) in every other one. On a device the steps without l are the cheaper ones (the simulator's
    # test of this times them); in steps, s keeps its pace and l takes longer.
    # Once s has finished (step 13), l runs alone, in every step.
    assert lock_steps["small"] == lock_steps["large"] == steps["small"] == list(range(2, 14))
    assert steps["large"] == [4, 6, 8, 10, 12, 14, 15, 16, 17, 18, 19, 20]
    steps_run = weighted.scheduler.snapshot(weighted.now)["counters"]["member_steps"]
    assert steps_run == {"s": 13, "m": 0, "l": 13}     # l: 6 of the 13 steps s was in, then 7 alone
    assert lock.scheduler.snapshot(lock.now)["counters"]["member_steps"] == {"s": 13, "m": 0, "l": 13}


def test_mfs_serve_refuses_costs_that_do_not_fit_the_family_in_one_line(tmp_path):
    import subprocess
    import sys

    config = tmp_path / "bad.yaml"
    config.write_text("scheduler:\n  member_interleave: cost_weighted\n  member_step_costs: {tiny-s: 1}\n")
    done = subprocess.run([sys.executable, "-m", "orchestrator.serve.cli", "serve", "--config", str(config),
                           "--port", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout.strip().splitlines() == [
        "mfs serve: config key 'scheduler.member_step_costs': lacks members ['tiny-l', 'tiny-m']"]
