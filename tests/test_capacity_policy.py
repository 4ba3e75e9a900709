"""Capacity policies (TensorRT-LLM's two): guaranteed_no_evict admits a request only beside every running request's
remaining max_tokens in full and never preempts; max_utilization (the peak reservation on the expected reply
length) packs more and preempts when a decode runs short. `mfs simulate --capacity-policy` sets it for every system."""
from __future__ import annotations

import argparse

import pytest

from orchestrator.core.types import MemberName
from tests.test_scheduler import PROMPT, Harness

# The expected share of an open length's remaining tokens starts and stays at 0.1: max_utilization packs hard.
PACKING = {"pool.num_pages": 84, "scheduler.new_token_ratio_init": 0.1, "scheduler.new_token_ratio_min": 0.1}


def submit_two(h: Harness) -> None:
    # l: 6 pages per 4-token block; 84 pages = 14 blocks. Each request: 21 prompt tokens (6 blocks), replies of
    # open length that run to max_tokens 20 (the fake model never samples EOS): 41 tokens, 11 blocks at its end.
    for i in range(2):
        h.submit(f"r{i}", [i + 3] + PROMPT, max_tokens=20, ignore_eos=False, pinned_member=MemberName("l"))


def preemptions(h: Harness) -> int:
    return h.scheduler.snapshot(h.now)["counters"]["preemptions"]


def test_guaranteed_no_evict_waits_for_the_full_reservation_and_never_preempts():
    reference = Harness()
    submit_two(reference)
    reference.run()

    packed = Harness(**PACKING, **{"scheduler.decode_reservation": "peak"})
    submit_two(packed)
    packed.step()
    assert len(packed.scheduler.running) == 2          # 6 + 6 blocks now, expected 6 + 6 at their ends: both fit
    packed.run(2000)
    assert preemptions(packed) > 0                     # they grow to 11 + 11 blocks of 14: one runs short

    guaranteed = Harness(**PACKING, **{"scheduler.decode_reservation": "guaranteed_no_evict"})
    submit_two(guaranteed)
    guaranteed.step()
    # r0 alone fits whole; r1 needs its 6 + 5 blocks beside r0's 6 held + 5 to come: 22 > 14, so it waits
    assert [s.request_id for s in guaranteed.scheduler.running] == ["r0"]
    assert guaranteed.scheduler.reservation.ratio.value == 1.0
    for _ in range(100):
        if guaranteed.scheduler.running.get("r1") is not None:
            break
        guaranteed.step()
    assert guaranteed.outputs["r0"][-1].finished        # admitted only once r0 ended and returned its pages
    guaranteed.run(2000)
    assert preemptions(guaranteed) == 0
    for rid in ("r0", "r1"):
        assert guaranteed.tokens(rid) == reference.tokens(rid) == packed.tokens(rid)
    assert guaranteed.pool.counts()["used"] == 0


def test_guaranteed_no_evict_admits_side_by_side_what_fits_in_full():
    h = Harness(**{"pool.num_pages": 84 * 2, "scheduler.decode_reservation": "guaranteed_no_evict"})
    submit_two(h)              # 22 blocks of 28: both whole
    h.step()
    assert len(h.scheduler.running) == 2
    h.run()
    assert preemptions(h) == 0


def sim_args(*argv: str) -> argparse.Namespace:
    from eval.simulate.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_simulators_capacity_policy_defaults_to_trtllms_for_its_cost_model_and_applies_to_every_system(tmp_path):
    from eval.bench.cli import BenchSettings
    from eval.simulate.cli import build_setup, sim_settings, system_configs
    from tests.test_simulate import PROMPT as SIM_PROMPT, _tokenizer, small_qwen3_table, trace_of

    table = small_qwen3_table(tmp_path)
    args = sim_args("--family", "qwen3", "--gpu", "test_gpu", "--step-table", table)
    setup = build_setup(args, sim_settings(args))
    assert setup.capacity_policy == "guaranteed_no_evict"
    settings = BenchSettings(family="qwen3", systems=("mfs", "baseline", "baseline_legacy"), baseline_split="traffic")
    configs, _ = system_configs(setup, settings, trace_of([[(SIM_PROMPT, 4, 0.0)]], [0.0]), tokenizer=_tokenizer())
    assert {c.scheduler.decode_reservation for c in configs.values()} == {"guaranteed_no_evict"}

    args = sim_args("--family", "qwen3", "--gpu", "test_gpu", "--step-table", table,
                    "--capacity-policy", "max_utilization")
    setup = build_setup(args, sim_settings(args))
    assert setup.capacity_policy == "max_utilization"
    configs, _ = system_configs(setup, settings, trace_of([[(SIM_PROMPT, 4, 0.0)]], [0.0]), tokenizer=_tokenizer())
    assert {n: c.scheduler.decode_reservation for n, c in configs.items()} == {
        "mfs": "peak", "baseline": "peak", "baseline_legacy": "block"}      # each system's own

    tiny = sim_args("--family", "tiny", "--quick")
    assert build_setup(tiny, sim_settings(tiny)).capacity_policy == "max_utilization"
    assert "scheduler.decode_reservation" not in build_setup(tiny, sim_settings(tiny)).overrides


def test_an_elastic_pool_across_per_member_gpus_is_refused(tmp_path):
    from eval.bench.cli import BenchSettings
    from eval.simulate.cli import system_configs
    from eval.simulate.fleet import PlacementError, parse_placement
    from eval.simulate.setup import paper_setup
    from tests.test_simulate import PROMPT as SIM_PROMPT, _tokenizer, small_qwen3_table, trace_of

    setup = paper_setup("qwen3", "test_gpu", "trtllm", parse_placement("per-member"), small_qwen3_table(tmp_path))
    for elastic in ("baseline_elastic", "baseline_elastic_spec"):
        settings = BenchSettings(family="qwen3", systems=("mfs", elastic))
        with pytest.raises(PlacementError, match=f"{elastic} draw.*its own GPUs"):
            system_configs(setup, settings, trace_of([[(SIM_PROMPT, 4, 0.0)]], [0.0]), tokenizer=_tokenizer())
