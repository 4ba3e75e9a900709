"""Intervals over runs (eval/bench/intervals.py): Student's t arithmetic and the curve figures read again per run."""
from __future__ import annotations

import json
import math
import statistics

import pytest

from eval.bench.intervals import differing_settings, interval, intervals_over, main, t_quantile_975


def test_interval_is_the_t_interval_of_the_mean():
    values = [0.30, 0.40, 0.35, 0.45, 0.50]
    found = interval(values)
    half = 2.776 * statistics.stdev(values) / math.sqrt(5)
    assert found.mean == pytest.approx(0.40) and found.n == 5
    assert (found.low, found.high) == (pytest.approx(0.40 - half), pytest.approx(0.40 + half))
    one = interval([0.3])
    assert one.mean == 0.3 and one.low is None and one.high is None
    assert interval([]) is None
    assert t_quantile_975(35) == 2.042 and t_quantile_975(500) == 1.96
    with pytest.raises(ValueError):
        t_quantile_975(0)


def run(seed: int, knee_base: float, mfs_scale: float) -> dict:
    """A two-system curve whose baseline doubles its light latency at 2 ** knee_base sessions/s."""
    points = []
    for rate in (0.5, 1.0, 2.0, 4.0, 8.0):
        base = 0.010 * 2 ** max(0.0, math.log2(rate) - knee_base + 1)
        points.append({"rate": rate, "systems": {
            "baseline": {"mean_token_latency_s": base, "ttft_p50_s": 0.1, "ttft_p90_s": 0.1 * base / 0.01,
                         "tpot_p50_s": 0.01, "tpot_p90_s": 0.01},
            "mfs": {"mean_token_latency_s": base * mfs_scale, "ttft_p90_s": 0.1, "tpot_p90_s": 0.01}}})
    return {"settings": {"seed": seed, "slo_ttft_x": 5.0, "slo_tpot_x": 2.0}, "curve": points,
            "reduction_at_knee": 0.99}                # a stale stored figure: recomputed from the curve


def test_intervals_recompute_each_runs_curve_figures():
    runs = [run(0, 1.0, 0.6), run(1, 2.0, 0.5), run(2, 1.0, 0.7)]
    found = intervals_over(runs)
    # baseline reaches 2x exactly at 2 ** knee_base: 2, 4, 2 sessions/s; mfs's reduction is 1 - scale there
    assert found["knee_rate"]["values"] == [pytest.approx(2.0), pytest.approx(4.0), pytest.approx(2.0)]
    assert found["reduction_at_knee"]["mean"] == pytest.approx(0.4)
    assert found["reduction_at_knee"]["n"] == 3 and found["reduction_at_knee_missing"] == 0
    assert found["reductions_at_knee"]["mfs"]["values"] == found["reduction_at_knee"]["values"]
    assert differing_settings(runs) == []
    assert differing_settings([run(0, 1, 0.5), {**run(1, 1, 0.5), "settings": {"seed": 1, "slo_ttft_x": 3.0}}]) == [
        "slo_ttft_x", "slo_tpot_x"]


def test_cli_prints_and_writes_the_intervals(tmp_path, capsys):
    files = []
    for seed, scale in enumerate((0.6, 0.5, 0.7)):
        path = tmp_path / f"r{seed}.json"
        path.write_text(json.dumps(run(seed, 1.0, scale)))
        files.append(str(path))
    out = tmp_path / "intervals.json"
    assert main([*files, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mfs reduction at the knee         40.0% [" in text and "(n=3)" in text
    assert json.loads(out.read_text())["intervals"]["reduction_at_knee"]["n"] == 3
    assert main([str(tmp_path / "missing.json")]) == 2


def test_seeds_and_run_files():
    from pathlib import Path

    from eval.bench.intervals import parse_seeds, run_file

    assert parse_seeds("0-4") == (0, 1, 2, 3, 4) and parse_seeds("3,1") == (3, 1)
    for bad in ("", "a", "1,1", "3-x"):
        with pytest.raises(ValueError):
            parse_seeds(bad)
    assert run_file("out/r.json", 3, 0, 1) == Path("out/r_seed3.json")
    assert run_file("r.json", 3, 1, 2) == Path("r_seed3_rep1.json")


def test_simulate_over_seeds_writes_each_run_and_the_intervals(tmp_path):
    from orchestrator.serve.cli import main as mfs

    out = tmp_path / "sim.json"
    assert mfs(["simulate", "--quick", "--sessions", "6", "--rates", "1,4", "--seeds", "0,1", "--no-progress",
                "--out", str(out)]) == 0
    combined = json.loads(out.read_text())
    assert combined["files"] == [str(tmp_path / "sim_seed0.json"), str(tmp_path / "sim_seed1.json")]
    runs = [json.loads(open(f).read()) for f in combined["files"]]
    assert [r["settings"]["seed"] for r in runs] == [0, 1]
    assert combined["intervals"]["capacity_at_slo"]["mfs"]["n"] == 2
    with pytest.raises(SystemExit, match="--repeats"):
        mfs(["simulate", "--quick", "--seeds", "0,1", "--repeats", "2", "--out", str(out)])


def test_mfs_against_each_system_at_every_rate_all_runs_share():
    from eval.bench.intervals import mfs_against_by_rate

    runs = [run(0, 1.0, 0.6), run(1, 2.0, 0.5)]
    by_rate = mfs_against_by_rate(runs)
    assert list(by_rate) == ["0.5", "1", "2", "4", "8"]
    assert by_rate["2"]["baseline"]["values"] == [pytest.approx(0.4), pytest.approx(0.5)]
    assert mfs_against_by_rate([run(0, 1.0, 0.6), {"curve": [], "settings": {}}]) == {}
