"""eval.validate.step_profile: the step summary (pure) and one real replay through the wrapped executor."""
import json

import pytest

from eval.bench.step_timing import StepTiming
from eval.validate.step_profile import main, summarize_steps


def test_summary_splits_decode_from_prefill_and_groups_by_members():
    timings = [StepTiming(0.004, {"tiny-l": 2}, 2, 10.0), StepTiming(0.002, {"tiny-l": 1}, 1, 10.005),
               StepTiming(0.001, {"tiny-s": 1}, 1, 10.010), StepTiming(0.050, {"tiny-l": 1, "tiny-s": 1}, 300, 11.0)]
    s = summarize_steps(timings, duration_s=1.0)
    assert s["steps"] == 4 and s["decode_steps"] == 3 and s["prefill_steps"] == 1
    assert s["busy_s"] == pytest.approx(0.057)
    # gaps of 1 ms and 3 ms between back-to-back steps; the 0.989 s idle gap before the last is not one
    assert s["back_to_back_steps"] == 2 and s["between_steps_mean_ms"] == pytest.approx(2.0)
    assert s["decode_mean_seqs"] == pytest.approx(4 / 3)
    assert s["prefill_mean_ms"] == pytest.approx(50.0)
    assert list(s["decode_by_members"]) == ["tiny-l", "tiny-s"]          # most frequent first
    assert s["decode_by_members"]["tiny-l"] == {"steps": 2, "mean_ms": pytest.approx(3.0), "mean_seqs": 1.5}


def test_profile_of_a_real_replay(tmp_path, capsys):
    from tests.test_workloads import family_dir

    out = tmp_path / "p.json"
    assert main(["--quick", "--sessions", "2", "--systems", "mfs", "--family", str(family_dir()), "--out", str(out)]) == 0
    p = json.loads(out.read_text())["systems"]["mfs"]
    assert p["steps"] > 0 and p["decode_steps"] > 0 and p["prefill_steps"] > 0
    assert 0 < p["busy_s"] <= p["duration_s"]
    assert sum(g["steps"] for g in p["decode_by_members"].values()) == p["decode_steps"]
    assert "engine busy" in capsys.readouterr().out
