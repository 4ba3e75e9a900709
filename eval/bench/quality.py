"""Response quality for `mfs bench`: the mean per-token log-likelihood of each response under the family's
largest member (higher is better), scored once per distinct (prompt, response)."""
from __future__ import annotations

from typing import Any

from eval.bench.metrics import RequestRecord, mean
from orchestrator.core.family import FamilySpec


_JUDGES: dict[tuple, Any] = {}   # the judge model is loaded once per process (a curve scores every rate)


def _judge_model(judge, dtype: str):
    from engines.local.checkpoint import load_checkpoint
    from engines.local.model import PagedCausalLM

    key = (str(judge.checkpoint_dir), dtype)
    if key not in _JUDGES:
        _JUDGES.clear()
        _JUDGES[key] = PagedCausalLM(judge, load_checkpoint(judge.checkpoint_dir, dtype=dtype), dtype=dtype)
    return _JUDGES[key]


def score_quality(family: FamilySpec, records_by_system: dict[str, list[RequestRecord]], dtype: str) -> dict[str, float | None]:
    """Mean per-token log-likelihood of each response under the largest member (higher is better)."""
    from engines.local.scoring import score_tokens

    judge = family.members[-1]
    model = _judge_model(judge, dtype)
    cache: dict[tuple, float] = {}   # systems often produce identical responses: score each once
    out: dict[str, float | None] = {}
    for name, records in records_by_system.items():
        per_request = []
        for r in records:
            if not r.ok:
                continue
            key = (tuple(r.prompt_token_ids), tuple(r.output_token_ids))
            if key not in cache:
                logprobs = score_tokens(model, judge.name, [*r.prompt_token_ids, *r.output_token_ids],
                                        start=len(r.prompt_token_ids))
                cache[key] = sum(logprobs) / len(logprobs)
            per_request.append(cache[key])
        out[name] = mean(per_request)
    return out


def add_quality(settings, family, records_by_system, systems, notes, dtype: str) -> None:
    """Sets every system's quality_mean_logprob (None when skipped or unavailable, said in notes)."""
    for metrics in systems.values():
        metrics["quality_mean_logprob"] = None
    if not settings.score_quality:
        notes.append("quality scoring skipped (--no-quality)")
        return
    try:
        quality = score_quality(family, records_by_system, dtype)
    except ImportError as exc:
        notes.append(f"quality_mean_logprob skipped: engines.local.scoring unavailable ({exc})")
        return
    for name, value in quality.items():
        systems[name]["quality_mean_logprob"] = value
    notes.append(f"quality_mean_logprob: mean per-token log-likelihood of each response under {family.members[-1].name}")
