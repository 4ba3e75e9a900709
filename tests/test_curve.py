"""Load-curve arithmetic (eval/bench/curve.py): the knee, the reduction there, the SLO and the capacity at it."""
from __future__ import annotations

import pytest

from eval.bench.curve import (SLO, capacity_at_slo, default_slo, format_curve, grid_knee_rate, knee_rate, parse_rates,
                              reductions_at, summarize_curve, value_at)


def point(rate, base, mfs, base_ttft=(0.1, 0.1), base_tpot=(0.01, 0.01), mfs_ttft90=0.1, mfs_tpot90=0.01):
    return {"rate": rate, "systems": {
        "mfs": {"mean_token_latency_s": mfs, "ttft_p90_s": mfs_ttft90, "tpot_p90_s": mfs_tpot90},
        "baseline": {"mean_token_latency_s": base, "ttft_p50_s": base_ttft[0], "ttft_p90_s": base_ttft[1],
                     "tpot_p50_s": base_tpot[0], "tpot_p90_s": base_tpot[1]}}}


def test_knee_on_a_grid_point_is_that_point():
    curve = [point(0.5, 0.010, 0.009), point(1, 0.015, 0.010), point(2, 0.020, 0.011), point(4, 0.050, 0.02)]
    assert knee_rate(curve) == pytest.approx(2) and grid_knee_rate(curve) == 2   # 0.020 = 2 x 0.010 (equality counts)
    assert reductions_at(curve, 2) == {"mfs": pytest.approx(1 - 0.011 / 0.020)}
    assert knee_rate(curve[:2]) is None and reductions_at(curve, None) == {}
    assert knee_rate([]) is None


def test_knee_is_interpolated_in_log_rate_where_the_baseline_reaches_twice_its_light_latency():
    # the baseline crosses 0.020 a quarter of the way (in log rate) from 2 (0.016) to 4 (0.032): 2 ** 1.25
    curve = [point(0.5, 0.010, 0.009), point(1, 0.012, 0.010), point(2, 0.016, 0.012), point(4, 0.032, 0.016)]
    assert grid_knee_rate(curve) == 4
    knee = knee_rate(curve)
    assert knee == pytest.approx(2 ** 1.25)
    assert value_at(curve, "baseline", knee) == pytest.approx(0.020)
    assert value_at(curve, "mfs", knee) == pytest.approx(0.013)
    assert value_at(curve, "mfs", 2) == 0.012 and value_at(curve, "mfs", 8) is None
    assert reductions_at(curve, knee) == {"mfs": pytest.approx(1 - 0.013 / 0.020)}
    summary = summarize_curve(curve, None)
    assert summary["knee_rate"] == pytest.approx(2 ** 1.25)
    assert summary["reduction_at_knee"] == pytest.approx(0.35)
    assert summary["knee_grid_rate"] == 4 and summary["reduction_at_grid_knee"] == pytest.approx(0.5)
    text = format_curve({"curve": curve, **summary})
    assert "2.38 sessions/s, mfs reduction there 35.0%" in text and "grid reading, not the headline: 4" in text


def test_default_slo_and_capacity_need_every_lower_rate_to_pass():
    curve = [point(0.5, 0.01, 0.01, base_ttft=(0.2, 0.3), base_tpot=(0.01, 0.012)),
             point(1, 0.01, 0.01, base_ttft=(0.2, 0.9), base_tpot=(0.01, 0.019), mfs_ttft90=0.5),
             point(2, 0.02, 0.01, base_ttft=(0.2, 1.2), base_tpot=(0.01, 0.02), mfs_ttft90=0.9),   # baseline fails ttft
             point(4, 0.05, 0.02, base_ttft=(0.2, 0.5), base_tpot=(0.01, 0.01), mfs_tpot90=0.05)]  # baseline passes again
    slo = default_slo(curve)
    assert slo.ttft_p90_s == pytest.approx(1.0) and slo.tpot_p90_s == pytest.approx(0.02)
    assert "5x" in slo.rule and "2x" in slo.rule
    # baseline: 0.5 and 1 pass, 2 fails (1.2 s > 1.0 s), so the pass at 4 does not count; its p90 TTFT crosses
    # 1.0 s a third of the way (in log rate) from 1 (0.9 s) to 2 (1.2 s). mfs: its p90 TPOT crosses 0.02 s a
    # quarter of the way from 2 (0.01 s) to 4 (0.05 s).
    capacity = capacity_at_slo(curve, slo)
    assert capacity == {"mfs": pytest.approx(2 ** 1.25), "baseline": pytest.approx(2 ** (1 / 3))}
    assert capacity_at_slo(curve, SLO(0.01, 0.001, "tight")) == {"mfs": 0.0, "baseline": 0.0}   # fails: zero
    summary = summarize_curve(curve, slo)
    assert summary["knee_rate"] == pytest.approx(2) and summary["reduction_at_knee"] == pytest.approx(0.5)
    assert summary["capacity_at_slo_is_lower_bound"] == [] and summary["slo"]["ttft_p90_s"] == pytest.approx(1.0)
    assert summary["capacity_ratio"] == pytest.approx(2 ** 1.25 / 2 ** (1 / 3))
    loose = summarize_curve(curve, SLO(10, 10, "loose"))
    assert loose["capacity_at_slo"] == {"mfs": 4, "baseline": 4}
    assert loose["capacity_at_slo_is_lower_bound"] == ["baseline", "mfs"]   # the highest rate passed: >= 4
    assert loose["capacity_ratio"] is None                                  # a lower bound over a lower bound
    text = format_curve({"curve": curve, **summary})
    assert "knee" in text and "2 sessions/s" in text and "mfs 2.38/s" in text and "baseline 1.26/s" in text
    assert "mfs / baseline 1.89x" in text


def test_a_baseline_failing_its_relative_slo_at_its_lightest_rate_gives_no_capacity_ratio():
    curve = [point(0.5, 0.01, 0.01, base_ttft=(0.1, 0.6)), point(1, 0.02, 0.01, base_ttft=(0.1, 0.7))]
    summary = summarize_curve(curve, default_slo(curve))          # limit 5 x 0.1 s; the baseline's p90 is 0.6 s
    assert summary["capacity_at_slo"]["baseline"] == 0.0 and summary["capacity_ratio"] is None
    assert "no capacity ratio" in format_curve({"curve": curve, **summary})


def test_a_system_failing_its_slo_at_the_lightest_rate_has_zero_capacity_and_the_seed_counts_against_it():
    """The dropped-seed rule: MFS failing the SLO at every rate of one seed gives that seed a capacity ratio of 0,
    which the interval over seeds keeps (a dropped seed would have flattered MFS)."""
    from eval.bench.intervals import intervals_over

    passing = [point(0.5, 0.01, 0.01, base_ttft=(0.1, 0.2)), point(1, 0.02, 0.01, base_ttft=(0.1, 0.9))]
    failing = [point(0.5, 0.01, 0.01, base_ttft=(0.1, 0.2), mfs_ttft90=5.0),
               point(1, 0.02, 0.01, base_ttft=(0.1, 0.9), mfs_ttft90=5.0)]
    summary = summarize_curve(failing, default_slo(failing))
    assert summary["capacity_at_slo"]["mfs"] == 0.0 and summary["capacity_ratio"] == 0.0
    assert "mfs 0 (fails at the lightest rate)" in format_curve({"curve": failing, **summary})
    settings = {"slo_ttft_x": 5.0, "slo_tpot_x": 2.0}
    runs = [{"curve": c, "settings": settings} for c in (passing, passing, failing)]
    found = intervals_over(runs)
    ratio = found["capacity_ratio"]
    assert ratio["n"] == 3 and found["capacity_ratio_missing"] == 0
    kept = summarize_curve(passing, default_slo(passing))["capacity_ratio"]
    assert ratio["mean"] == pytest.approx(2 * kept / 3)        # the failing seed counts as 0, not dropped


def test_parse_rates():
    assert parse_rates("1, 0.25,0.5") == (0.25, 0.5, 1.0)
    for bad in ("", "1,x", "0,1", "1,1"):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_mfs_against_another_baseline_is_read_at_the_reference_baselines_knee():
    from eval.bench.curve import mfs_against_at

    curve = [point(0.5, 0.010, 0.009), point(1, 0.012, 0.010), point(2, 0.016, 0.012), point(4, 0.032, 0.016)]
    for p, elastic in zip(curve, (0.010, 0.011, 0.014, 0.022)):
        p["systems"]["baseline_elastic"] = {"mean_token_latency_s": elastic}
    knee = knee_rate(curve)                                  # 2 ** 1.25: a quarter of the way from 2 to 4
    assert mfs_against_at(curve, knee) == {"baseline_elastic": pytest.approx(1 - 0.013 / 0.016)}
    assert summarize_curve(curve, None)["mfs_against_at_knee"]["baseline_elastic"] == pytest.approx(1 - 0.013 / 0.016)
    assert mfs_against_at(curve, None) == {}


def test_attribution_is_the_points_of_reduction_each_ablation_loses():
    from eval.bench.curve import attribution

    assert attribution({"mfs": 0.40, "no_shared_pool": 0.25, "no_tiers": 0.38, "baseline_elastic": 0.1}) == {
        "no_shared_pool": pytest.approx(0.15), "no_tiers": pytest.approx(0.02)}
    assert attribution({"mfs": None, "no_tiers": 0.3}) == {"no_tiers": None}


def test_attribution_flag_adds_the_ablations():
    import argparse

    from eval.bench.cli import add_arguments, settings_from_args
    from eval.systems import ATTRIBUTION_SYSTEMS, system_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = settings_from_args(parser.parse_args(["--attribution"]))
    assert settings.systems == ("mfs", "baseline", *ATTRIBUTION_SYSTEMS)
    routing = system_config("no_family_routing", "tiny", 256, None).comparison
    assert not routing.use_affinity and not routing.use_load
    handover = system_config("no_warm_handover", "tiny", 256, None).comparison
    assert handover.cold_handover and not handover.warmup
