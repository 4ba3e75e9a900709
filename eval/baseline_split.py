"""The baseline's static split for one `mfs bench` run: the operator's default (proportional to weight
bytes) run for real at the lightest rate as the pilot, then, by default, the simulated search
(eval/split_search.py) over splits, fed with the pilot's escalations and measured decode steps."""
from __future__ import annotations

from typing import Any

from eval.split_search import SplitSimulator, search_report, search_split, sim_sessions
from eval.systems import StaticSplit, pages_rule, proportional_split
from eval.workloads import Trace
from orchestrator.core.family import FamilySpec


def choose_baseline_split(settings, family: FamilySpec, trace: Trace, rates: tuple[float, ...],
                          split: StaticSplit, progress=None) -> tuple[dict[str, float], dict[str, Any]]:
    """The baseline's split and what the JSON says about it: `baseline_proportional` (the operator's default
    split by weight bytes, run for real at the lightest rate: the pilot) and, for `search`, the search
    (eval/split_search.py: every candidate split scored by a simulated replay of the trace with the pilot's
    escalations and measured step costs)."""
    from eval.bench import (CURVE_DROP, complexity_estimator, config_for, family_tokenizer, run_coroutine,
                            run_system)

    proportional = proportional_split(family)
    out: dict[str, Any] = {}
    if settings.baseline_split == "traffic":
        return split.fractions, out
    if settings.baseline_split == "proportional":     # no pilot needed: the baseline itself runs on it
        out["baseline_proportional"] = {"fractions": proportional, "rate": rates[0], "metrics": None,
                                        "rule": "each deployment's slice proportional to its member's weight bytes",
                                        "note": "the baseline ran on this split: its figures are the curve's"}
        return proportional, out
    config = config_for("baseline", settings, split, proportional)
    if progress is not None:
        progress.set_postfix_str(f"baseline_proportional @ {rates[0]:g}/s (pilot)")
    on_done = (lambda _r: progress.update(1)) if progress is not None else None
    records, metrics = run_coroutine(run_system("baseline_proportional", config, trace.at_rate(rates[0]), on_done))
    out["baseline_proportional"] = {"fractions": proportional, "rate": rates[0],
                                    "rule": "each deployment's slice proportional to its member's weight bytes",
                                    "metrics": {k: v for k, v in metrics.items() if k not in CURVE_DROP}}
    from orchestrator.core.router import Router

    estimator = complexity_estimator(family_tokenizer(family))
    router = Router(family, config.router)
    pages_for_tokens, tokens_per_block = pages_rule(family, config, settings.kv_pages)
    simulator = SplitSimulator(family.member_names, pages_for_tokens, settings.kv_pages,
                               metrics["solo_decode_step_s"], {m: tokens_per_block(m) for m in family.member_names},
                               max_running=config.scheduler.max_running_requests,
                               max_batch_tokens=config.scheduler.max_batch_tokens,
                               prefill_chunk_tokens=config.scheduler.prefill_chunk_tokens,
                               reserve_blocks=config.pool.decode_reserve_blocks)
    route = lambda ids: router.adequate_member(estimator.score(ids))  # noqa: E731 - complexity only, as the baseline
    sessions = {rate: sim_sessions(trace.at_rate(rate), records, route) for rate in rates}
    search = search_split(simulator, sessions, extra=[proportional, split.fractions])
    out["baseline_split_search"] = search_report(search)
    proportional_score = next((e["score_s"] for e in search["scored"] if e["split"] == proportional), None)
    out["baseline_proportional"]["simulated_score_s"] = proportional_score
    return search["best"], out
