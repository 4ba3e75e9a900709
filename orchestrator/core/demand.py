"""What running and waiting requests will still need: the new-token ratio, expected lengths, and the decode profile
whose peak admission must leave free (docs/CONFIG.md, Admission: SGLang's new-token ratio with retraction). Pure: no
clock, no I/O.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import NamedTuple

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


class RunningDemand(NamedTuple):
    """One admitted request as the delay estimate sees it (a tuple: the router's estimate builds one per
    running request after every step; a frozen dataclass's __init__ set each field through Python)."""

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


class DecodeProfile(NamedTuple):
    """A decoding request of fixed length, as the time-aware reservation sees it: it grows by one token per step
    (every decoding request decodes in every step) and ends after `steps_left` steps; at step t it has allocated
    max(0, pages_for(min(final_tokens, tokens_now + t + slack_tokens)) - held_pages) pages beyond now. A tuple, as
    RunningDemand: one is built per running request on every arrival."""

    steps_left: int               # steps until it ends
    tokens_now: int
    final_tokens: int
    held_pages: int
    private_pages: int            # pages only it references: available again when it ends
    pages_for: Callable[[int], int]
    slack_tokens: int             # the scheduler may grow a request's table this many tokens ahead (preallocation)
    tokens_per_block: int         # the block size behind pages_for: pages_for(n) changes only where n - 1 is a multiple

    def growth_steps(self) -> range:
        """The steps t in [1, steps_left) where its growth may differ from step t - 1's: where the tokens
        it covers, tokens_now + t + slack, start a new block (pages_for is a whole number of blocks of the
        capped length, and the min / max around it only flatten steps, never add one)."""
        size, covered = self.tokens_per_block, self.tokens_now + self.slack_tokens
        # the first t >= 1 with covered + t - 1 a multiple of size, then every size steps, while it covers no more
        # than final_tokens (beyond, pages_for reads final_tokens: no change)
        return range((-covered) % size + 1, min(self.steps_left, self.final_tokens - covered + 1), size)


def peak_growth(profiles: Iterable[DecodeProfile]) -> int:
    """The most pages the requests will need beyond now at any future step: the growth of those still
    running minus the private pages of those that ended. It only changes direction when one ends, so
    the maximum is just before some end (or now).

    One sweep over the steps where the total changes (O(n log n), not every candidate step over every request):
    the total at step 0, then each request's growth where it starts a block, and at its end minus the growth it
    reached and its private pages; the maximum of the running total read just before each end."""
    base, changes, candidates = 0, [], set()
    for p in profiles:
        # the growth at step t (DecodeProfile), per block start of every running request on every arrival
        pages_for, final, covered, held = p.pages_for, p.final_tokens, p.tokens_now + p.slack_tokens, p.held_pages
        last = max(0, pages_for(min(final, covered)) - held)
        base += last
        for t in p.growth_steps():
            grown = max(0, pages_for(min(final, covered + t)) - held)
            if grown != last:
                changes.append((t, grown - last))
                last = grown
        changes.append((p.steps_left, -last - p.private_pages))
        candidates.add(p.steps_left - 1)
    changes.sort()
    best, total, i, n = 0, base, 0, len(changes)
    for t in sorted(candidates):
        while i < n and changes[i][0] <= t:
            total += changes[i][1]
            i += 1
        if total > best:
            best = total
    return best
