"""Escalation policy: the confidence monitor's window, reset and rollback; targets; the warm-up band."""
from __future__ import annotations

import math

import pytest

from orchestrator.core.config import ConfigError, EscalationConfig, MFSConfig
from orchestrator.core.escalation import ConfidenceMonitor, escalation_target, in_warmup_band, top_logprobs_entropy
from tests.fakes import named_nested_family


FAMILY = named_nested_family()


def test_no_escalation_before_min_tokens():
    monitor = ConfidenceMonitor(EscalationConfig(window_tokens=4, min_tokens=6, threshold=0.3))
    assert [monitor.observe(0.01) for _ in range(5)] == [False] * 5
    assert monitor.observe(0.01) is True


def test_escalates_exactly_when_window_mean_crosses_threshold():
    # Binary-exact values so "equal to the threshold" is really equal.
    monitor = ConfidenceMonitor(EscalationConfig(window_tokens=4, min_tokens=4, threshold=0.5))
    for _ in range(4):
        assert monitor.observe(0.75) is False
    assert monitor.observe(0.25) is False          # mean 0.625
    assert monitor.observe(0.25) is False          # mean 0.5: not below
    assert monitor.observe(0.25) is True           # mean 0.375


def test_old_tokens_leave_the_window():
    monitor = ConfidenceMonitor(EscalationConfig(window_tokens=2, min_tokens=1, threshold=0.5))
    assert monitor.observe(0.0) is True
    assert monitor.observe(0.9) is True    # mean 0.45
    assert monitor.observe(0.2) is False   # mean 0.55: the 0.0 has left the window (with it, 0.37)


def test_reset_starts_a_fresh_window_and_min_tokens_count():
    monitor = ConfidenceMonitor(EscalationConfig(window_tokens=3, min_tokens=3, threshold=0.5))
    for _ in range(3):
        monitor.observe(0.1)
    monitor.reset()
    assert monitor.rollback_tokens() == 0
    assert [monitor.observe(0.1) for _ in range(3)] == [False, False, True]


def test_disabled_never_escalates():
    monitor = ConfidenceMonitor(EscalationConfig(enabled=False, window_tokens=2, min_tokens=1))
    assert not any(monitor.observe(0.0) for _ in range(10))


def test_rollback_count():
    keep = ConfidenceMonitor(EscalationConfig(window_tokens=4, on_escalate="keep"))
    rollback = ConfidenceMonitor(EscalationConfig(window_tokens=4, on_escalate="rollback"))
    for monitor in (keep, rollback):
        for _ in range(10):
            monitor.observe(0.1)
    assert keep.rollback_tokens() == 0
    assert rollback.rollback_tokens() == 4


def test_rollback_never_exceeds_observed():
    monitor = ConfidenceMonitor(EscalationConfig(window_tokens=8, min_tokens=0, on_escalate="rollback"))
    monitor.observe(0.1)
    monitor.observe(0.1)
    assert monitor.rollback_tokens() == 2


def test_entropy_signal_escalates_when_mean_entropy_is_above_threshold():
    monitor = ConfidenceMonitor(EscalationConfig(signal="entropy", window_tokens=2, min_tokens=2, threshold=0.5))
    confident = ((1, math.log(0.98)), (2, math.log(0.01)), (3, math.log(0.01)))
    flat = tuple((t, math.log(0.25)) for t in range(4))      # renormalised entropy ln 4 = 1.386
    assert monitor.observe(0.98, confident) is False
    assert monitor.observe(0.98, confident) is False
    assert monitor.observe(0.25, flat) is True                # mean (0.11 + 1.386) / 2 > 0.5


def test_entropy_of_top_k_is_renormalised():
    # Two equal alternatives holding only half the mass still give ln 2 after renormalising.
    assert top_logprobs_entropy(0.25, ((1, math.log(0.25)), (2, math.log(0.25)))) == pytest.approx(math.log(2))
    # Fewer than two alternatives: binary entropy of top1 versus the rest.
    assert top_logprobs_entropy(0.5, ()) == pytest.approx(math.log(2))
    assert top_logprobs_entropy(1.0, ((1, 0.0),)) == 0.0


def test_bad_signal_is_rejected():
    with pytest.raises(ConfigError, match="escalation.signal"):
        MFSConfig(escalation=EscalationConfig(signal="vibes")).validate()


def test_escalation_target_is_next_larger_and_stops_at_largest():
    assert escalation_target(FAMILY, "tiny-s", pinned=False) == "tiny-m"
    assert escalation_target(FAMILY, "tiny-m", pinned=False) == "tiny-l"
    assert escalation_target(FAMILY, "tiny-l", pinned=False) is None


def test_escalation_target_none_when_pinned():
    assert all(escalation_target(FAMILY, name, pinned=True) is None for name in FAMILY.member_names)


def test_escalation_chain_never_loops():
    seen, current = [], "tiny-s"
    while current is not None:
        seen.append(current)
        current = escalation_target(FAMILY, current, pinned=False)
    assert seen == FAMILY.member_names


def test_warmup_band_is_half_open_and_respects_switches():
    config = EscalationConfig(warmup_band=[0.3, 0.4])
    assert [in_warmup_band(config, c) for c in (0.29, 0.3, 0.35, 0.4)] == [False, True, True, False]
    assert not in_warmup_band(EscalationConfig(enabled=False), 0.35)


def test_escalation_rates_running_mean_then_exponential_average():
    from orchestrator.core.escalation import EscalationRates
    rates = EscalationRates(window=4)
    assert rates.rate("s") == 0.0                               # nothing known yet
    for escalated in (True, False, True):
        rates.record("s", escalated)
    assert rates.rate("s") == pytest.approx(2 / 3)              # the plain mean of the first outcomes
    rates.record("s", True)
    assert rates.rate("s") == pytest.approx(0.75)
    rates.record("s", False)                                    # from the window on: weight 1/4
    assert rates.rate("s") == pytest.approx(0.75 - 0.75 / 4)
    assert rates.rate("m") == 0.0
