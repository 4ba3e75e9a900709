"""A stated, parametric model of escalation for simulated families whose members' confidences were never
recorded (every paper-scale family): `--escalation-model parametric:P1,P2,...@MEAN`.

A request decoding on member i trips the confidence monitor with probability P_i (one probability per member
but the largest, which has nowhere to go). If it trips, the reply position where it does is min_tokens + an
exponential draw of mean MEAN tokens: the top-1 probability there and after is LOW (the monitor's window fills
with it), before it HIGH. Both draws come from a hash of (seed, request, member), so every system sees the same
request trip at the same position on the same member, and a request handed to a larger member draws again
there. Drives the default `top1_prob` signal (LOW < threshold < HIGH). Sweep P (and MEAN) to see how much a
figure depends on them.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PREFIX = "parametric:"
HIGH, LOW = 0.9, 0.01
DEFAULT_PROBABILITY = 0.15        # per member but the largest, unless stated
DEFAULT_MEAN_TOKENS = 24.0


class EscalationModelError(ValueError):
    """An --escalation-model that cannot be used with this family."""


@dataclass(slots=True)
class ParametricConfidences:
    probabilities: dict[str, float]          # member -> probability that a request decoding there trips
    mean_trip_tokens: float
    min_tokens: int = 8                      # escalation.min_tokens: the monitor's earliest position
    seed: int = 0
    _trips: dict[tuple[str, str], int | None] = field(default_factory=dict)

    def value(self, key: str, member: str, position: int) -> float:
        """The top-1 probability of token `position` of request `key`'s reply on `member`."""
        pair = (key, member)
        if pair not in self._trips:          # drawn once per request and member: value() runs for every token
            self._trips[pair] = self._trip(key, member)
        trip = self._trips[pair]
        return HIGH if trip is None or position < trip else LOW

    def _trip(self, key: str, member: str) -> int | None:
        p = self.probabilities.get(member, 0.0)
        if p <= 0.0 or _uniform(self.seed, key, member, "trips") >= p:
            return None
        u = _uniform(self.seed, key, member, "where")
        return self.min_tokens + int(-math.log(1.0 - u) * self.mean_trip_tokens)

    def map_members(self, simulated: Sequence[str], recorded_order: Sequence[str]) -> dict[str, str]:
        return {}                            # nothing borrowed from another family

    def describe(self) -> dict[str, Any]:
        return {"model": "parametric", "probability_by_member": dict(self.probabilities),
                "mean_trip_tokens": self.mean_trip_tokens, "min_tokens": self.min_tokens,
                "assumption": ("a request decoding on a member trips the confidence monitor with that member's "
                               "probability, at min_tokens + an exponential number of tokens of the stated mean "
                               "into its reply; drawn per (seed, request, member), the same in every system. No "
                               "confidences of the simulated family were measured: sweep these parameters.")}


def _uniform(seed: int, key: str, member: str, what: str) -> float:
    # a cryptographic hash: crc32's linearity would correlate the draws of one request (whether, then where)
    digest = hashlib.blake2b(f"{seed}|{key}|{member}|{what}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def default_model_text(member_names: Sequence[str]) -> str:
    return PREFIX + ",".join(f"{DEFAULT_PROBABILITY:g}" for _ in member_names[:-1]) + f"@{DEFAULT_MEAN_TOKENS:g}"


def parse_model(text: str, member_names: Sequence[str], min_tokens: int, seed: int) -> ParametricConfidences:
    """'parametric:0.2,0.1@32' for members small to large (one probability per member but the largest)."""
    if not text.startswith(PREFIX):
        raise EscalationModelError(f"--escalation-model {text!r}: expected {PREFIX}P1,...@MEAN or 'recorded'")
    body = text[len(PREFIX):]
    probabilities_text, _, mean_text = body.partition("@")
    try:
        probabilities = [float(x) for x in probabilities_text.split(",") if x.strip()]
        mean = float(mean_text) if mean_text else DEFAULT_MEAN_TOKENS
    except ValueError:
        raise EscalationModelError(f"--escalation-model {text!r}: probabilities and the mean must be numbers") from None
    if len(probabilities) != len(member_names) - 1:
        raise EscalationModelError(f"--escalation-model {text!r}: give {len(member_names) - 1} probabilities, one per "
                                   f"member but the largest ({', '.join(member_names[:-1])})")
    if any(not 0.0 <= p <= 1.0 for p in probabilities) or not mean > 0:
        raise EscalationModelError(f"--escalation-model {text!r}: probabilities in [0, 1] and a positive mean")
    return ParametricConfidences(dict(zip(member_names, probabilities)), mean, min_tokens, seed)
