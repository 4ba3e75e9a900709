"""Future page demand of admitted requests: what admission reserves beside them, and how long a new
request would wait for pages (the router's expected-delay estimate).

A running request will grow to prompt + max_tokens tokens. Under `ignore_eos` (or `min_tokens` up to
`max_tokens`) that length is exact, so its remaining decode pages are reserved exactly; otherwise a
share `ratio` of the remaining tokens is reserved, where the ratio decays step by step while nobody
runs short and jumps back to its initial value when one does (the retract-on-shortage scheme of
SGLang's new-token ratio). Pure: no clock, no I/O.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from orchestrator.core.config import SchedulerConfig
from orchestrator.core.sequence import Sequence
from orchestrator.core.types import SamplingParams


class NewTokenRatio:
    """The share of a request's remaining max_tokens expected to be generated when its length is open."""

    __slots__ = ("init", "minimum", "decay", "value")

    def __init__(self, config: SchedulerConfig) -> None:
        self.init = config.new_token_ratio_init
        self.minimum = config.new_token_ratio_min
        self.decay = config.new_token_ratio_decay
        self.value = self.init

    def on_step(self) -> None:
        self.value = max(self.minimum, self.value - self.decay)

    def on_shortage(self) -> None:
        """A decode ran short of pages: the estimate was too optimistic, start again from the top."""
        self.value = self.init


def is_length_fixed(seq: Sequence) -> bool:
    return _fixed(seq.request.sampling)


def _fixed(sampling: SamplingParams) -> bool:
    return sampling.ignore_eos or sampling.min_tokens >= sampling.max_tokens


def expected_rest_tokens(sampling: SamplingParams, num_generated: int, ratio: float) -> int:
    """Tokens a request is still expected to generate: all of max_tokens left when its length is fixed,
    a share `ratio` of them otherwise."""
    remaining = max(0, sampling.max_tokens - num_generated)
    return remaining if _fixed(sampling) else math.ceil(remaining * ratio)


def expected_final_tokens(seq: Sequence, ratio: float, context_tokens: int) -> int:
    """Tokens this request is expected to hold when it ends (prompt + generated so far + expected rest)."""
    if seq.is_warmup:
        return len(seq.token_ids)          # a warm-up only prefills
    return min(context_tokens, len(seq.token_ids) + expected_rest_tokens(seq.request.sampling, seq.num_generated,
                                                                        ratio))


def queue_rank(seq: Sequence, ratio: float, context_tokens: int) -> tuple[int, int]:
    """scheduler.queue_order=shortest_first's sort key over waiting requests (the smallest is admitted first).
    A request that already ran (preempted, escalated) or has waited past the aging bound keeps its place
    ahead of every fresh one; fresh requests go by their expected remaining decode tokens, the part of a
    request's time that grows with its length (shortest first minimises the mean wait; aging bounds the
    longest one's)."""
    if seq.held or seq.num_admissions or seq.num_escalations:
        return (0, 0)
    if seq.is_warmup:
        return (1, 0)                      # a warm-up only prefills
    return fresh_rank(len(seq.token_ids), expected_rest_tokens(seq.request.sampling, seq.num_generated, ratio),
                      context_tokens)


def fresh_rank(num_tokens: int, rest_tokens: int, context_tokens: int) -> tuple[int, int]:
    """queue_rank of a request that has not run: its expected decode tokens within the context. Also the rank
    the router gives a request still being routed (num_tokens = its prompt)."""
    return (1, min(context_tokens, num_tokens + rest_tokens) - num_tokens)


@dataclass(frozen=True, slots=True)
class RunningDemand:
    """One admitted request as the delay estimate sees it."""

    held_pages: int          # pages it holds now (returned when it ends)
    future_pages: int        # pages reserved for its remaining decode
    remaining_steps: int     # decode steps until it ends (expected)


def steps_until_fit(need_pages: int, available_pages: int, running: Iterable[RunningDemand]) -> int | None:
    """Decode steps until `need_pages` fit, if the running requests end in order of their remaining
    steps and nothing else arrives: 0 when they fit now, None when they never do."""
    if need_pages <= available_pages:
        return 0
    free = available_pages
    for demand in sorted(running, key=lambda d: d.remaining_steps):
        free += demand.held_pages + demand.future_pages
        if need_pages <= free:
            return demand.remaining_steps
    return None


def victim_key(order: str) -> Callable[[Sequence], tuple]:
    """Sort key over running requests: the smallest key is preempted first.

    priority_progress: warm-ups and lower priorities (larger numbers) first; a fresh request before
    an escalated one (it already paid for a handover and a user is watching it stream); then the
    least progress (fewest generated tokens), then the cheapest recompute (fewest computed tokens),
    then the youngest. youngest: the most recently admitted (the pre-issue-13 rule, the baseline's).
    """
    if order == "youngest":
        return lambda s: (-s.admit_order,)
    return lambda s: (not s.is_warmup, -s.request.priority, s.num_escalations > 0, s.num_generated,
                      s.num_computed_tokens, -s.admit_order)


@dataclass(frozen=True, slots=True)
class DecodeProfile:
    """A decoding request of fixed length, as the time-aware reservation sees it: it grows by one token
    per step (every decoding request decodes in every step) and ends after `steps_left` steps. Growth is
    computed per asked step (peak_growth reads one step per profile), not tabulated for every step."""

    steps_left: int               # steps until it ends
    tokens_now: int
    final_tokens: int
    held_pages: int
    private_pages: int            # pages only it references: available again when it ends
    pages_for: Callable[[int], int]
    slack_tokens: int             # the scheduler may grow a request's table this many tokens ahead

    def growth_at(self, t: int) -> int:
        """Pages it will have allocated beyond now at step t (0 <= t < steps_left)."""
        return max(0, self.pages_for(min(self.final_tokens, self.tokens_now + t + self.slack_tokens)) - self.held_pages)

    @property
    def growth_pages(self) -> tuple[int, ...]:
        return tuple(self.growth_at(t) for t in range(self.steps_left))


def decode_profile(steps_left: int, tokens_now: int, final_tokens: int, held_pages: int, private_pages: int,
                   pages_for: Callable[[int], int], slack_tokens: int) -> DecodeProfile:
    """slack_tokens: the scheduler may grow a request's table this many tokens ahead (preallocation)."""
    return DecodeProfile(steps_left, tokens_now, final_tokens, held_pages, private_pages, pages_for, slack_tokens)


def peak_growth(profiles: Iterable[DecodeProfile]) -> int:
    """The most pages the requests will need beyond now at any future step: the growth of those still
    running minus the private pages of those that ended. It only changes direction when one ends, so
    the maximum is just before some end (or now).

    Each candidate step costs a pass over every request (O(n^2) in all: ~10^4 growth_at calls per admission at
    GPU scale), so candidates are visited by an upper bound of their total, each running request at its last
    step's growth (growth only grows with the step), and the visit stops when no bound beats the best found:
    the same maximum as visiting them all."""
    profiles = list(profiles)
    if not profiles:
        return 0
    ends = sorted(p.steps_left for p in profiles)
    by_end = sorted(profiles, key=lambda p: p.steps_left)
    # ended_private[j]: private pages of the j requests ending first; still_growth[j]: final growth of the rest.
    ended_private, still_growth = [0], [0]
    for p in by_end:
        ended_private.append(ended_private[-1] + p.private_pages)
    for p in reversed(by_end):
        still_growth.append(still_growth[-1] + p.growth_at(p.steps_left - 1))
    still_growth.reverse()
    bounds = []
    for t in sorted({p.steps_left - 1 for p in profiles}):
        ended = bisect.bisect_right(ends, t)            # requests with steps_left <= t have ended at step t
        bounds.append((still_growth[ended] - ended_private[ended], t))
    best = 0
    for bound, t in sorted(bounds, reverse=True):
        if bound <= best:
            break
        total = 0
        for p in profiles:
            total += p.growth_at(t) if t < p.steps_left else -p.private_pages
        best = max(best, total)
    return best
