"""Load-curve arithmetic (eval/bench/curve.py): the knee, the reduction there, the SLO and the capacity at it."""
from __future__ import annotations

import pytest

from eval.bench.curve import SLO, capacity_at_slo, default_slo, format_curve, knee_rate, parse_rates, reductions_at, summarize_curve


def point(rate, base, mfs, base_ttft=(0.1, 0.1), base_tpot=(0.01, 0.01), mfs_ttft90=0.1, mfs_tpot90=0.01):
    return {"rate": rate, "systems": {
        "mfs": {"mean_token_latency_s": mfs, "ttft_p90_s": mfs_ttft90, "tpot_p90_s": mfs_tpot90},
        "baseline": {"mean_token_latency_s": base, "ttft_p50_s": base_ttft[0], "ttft_p90_s": base_ttft[1],
                     "tpot_p50_s": base_tpot[0], "tpot_p90_s": base_tpot[1]}}}


def test_knee_is_the_lowest_rate_at_twice_the_lightest_baseline_latency():
    curve = [point(0.5, 0.010, 0.009), point(1, 0.015, 0.010), point(2, 0.020, 0.011), point(4, 0.050, 0.02)]
    assert knee_rate(curve) == 2                     # 0.020 >= 2 x 0.010 (equality counts)
    assert reductions_at(curve, 2) == {"mfs": pytest.approx(1 - 0.011 / 0.020)}
    assert knee_rate(curve[:2]) is None and reductions_at(curve, None) == {}
    assert knee_rate([]) is None


def test_default_slo_and_capacity_need_every_lower_rate_to_pass():
    curve = [point(0.5, 0.01, 0.01, base_ttft=(0.2, 0.3), base_tpot=(0.01, 0.012)),
             point(1, 0.01, 0.01, base_ttft=(0.2, 0.9), base_tpot=(0.01, 0.019), mfs_ttft90=0.5),
             point(2, 0.02, 0.01, base_ttft=(0.2, 1.2), base_tpot=(0.01, 0.02), mfs_ttft90=0.9),   # baseline fails ttft
             point(4, 0.05, 0.02, base_ttft=(0.2, 0.5), base_tpot=(0.01, 0.01), mfs_tpot90=0.05)]  # baseline passes again
    slo = default_slo(curve)
    assert slo.ttft_p90_s == pytest.approx(1.0) and slo.tpot_p90_s == pytest.approx(0.02)
    assert "5x" in slo.rule and "2x" in slo.rule
    # baseline: 0.5 and 1 pass, 2 fails (1.2 s > 1.0 s): the pass at 4 does not count; mfs fails tpot at 4
    assert capacity_at_slo(curve, slo) == {"mfs": 2, "baseline": 1}
    assert capacity_at_slo(curve, SLO(0.01, 0.001, "tight")) == {"mfs": None, "baseline": None}
    summary = summarize_curve(curve, slo)
    assert summary["knee_rate"] == 2 and summary["reduction_at_knee"] == pytest.approx(0.5)
    assert summary["capacity_at_slo_is_lower_bound"] == [] and summary["slo"]["ttft_p90_s"] == pytest.approx(1.0)
    loose = summarize_curve(curve, SLO(10, 10, "loose"))
    assert loose["capacity_at_slo"] == {"mfs": 4, "baseline": 4}
    assert loose["capacity_at_slo_is_lower_bound"] == ["baseline", "mfs"]   # the highest rate passed: >= 4
    text = format_curve({"curve": curve, **summary})
    assert "knee" in text and "2 sessions/s" in text and "mfs 2/s" in text and "baseline 1/s" in text


def test_parse_rates():
    assert parse_rates("1, 0.25,0.5") == (0.25, 0.5, 1.0)
    for bad in ("", "1,x", "0,1", "1,1"):
        with pytest.raises(ValueError):
            parse_rates(bad)
