"""Response quality, judged from outside the reply: how likely the dataset's own reference reply is, given the
prompt each request was sent with, under the member(s) that served the request.

A request served by one member scores that member's mean per-token log-likelihood of the reference reply; an
escalated request weights each member by its share of the request's kept output tokens. A system's quality is
the mean over its answered requests that have a reference (higher is better). It measures the model each user
got, not the tokens it produced, so no member is rewarded for scoring its own output. Each member's share of
all output tokens is reported beside it.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from eval.bench.metrics import RequestRecord, mean
from orchestrator.core.family import FamilySpec

# (member, prompt, reference) -> mean per-token log-likelihood of reference after prompt under member
Scorer = Callable[[str, Sequence[int], Sequence[int]], float]
_MODELS: dict[tuple, Any] = {}   # member models loaded once per process (a curve scores every rate)


def request_weights(record: RequestRecord) -> dict[str, float]:
    """Each serving member's share of the request's kept output tokens (the finishing member when unknown)."""
    total = sum(record.tokens_by_member.values())
    if total > 0:
        return {m: n / total for m, n in record.tokens_by_member.items() if n > 0}
    return {record.member: 1.0} if record.member else {}


def member_token_share(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Each member's share of all kept output tokens of the answered requests."""
    counts: dict[str, float] = {}
    for r in records:
        if r.ok:
            for member, weight in request_weights(r).items():
                counts[member] = counts.get(member, 0.0) + weight * r.output_tokens
    total = sum(counts.values())
    return {m: n / total for m, n in sorted(counts.items())} if total else {}


def reference_quality(records: Sequence[RequestRecord], references: Mapping[tuple[str, int], Sequence[int]],
                      score: Scorer) -> float | None:
    """The mean over answered requests with a reference of the serving members' weighted reference score."""
    per_request = []
    for r in records:
        reference = references.get((r.session_id, r.turn_index))
        if not r.ok or not reference or not r.prompt_token_ids:
            continue
        per_request.append(sum(w * score(m, r.prompt_token_ids, reference) for m, w in request_weights(r).items()))
    return mean(per_request)


def trace_references(trace) -> dict[tuple[str, int], list[int]]:
    """(session id, turn index) -> the turn's reference reply tokens (turns without one are left out)."""
    return {(s.session_id, k): t.reference_token_ids for s in trace.sessions for k, t in enumerate(s.turns)
            if t.reference_token_ids}


def local_scorer(family: FamilySpec, dtype: str) -> Scorer:
    """Scores with the family's own checkpoints on the local engine; each (member, prompt, reference) once."""
    from engines.local.scoring import score_tokens

    cache: dict[tuple, float] = {}

    def score(member: str, prompt: Sequence[int], reference: Sequence[int]) -> float:
        key = (member, tuple(prompt), tuple(reference))
        if key not in cache:
            logprobs = score_tokens(_model(family.member(member), dtype), member, [*prompt, *reference],
                                    start=len(prompt))
            cache[key] = sum(logprobs) / len(logprobs)
        return cache[key]

    return score


def _model(member, dtype: str):
    from engines.local.checkpoint import load_checkpoint
    from engines.local.model import PagedCausalLM

    key = (str(member.checkpoint_dir), dtype)
    if key not in _MODELS:
        _MODELS[key] = PagedCausalLM(member, load_checkpoint(member.checkpoint_dir, dtype=dtype), dtype=dtype)
    return _MODELS[key]


def add_quality(settings, family: FamilySpec, trace, records_by_system: Mapping[str, Sequence[RequestRecord]],
                systems: dict[str, dict[str, Any]], notes: list[str], dtype: str) -> None:
    """Sets every system's member_token_share and quality_reference_logprob (None when skipped or when the
    trace holds no references, said in notes)."""
    for name, metrics in systems.items():
        metrics["member_token_share"] = member_token_share(records_by_system.get(name, ()))
        metrics["quality_reference_logprob"] = None
    if not settings.score_quality:
        notes.append("quality scoring skipped (--no-quality)")
        return
    references = trace_references(trace)
    if not references:
        notes.append("quality_reference_logprob: the trace holds no reference replies (a trace file older than "
                     "mfs-trace/3)")
        return
    try:
        score = local_scorer(family, dtype)
    except ImportError as exc:
        notes.append(f"quality_reference_logprob skipped: engines.local.scoring unavailable ({exc})")
        return
    for name, records in records_by_system.items():
        systems[name]["quality_reference_logprob"] = reference_quality(records, references, score)
    notes.append("quality_reference_logprob: mean per-token log-likelihood of the dataset's reference reply, given "
                 "the prompt sent, under the member(s) that served each request (weighted by their token shares)")
