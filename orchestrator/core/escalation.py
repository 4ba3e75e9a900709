"""Mid-request escalation policy: a rolling confidence monitor, the handover target, the warm-up band."""
from __future__ import annotations

import math
from collections import deque
from typing import Sequence

from orchestrator.core.config import EscalationConfig
from orchestrator.core.family import FamilySpec

ON_ESCALATE_ROLLBACK = "rollback"


class ConfidenceMonitor:
    """Watches one request's per-token confidence on its current member and says when to escalate.

    Each observe() appends one value to a window of the last config.window_tokens values:
      'top1_prob': the sampled position's top-1 probability; escalate when the window mean < threshold.
      'entropy':   entropy in nats of the top-k alternatives renormalised to sum to 1
                   (q_i = p_i / sum_j p_j, H = -sum q_i ln q_i, range [0, ln k]); the tail outside the
                   top-k is ignored, so this underestimates the full entropy. With fewer than 2
                   alternatives it falls back to the binary entropy of top1_prob versus the rest.
                   Escalate when the window mean > threshold.
    Nothing escalates before config.min_tokens values were observed since the last reset(); after that
    the mean covers the (up to) window_tokens most recent values. A disabled config never escalates.
    """

    __slots__ = ("config", "_window", "_observed", "_use_entropy")

    def __init__(self, config: EscalationConfig) -> None:
        self.config = config                    # checked by MFSConfig.validate (signal, window_tokens)
        self._use_entropy = config.signal == "entropy"
        self._window: deque[float] = deque(maxlen=config.window_tokens)
        self._observed = 0

    def observe(self, top1_prob: float, top_logprobs: Sequence[tuple[int, float]] = ()) -> bool:
        """Records one generated token; True when the request should escalate now."""
        value = top_logprobs_entropy(top1_prob, top_logprobs) if self._use_entropy else top1_prob
        self._window.append(value)
        self._observed += 1
        config = self.config
        if not config.enabled or self._observed < config.min_tokens:
            return False
        mean = sum(self._window) / len(self._window)   # window is tiny (default 8): a plain sum is exact and cheap
        return mean > config.threshold if self._use_entropy else mean < config.threshold

    def reset(self) -> None:
        """After a handover the new member starts with an empty window and a fresh min_tokens count."""
        self._window.clear()
        self._observed = 0

    def rollback_tokens(self) -> int:
        """Trailing generated tokens to discard when escalating (the low-confidence window), 0 for 'keep'."""
        if self.config.on_escalate != ON_ESCALATE_ROLLBACK:
            return 0
        return min(self.config.window_tokens, self._observed)


def top_logprobs_entropy(top1_prob: float, top_logprobs: Sequence[tuple[int, float]]) -> float:
    """Entropy (nats) of the renormalised top-k distribution; see ConfidenceMonitor for the definition."""
    if len(top_logprobs) < 2:
        return _binary_entropy(top1_prob)
    probs = [math.exp(logprob) for _, logprob in top_logprobs]
    mass = sum(probs)
    if mass <= 0.0:
        return _binary_entropy(top1_prob)
    entropy = 0.0
    for p in probs:
        q = p / mass
        if q > 0.0:
            entropy -= q * math.log(q)
    return entropy


def _binary_entropy(p: float) -> float:
    p = min(1.0, max(0.0, p))
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log(p) + (1.0 - p) * math.log(1.0 - p))


def escalation_target(family: FamilySpec, current: str, pinned: bool) -> str | None:
    """The next larger member; None when pinned or already the largest (so escalation can never loop)."""
    larger = family.member(current).index + 1
    return family.members[larger].name if not pinned and larger < len(family.members) else None


def handover_target(family: FamilySpec, current: str, pinned: bool, num_tokens: int) -> str | None:
    """Where a low-confidence request of num_tokens (prompt + generated) moves now: the next larger member,
    or None when pinned, already the largest, or the target's context cannot hold what it has so far."""
    target = escalation_target(family, current, pinned)
    if target is None or num_tokens >= family.member(target).context_tokens:
        return None
    return target


def can_escalate(config: EscalationConfig, family: FamilySpec, current: str, pinned: bool) -> bool:
    """Whether a request on `current` gets a confidence monitor at all."""
    return config.enabled and escalation_target(family, current, pinned) is not None


def in_warmup_band(config: EscalationConfig, complexity: float) -> bool:
    """True when a request's complexity sits in [low, high) of warmup_band, just below a boundary (at `high` it is
    routed to the larger member already): worth prefilling the next member. False when escalation is disabled."""
    if not config.enabled:
        return False
    low, high = config.warmup_band
    return low <= complexity < high


class EscalationRates:
    """Per member, the recent share of requests that left it by escalation (1) rather than finishing there
    (0): the router's estimate of how likely a request downgraded into that member is to escalate back out
    (two prefills and a second wait instead of one). A running mean over the first `window` outcomes, then
    an exponential average with weight 1/window, so it follows the traffic without a clock."""

    __slots__ = ("window", "_rate", "_count")

    def __init__(self, window: int = 32) -> None:
        self.window = window
        self._rate: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def record(self, member: str, escalated: bool) -> None:
        count = self._count.get(member, 0) + 1
        self._count[member] = count
        rate = self._rate.get(member, 0.0)
        self._rate[member] = rate + (float(escalated) - rate) / min(count, self.window)

    def rate(self, member: str) -> float:
        """0 until the member has an outcome (nothing known: a downgrade there is not held back)."""
        return self._rate.get(member, 0.0)
