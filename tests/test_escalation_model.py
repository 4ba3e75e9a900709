"""The parametric escalation model of the simulator (eval/simulate/escalation_model.py)."""
from __future__ import annotations

import pytest

from eval.simulate.escalation_model import (HIGH, LOW, EscalationModelError, default_model_text, parse_model)
from orchestrator.core.config import EscalationConfig
from orchestrator.core.escalation import ConfidenceMonitor

MEMBERS = ["small", "mid", "large"]


def test_trip_share_and_position_follow_the_stated_parameters():
    model = parse_model("parametric:0.3,0.1@20", MEMBERS, min_tokens=8, seed=1)
    keys = [f"s{i}-t0" for i in range(4000)]
    trips = {m: [model._trip(k, m) for k in keys] for m in MEMBERS}
    share = {m: sum(t is not None for t in trips[m]) / len(keys) for m in MEMBERS}
    assert share["small"] == pytest.approx(0.3, abs=0.03) and share["mid"] == pytest.approx(0.1, abs=0.02)
    assert share["large"] == 0.0
    positions = [t - 8 for t in trips["small"] if t is not None]
    assert min(positions) >= 0 and sum(positions) / len(positions) == pytest.approx(19.5, rel=0.15)


def test_values_are_high_before_the_trip_and_low_after_and_the_same_for_every_caller():
    model = parse_model("parametric:1,1@4", MEMBERS, min_tokens=8, seed=0)
    trip = model._trip("s0-t1", "small")
    assert trip is not None and trip >= 8
    assert [model.value("s0-t1", "small", p) for p in (0, trip - 1, trip, trip + 50)] == [HIGH, HIGH, LOW, LOW]
    other = parse_model("parametric:1,1@4", MEMBERS, min_tokens=8, seed=0)
    assert other.value("s0-t1", "small", trip) == LOW and other._trip("s0-t1", "small") == trip
    assert parse_model("parametric:1,1@4", MEMBERS, min_tokens=8, seed=5)._trip("s0-t1", "small") is not None


def test_the_monitor_fires_once_the_window_is_low():
    config = EscalationConfig()
    model = parse_model("parametric:1,0@10", MEMBERS, min_tokens=config.min_tokens, seed=2)
    monitor = ConfidenceMonitor(config)
    trip = model._trip("k", "small")
    fired = next(p for p in range(500) if monitor.observe(model.value("k", "small", p)))
    # the window mean drops below the threshold within one window of the trip position
    assert trip <= fired < trip + config.window_tokens
    assert LOW < config.threshold < HIGH


def test_default_and_bad_models():
    assert default_model_text(MEMBERS) == "parametric:0.15,0.15@24"
    assert parse_model(default_model_text(MEMBERS), MEMBERS, 8, 0).probabilities == {"small": 0.15, "mid": 0.15}
    for bad in ("parametric:0.1@5", "parametric:0.1,2@5", "parametric:0.1,0.1@0", "parametric:a,b", "random"):
        with pytest.raises(EscalationModelError):
            parse_model(bad, MEMBERS, 8, 0)
