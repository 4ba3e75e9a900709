"""The validation's pure parts: the linear fit recovers known costs, per-system fits see only that system's
steps, and the machine-probe scaling multiplies every cost by the probe ratio."""
import math

import pytest

from eval.simulate.cost_model import BatchShape, LinearCostModel
from eval.validate.variant_costs import fit, probe_of, probe_scaled, scaled

COEF = {"a": (0.002, 0.0001, 0.0005, 0.00002, 0.003, 0.0004), "b": (0.004, 0.0002, 0.001, 0.00004, 0.006, 0.0009)}


def _step(member: str, decodes: int, context: int, prefill: int) -> tuple[list[BatchShape], float]:
    shape = BatchShape(member, tuple([context] * decodes), ((prefill, context),) if prefill else ())
    return [shape], LinearCostModel(COEF, 0.0, "truth").batch_s(shape)


def _run(factor: float, members=("a", "b")) -> dict:
    steps = [(shapes, seconds * factor) for m in members for d in (1, 2, 5, 9) for c in (100, 400)
             for p in (0, 32, 128) for shapes, seconds in [_step(m, d, c, p)]]
    return {"observations": steps, "gaps_s": [0.001 * factor] * 3}


def test_fit_recovers_known_coefficients_and_gap():
    real = {1.0: {"steps": {"mfs": _run(1.0)}}}
    model = fit(real, [1.0], ["a", "b"])
    for member, truth in COEF.items():
        assert model.coefficients[member] == pytest.approx(truth, abs=1e-9)
    assert model.overhead_s == pytest.approx(0.001)


def test_fit_of_one_system_sees_only_its_steps():
    real = {1.0: {"steps": {"mfs": _run(1.0), "baseline": _run(3.0)}}}
    fast = fit(real, [1.0], ["a", "b"], system="mfs")
    slow = fit(real, [1.0], ["a", "b"], system="baseline")
    assert slow.coefficients["a"][0] == pytest.approx(3 * fast.coefficients["a"][0])
    assert "baseline's run" in slow.source


def test_scaled_multiplies_every_cost():
    model = LinearCostModel(COEF, 0.002, "x")
    shape = BatchShape("b", (300, 300), ((32, 10),))
    double = scaled(model, 2.0)
    assert double.batch_s(shape) == pytest.approx(2 * model.batch_s(shape))
    assert double.step_overhead_s() == pytest.approx(0.004)


def test_probe_scaling_uses_the_runs_probe_over_the_fit_runs_mean():
    probe = lambda ms: {"before": [ms, ms, 99.0], "after": [ms, ms, 0.0]}     # the median ignores one outlier each
    real = {0.5: {"steps": {"mfs": {}, "baseline": {}}, "probe_ms": {"mfs": probe(4.0), "baseline": probe(6.0)}},
            1.0: {"steps": {"mfs": {}, "baseline": {}}, "probe_ms": {"mfs": probe(10.0), "baseline": probe(5.0)}}}
    assert probe_of(real[0.5], "mfs") == 4.0
    model = LinearCostModel(COEF, 0.001, "x")
    per_system = probe_scaled(real, [0.5], 1.0, ("mfs", "baseline"), model)
    assert per_system["mfs"].overhead_s == pytest.approx(0.001 * 10.0 / 5.0)
    assert per_system["baseline"].overhead_s == pytest.approx(0.001 * 5.0 / 5.0)
    assert probe_scaled({0.5: {"steps": {"mfs": {}}}, 1.0: real[1.0]}, [0.5], 1.0, ("mfs",), model) is None


def test_each_system_replays_its_own_recorded_confidences(monkeypatch, tmp_path):
    """The shared file keeps the first system's sequence of a request both ran on a member; each simulated system
    reads the file of its own real run where there is one (older work dirs: the shared one)."""
    import json
    from dataclasses import replace

    import eval.simulate.cli as sim_cli
    import eval.validate.bench_vs_sim as validate
    from eval.bench.cli import BenchSettings
    from eval.bench.confidence_file import CONFIDENCE_FORMAT

    shared = tmp_path / "confidences_r1.0.json"
    for path, source in ((shared, "shared"), (validate.own_confidences(shared, "baseline"), "baseline's own")):
        path.write_text(json.dumps({"format": CONFIDENCE_FORMAT, "family": "tiny", "source": source,
                                    "members": {"tiny-m": [[0.9, 0.8]]}, "by_request": {}}))
    assert validate.own_confidences(shared, "baseline").name == "confidences_r1.0_baseline.json"
    seen = {}

    def run_system(name, config, setup, trace, library, vocab_size, interval, replies=None):
        seen[name] = library.source
        return None, {}
    monkeypatch.setattr(sim_cli, "run_system", run_system)
    monkeypatch.setattr(validate, "config_for", lambda name, settings, split: None)
    settings = replace(BenchSettings.quick_defaults(), systems=("mfs", "baseline"))
    validate.simulate_rate(settings, {"split": None, "trace": None}, LinearCostModel(COEF, 0.0, "x"), shared)
    assert seen == {"mfs": "shared", "baseline": "baseline's own"}


def test_request_path_maps_the_replay_clock_onto_the_engines():
    from types import SimpleNamespace

    from eval.validate.bench_vs_sim import request_path_of

    # the replay started at monotonic 100.0: a request sent at 2.0 (replay clock) arrived at 102.0 (monotonic)
    records = [SimpleNamespace(session_id="s0", turn_index=0, send_s=2.0, finish_s=2.5),
               SimpleNamespace(session_id="s1", turn_index=1, send_s=3.0, finish_s=None)]    # never finished
    edges = {"mfs-s0-t0": [102.0, 102.0004, 102.4997], "mfs-s1-t1": [103.0, 103.0005, None]}
    path = request_path_of(records, edges, "mfs")
    assert path["in_s"] == pytest.approx([0.0004]) and path["out_s"] == pytest.approx([0.0003])
    real = {1.0: {"steps": {"mfs": {**_run(1.0), "request_path": {"in_s": [0.1, 0.3, 0.2], "out_s": [0.05]}}}}}
    model = fit(real, [1.0], ["a", "b"])
    assert model.request_path_s() == pytest.approx((0.2, 0.05))
    assert LinearCostModel.from_dict(model.to_dict()).request_path_s() == pytest.approx((0.2, 0.05))
    assert fit({1.0: {"steps": {"mfs": _run(1.0)}}}, [1.0], ["a", "b"]).request_path_s() == (0.0, 0.0)


def test_calibrated_scales_by_the_runs_own_one_request_decode_steps():
    from eval.validate.variant_costs import calibrated

    def run(seconds_a: float, extra: int = 0) -> dict:
        solo = [([BatchShape("a", (100,), ())], seconds_a)] * (30 + extra)
        pair = [([BatchShape("a", (100, 100), ())], 1.0)] * 5        # two rows: not a one-request step
        return {"observations": solo + pair, "gaps_s": []}
    real = {0.5: {"steps": {"mfs": run(0.002), "baseline": run(0.002)}},
            1.0: {"steps": {"mfs": run(0.003), "baseline": run(0.004)}}}
    model = LinearCostModel(COEF, 0.001, "x")
    per_system = calibrated(real, [0.5], 1.0, ("mfs", "baseline"), model)
    shape = BatchShape("b", (300,), ())
    assert per_system["mfs"].batch_s(shape) == pytest.approx(1.5 * model.batch_s(shape))
    assert per_system["baseline"].overhead_s == pytest.approx(2 * 0.001)
    assert "a's one-request decode steps" in per_system["baseline"].source
    too_few = {0.5: real[0.5], 1.0: {"steps": {"mfs": {"observations": run(0.003)["observations"][:10], "gaps_s": []}}}}
    assert calibrated(too_few, [0.5], 1.0, ("mfs",), model) is None


def test_table_held_out_scales_the_offline_table_by_the_fit_runs_median_ratio():
    from eval.simulate.step_table import Grid2D, MemberCosts, StepTable
    from eval.validate.variant_costs import table_held_out

    grid = Grid2D((1.0, 8.0), (0.0, 1000.0), ((1.0, 1.0), (2.0, 2.0)))       # 1 ms at one row, 2 ms at eight
    table = StepTable("timed offline", {"a": MemberCosts(decode_ms=grid, prefill_ms=grid)})
    one, eight = BatchShape("a", (100,), ()), BatchShape("a", (100,) * 8, ())
    steps = [([one], 0.0012), ([one], 0.0013), ([eight], 0.0025)]           # real / table: 1.2, 1.3, 1.25
    real = {0.5: {"steps": {"mfs": {"observations": steps, "gaps_s": []}}}}
    model = table_held_out(table, real, [0.5], 0.0004)
    assert model.batch_s(one) == pytest.approx(0.00125) and model.batch_s(eight) == pytest.approx(0.0025)
    assert model.step_overhead_s() == pytest.approx(0.0004)
    assert table.member("a").decode_ms(8, 100) == 2.0                        # the table itself unchanged


def test_table_calibrated_takes_the_level_from_the_run_and_the_serving_terms_from_the_fit():
    from eval.simulate.step_table import Grid2D, MemberCosts, StepTable
    from eval.validate.variant_costs import table_calibrated

    grid = Grid2D((1.0, 8.0), (0.0, 1000.0), ((1.0, 1.0), (2.0, 2.0)))
    table = StepTable("timed offline", {"a": MemberCosts(decode_ms=grid, prefill_ms=grid)})
    one, eight = BatchShape("a", (100,), ()), BatchShape("a", (100,) * 8, ())
    run = {"steps": {"mfs": {"observations": [([one], 0.0015)] * 25 + [([eight], 0.009)] * 5, "gaps_s": []}}}
    serving = LinearCostModel(COEF, 0.0003, "fit", after_idle=(0.002, 0.5, 0.01), path_s=(0.0001, 0.0002))
    model = table_calibrated(table, run, ("mfs",), serving)["mfs"]
    assert model.batch_s(one) == pytest.approx(0.0015) and model.batch_s(eight) == pytest.approx(0.003)  # the grid's shape
    assert model.step_overhead_s() == pytest.approx(0.0003)
    assert model.history_s(float("inf"), 0, 0, 0) == pytest.approx(0.002)
    assert model.request_path_s() == (0.0001, 0.0002)
    assert table_calibrated(table, {"steps": {"mfs": {"observations": [([one], 0.0015)] * 5, "gaps_s": []}}},
                            ("mfs",), serving) is None                      # too few one-request steps to say


def test_table_held_out_serving_takes_level_and_prefill_extra_from_the_fit_runs_only():
    from eval.simulate.step_table import Grid2D, MemberCosts, StepTable
    from eval.validate.variant_costs import table_held_out_serving

    grid = Grid2D((1.0, 8.0), (0.0, 1000.0), ((1.0, 1.0), (2.0, 2.0)))      # 1 ms at one row (or token), 2 at eight
    table = StepTable("timed offline", {"a": MemberCosts(decode_ms=grid, prefill_ms=grid, mix_overlap=0.0)})
    one, eight = BatchShape("a", (100,), ()), BatchShape("a", (100,) * 8, ())
    prefill = BatchShape("a", (), ((8, 0),))                                   # 2 ms in the table
    # fit run: one-request decodes at 1.5x the table, prefill steps 0.6 ms over 1.5x (3.6 ms); every step starts
    # 5 ms after the one before, so each follows an idle gap (1.4 ms after a prefill step, 3.5 after a decode)
    fit_run = {"observations": [([one], 0.0015)] * 25 + [([prefill], 0.0036)] * 5, "gaps_s": [],
               "starts_s": [i * 0.005 for i in range(30)]}
    simulated_run = {"observations": [([one], 0.009)] * 25, "gaps_s": []}      # 6x: must not move the model
    real = {0.5: {"steps": {"mfs": fit_run}}, 1.0: {"steps": {"mfs": simulated_run}}}
    serving = LinearCostModel(COEF, 0.0003, "fit", path_s=(0.0001, 0.0002))
    model = table_held_out_serving(table, real, [0.5], serving)
    assert model.batch_s(one) == pytest.approx(0.0015) and model.batch_s(eight) == pytest.approx(0.003)
    assert model.prefill_extra_s == pytest.approx(0.0006)
    assert model.batch_s(prefill) == pytest.approx(0.0036) and model.batch_s(one) == pytest.approx(0.0015)
    assert model.step_overhead_s() == pytest.approx(0.0003) and model.request_path_s() == (0.0001, 0.0002)
    assert model.describe()["prefill_extra_ms"] == pytest.approx(0.6)
    # the history terms the fit carries are not counted twice (the median prefill step follows a 1.4 ms idle gap)
    with_idle = LinearCostModel(COEF, 0.0003, "fit", after_idle=(0.0002, 0.5, 0.001))
    idle_cost = 0.0002 * (1 - math.exp(-0.0014 / 0.001))
    assert table_held_out_serving(table, real, [0.5], with_idle).prefill_extra_s == pytest.approx(0.0006 - idle_cost)
    few = {0.5: {"steps": {"mfs": {"observations": [([one], 0.0015)] * 5, "gaps_s": []}}}}
    assert table_held_out_serving(table, few, [0.5], serving) is None         # too few one-request steps to say


def test_ttft_parts_cut_a_first_token_at_the_scheduler_the_first_step_and_the_sampling_step():
    from eval.bench.metrics import RequestRecord
    from eval.validate.ttft_parts import ttft_parts

    # replay clock = monotonic - 100; the request arrives at monotonic 100.010 (replay 0.010)
    record = RequestRecord(session_id="s1", turn_index=0, send_s=0.010, first_token_s=0.020, finish_s=0.05,
                           prompt_tokens=40, cached_tokens=0, output_tokens=3)
    late = RequestRecord(session_id="s2", turn_index=0, send_s=0.0, first_token_s=None, finish_s=None,
                         prompt_tokens=5, cached_tokens=0, output_tokens=0)              # no first token: left out
    steps = [(100.0105, 100.0125, [("other", True)]),
             (100.0130, 100.0160, [("mfs-s1-t0", False), ("other", True)]),             # first chunk, no sample
             (100.0161, 100.0185, [("mfs-s1-t0", True)]),                                # samples its first token
             (100.0190, 100.0200, [("mfs-s1-t0", True)])]
    edges = {"mfs-s1-t0": (100.010, 100.0101), "mfs-s2-t0": (100.0, 100.0)}
    parts = ttft_parts([record, late], steps, edges, "mfs")
    assert parts["ttft"] == [pytest.approx(0.010)]
    assert parts["in"] == [pytest.approx(0.0001)] and parts["queue"] == [pytest.approx(0.0029)]
    assert parts["steps"] == [pytest.approx(0.0055)] and parts["out"] == [pytest.approx(0.0015)]
    assert sum(parts[p][0] for p in ("in", "queue", "steps", "out")) == pytest.approx(parts["ttft"][0])
