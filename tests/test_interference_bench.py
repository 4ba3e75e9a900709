"""The interference benchmark (eval/bench/interference.py) end to end at its smallest: one round of one short victim
stream against a real `mfs serve`, with small disturbers, and the U+FFFD linearity mode on two short lengths. Checks
the result's shape and that the disturbers were answered; no timing is judged."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from eval.bench.interference import CONDITIONS, round_order

ROOT = Path(__file__).resolve().parents[1]


def _run(out: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "eval.bench.interference", "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())


def test_round_order_alternates_the_disturbed_conditions():
    assert round_order(0) == ["quiet", "big_prompts", "quiet", "scrape"]
    assert round_order(1) == ["quiet", "scrape", "quiet", "big_prompts"]


def test_interference_smallest_run(tmp_path):
    result = _run(tmp_path / "interference.json", "--rounds", "1", "--streams", "1", "--tokens", "8",
                  "--prompt-bytes", "20000", "--scrape-hz", "5")
    assert result["mode"] == "interference"
    assert result["command"].startswith("python -m eval.bench.interference")
    assert result["machine"]["cpu_count"] and result["server"]["argv"]
    [runs] = result["rounds"]
    assert [run["condition"] for run in runs] == round_order(0)
    for run in runs:
        assert run["victim_tokens"] == [8]
        assert run["mean_s_per_token"] > 0 and run["max_gap_s"] >= 0
        answers = run["disturber_answers"]
        if run["condition"] == "quiet":
            assert answers == {}
        else:
            assert run["paired_quiet_s_per_token"] > 0
            assert sum(answers.values()) >= 1
    statuses = {run["condition"]: run["disturber_answers"] for run in runs}
    assert all(400 <= int(code) < 500 for code in statuses["big_prompts"])    # a prompt too long is refused
    assert set(statuses["scrape"]) == {"200"}
    summary = result["summary"]
    assert set(summary) == set(CONDITIONS)
    for condition in CONDITIONS:
        assert summary[condition]["median_ms_per_token"] > 0
    for condition in ("big_prompts", "scrape"):
        assert len(summary[condition]["paired_effects"]) == 1
        assert set(summary[condition]["effect"]) == {"min", "median", "max"}


def test_u_fffd_smallest_run(tmp_path):
    result = _run(tmp_path / "fffd.json", "--u-fffd", "--rounds", "1", "--fffd-lengths", "8,16")
    fffd = result["u_fffd"]
    assert result["mode"] == "u_fffd" and len(fffd["fffd_ids"]) >= 1
    assert [entry["max_tokens"] for entry in fffd["lengths"]] == [8, 16]
    assert [entry["tokens"] for entry in fffd["lengths"]] == [[8], [16]]
    assert fffd["ratio"]["long_vs_short"] > 0
