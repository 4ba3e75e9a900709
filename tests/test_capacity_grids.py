"""eval/bench/capacity.py: capacities read from several rate grids of the same runs."""
from __future__ import annotations

import json

import pytest

from eval.bench.capacity import GridMismatch, main, summary
from eval.bench.curve import SLO

SLO_ABS = SLO(ttft_p90_s=0.3, tpot_p90_s=0.1, rule="absolute")


def _metrics(ttft_s: float, tpot_s: float = 0.05) -> dict:
    return {"mean_token_latency_s": ttft_s / 10, "ttft_p90_s": ttft_s, "tpot_p90_s": tpot_s}


def _result(seed: int, points: dict[float, dict[str, float]]) -> dict:
    """points: rate -> system -> p90 TTFT."""
    return {"settings": {"seed": seed},
            "curve": [{"rate": rate, "systems": {name: _metrics(ttft) for name, ttft in systems.items()}}
                      for rate, systems in sorted(points.items())]}


COARSE = {16.0: {"mfs": 0.1, "baseline": 0.1}, 32.0: {"mfs": 0.2, "baseline": 5.0},
          64.0: {"mfs": 0.25, "baseline": 9.0}, 128.0: {"mfs": 0.4, "baseline": 9.5}}
FINE_BASELINE = {16.0: {"baseline": 0.1}, 20.0: {"baseline": 0.2}, 24.0: {"baseline": 2.0}, 32.0: {"baseline": 5.0}}


def test_a_finer_grid_narrows_the_crossing_and_the_ratio_uses_every_point():
    coarse = summary([_result(0, COARSE)], SLO_ABS)["by_seed"][0]
    both = summary([_result(0, COARSE), _result(0, FINE_BASELINE)], SLO_ABS)
    fine = both["by_seed"][0]
    assert 16.0 < coarse["baseline"]["capacity"] < 20.0      # log-interpolated between 0.1 s and 5 s
    assert 20.0 < fine["baseline"]["capacity"] < 24.0        # between 0.2 s and 2 s: the finer grid moved it
    assert fine["baseline"]["rates"] == [16.0, 20.0, 24.0, 32.0, 64.0, 128.0]
    assert fine["mfs"]["capacity"] == coarse["mfs"]["capacity"]     # its points did not change
    assert both["ratio_by_seed"][0] == pytest.approx(fine["mfs"]["capacity"] / fine["baseline"]["capacity"])


def test_files_that_disagree_at_a_shared_rate_are_refused():
    other = {32.0: {"baseline": 4.0}}          # the coarse grid says 5.0 s there
    with pytest.raises(GridMismatch, match="seed 0, baseline at 32 sessions/s"):
        summary([_result(0, COARSE), _result(0, other)], SLO_ABS)


def test_seeds_stay_apart_and_lower_bounds_are_flagged():
    always = {rate: {"mfs": 0.1, "baseline": ttft} for rate, ttft in ((16.0, 0.1), (32.0, 5.0), (64.0, 9.0))}
    found = summary([_result(0, COARSE), _result(1, always)], SLO_ABS)
    assert found["by_seed"][1]["mfs"] == {"capacity": 64.0, "lower_bound": True, "rates": [16.0, 32.0, 64.0]}
    assert found["ratio_is_lower_bound"] and found["ratio"]["n"] == 2


def test_the_command_prints_each_seed_and_skips_the_means_file(tmp_path, capsys):
    paths = []
    for name, result in (("s0.json", _result(0, COARSE)), ("fine_s0.json", _result(0, FINE_BASELINE)),
                         ("means.json", {"intervals": {}})):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(result))
    assert main(["--slo-ttft-s", "0.3", "--slo-tpot-s", "0.1", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("seed 0: mfs ") and "mfs / baseline" in out and "one seed: no interval" in out
    assert main(["--slo-ttft-s", "0.3", "--slo-tpot-s", "0.1", str(paths[2])]) == 2
