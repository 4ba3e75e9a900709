"""Where a simulated run's device time went, per kind of step: the steps that ran the same set of members, with
what each spent on its forwards, the prompt prefill inside them, the drafts before them, and what the decoding
requests in them got. Read in the result's `simulation.step_profile` (replay.py); eval.simulate.speculation_floor
sets it against what speculation can give at best at the run's own batch and context. (A real replay's steps are
timed by eval/validate/step_profile.py; here the durations are the cost model's, so they split by cause.)

Per kind, sums over the run's steps (every node's, every device's):
  steps, step_s           the steps and their durations (overhead, history terms and tier copies included)
  forward_s               the member batches' forwards (drafts not included)
  prompt_s                the share of those forwards their prefill chunks cost: each batch priced again without
                          them (what prompt processing adds to a decoding request's wait)
  draft_s                 the draft forwards before the member batches
  requests                decoding requests in the step's batches (decodes and verifies; a prefill chunk is not one,
                          but a prompt's one-token remainder after a cached prefix is, as the cost model prices it)
  request_step_s          step_s summed once per decoding request in the step: the device time the decoding
                          requests waited, per request (over tokens, each decoded token's wait)
  request_prompt_s        the same for prompt_s (what prompt prefill added to those waits)
  decode_tokens           tokens the decodes and verifies gave
  context_tokens          tokens those requests attended, summed over them
  requests_squared        sum over steps of requests^2: the batch a decoding request sees (requests_squared /
                          requests), the batch speculation's floor is read at
  verify_rows, prompt_tokens
Pure bookkeeping: the durations are the cost model's, passed in by the executor.
"""
from __future__ import annotations

from typing import Any

FIELDS = ("steps", "step_s", "forward_s", "prompt_s", "draft_s", "requests", "request_step_s", "request_prompt_s",
          "decode_tokens", "context_tokens", "requests_squared", "verify_rows", "prompt_tokens")


class StepProfile:
    """Per kind of step (its members, '+'-joined in the family's order as they appear), the FIELDS' sums."""

    __slots__ = ("kinds",)

    def __init__(self) -> None:
        self.kinds: dict[str, list[float]] = {}

    def add(self, kind: str, step_s: float, forward_s: float, prompt_s: float, draft_s: float, requests: int,
            decode_tokens: int, context_tokens: int, verify_rows: int, prompt_tokens: int) -> None:
        entry = self.kinds.get(kind)
        if entry is None:
            entry = self.kinds[kind] = [0.0] * len(FIELDS)
        entry[0] += 1
        entry[1] += step_s
        entry[2] += forward_s
        entry[3] += prompt_s
        entry[4] += draft_s
        entry[5] += requests
        entry[6] += step_s * requests
        entry[7] += prompt_s * requests
        entry[8] += decode_tokens
        entry[9] += context_tokens
        entry[10] += requests * requests
        entry[11] += verify_rows
        entry[12] += prompt_tokens

    def merge(self, other: StepProfile) -> None:
        for kind, values in other.kinds.items():
            entry = self.kinds.get(kind)
            if entry is None:
                self.kinds[kind] = list(values)
            else:
                for i, value in enumerate(values):
                    entry[i] += value

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per kind: the sums, and what they say per step and per decoded token (see summarize)."""
        return {kind: summarize(dict(zip(FIELDS, values))) for kind, values in sorted(self.kinds.items())}


def summarize(sums: dict[str, float]) -> dict[str, Any]:
    """The sums of one kind of step, with:
      mean_step_ms, and its parts forward_ms (prompt_ms of it), draft_ms, other_ms (overhead, copies, history)
      batch                   the batch a decoding request sees (requests_squared / requests)
      mean_context            tokens a decoding request attends
      tokens_per_request_step decode_tokens / requests (above 1: speculation's accepted drafts)
      token_period_ms         the device time a decoding request waited per token it got: request_step_s over
                              decode_tokens (what its time per output token would be with no pause between steps)
      token_period_without_prompts_ms  the same less what prompt prefill added"""
    steps = sums["steps"]
    requests = sums["requests"]
    tokens = sums["decode_tokens"]
    out: dict[str, Any] = {k: (int(v) if k not in ("step_s", "forward_s", "prompt_s", "draft_s", "request_step_s",
                                                   "request_prompt_s") else round(v, 6)) for k, v in sums.items()}
    if steps:
        out["mean_step_ms"] = round(sums["step_s"] / steps * 1e3, 4)
        out["forward_ms"] = round(sums["forward_s"] / steps * 1e3, 4)
        out["prompt_ms"] = round(sums["prompt_s"] / steps * 1e3, 4)
        out["draft_ms"] = round(sums["draft_s"] / steps * 1e3, 4)
        out["other_ms"] = round((sums["step_s"] - sums["forward_s"] - sums["draft_s"]) / steps * 1e3, 4)
    if requests:
        out["batch"] = round(sums["requests_squared"] / requests, 2)
        out["mean_context"] = round(sums["context_tokens"] / requests, 1)
        out["tokens_per_request_step"] = round(tokens / requests, 4)
    if tokens:
        out["token_period_ms"] = round(sums["request_step_s"] / tokens * 1e3, 4)
        out["token_period_without_prompts_ms"] = round(
            (sums["request_step_s"] - sums["request_prompt_s"]) / tokens * 1e3, 4)
    return out
