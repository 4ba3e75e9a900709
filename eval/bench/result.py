"""The result blocks `mfs bench` and `mfs simulate` both write: one rate's point (every system's metrics and how
each compares with the baseline), the load curve, and the headline with its knee, SLO and capacities."""
from __future__ import annotations

from typing import Any

from eval.bench.curve import BASELINE, SLO, default_slo, summarize_curve
from eval.bench.metrics import RequestRecord, paired_token_latency, reduction

CURVE_DROP = ("per_request", "pages_timeline")   # per-request rows stay in the headline point only


def rate_point(rate: float, records_by_system: dict[str, list[RequestRecord]],
               systems: dict[str, Any], baseline: str = BASELINE) -> dict[str, Any]:
    """Every system on the trace at one rate: their metrics blocks and the reductions against the baseline (the
    system named `baseline`)."""
    return {"rate": rate, "systems": systems,
            "reduction_mean_token_latency": reduction_vs_baseline(systems, "mfs", baseline),
            "reductions_vs_baseline": {n: reduction_vs_baseline(systems, n, baseline) for n in systems
                                       if n != baseline},
            "paired_vs_baseline": paired_vs_baseline(records_by_system, baseline),
            "reduction_ceiling": reduction_ceilings(systems, baseline)}


def without_rows(metrics: dict[str, Any]) -> dict[str, Any]:
    """A system's metrics block without its per-request rows (CURVE_DROP)."""
    return {k: v for k, v in metrics.items() if k not in CURVE_DROP}


def curve_points(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The load curve: every rate's point, its systems without their per-request rows."""
    return [{**p, "systems": {n: without_rows(m) for n, m in p["systems"].items()}} for p in points]


def curve_result(settings: Any, headline: float, head: dict[str, Any], rates, curve: list,
                 baseline: str = BASELINE) -> dict[str, Any]:
    """The headline point and the load curve with its knee, SLO and capacities (docs/BENCHMARKS.md, Method: The JSON): the keys
    `mfs bench` and `mfs simulate` both write."""
    return {"headline_rate": headline,
            "systems": head["systems"],
            "reduction_mean_token_latency": head["reduction_mean_token_latency"],
            "reductions_vs_baseline": head["reductions_vs_baseline"],
            "paired_vs_baseline": head["paired_vs_baseline"],
            "reduction_ceiling": head["reduction_ceiling"],
            "rates": list(rates),
            "curve": curve,
            **summarize_curve(curve, slo_for(settings, curve, baseline), baseline)}


def slo_for(settings: Any, curve: list[dict[str, Any]], baseline: str = BASELINE) -> SLO | None:
    if settings.slo_ttft_s is not None and settings.slo_tpot_s is not None:
        return SLO(settings.slo_ttft_s, settings.slo_tpot_s,
                   rule=f"p90 TTFT <= {settings.slo_ttft_s:g} s and p90 TPOT <= {settings.slo_tpot_s:g} s (given)")
    return default_slo(curve, settings.slo_ttft_x, settings.slo_tpot_x, baseline)


def reduction_vs_baseline(systems: dict[str, Any], name: str, baseline: str = BASELINE) -> float | None:
    if name not in systems or baseline not in systems:
        return None
    return reduction(systems[name]["mean_token_latency_s"], systems[baseline]["mean_token_latency_s"])


def reduction_ceilings(systems: dict[str, Any], baseline: str = BASELINE) -> dict[str, float | None]:
    """Per system: the largest reduction against the baseline's measured latency that its token placement
    allows (1 - its decode floor / the baseline's mean token latency)."""
    if baseline not in systems:
        return {}
    base = systems[baseline]["mean_token_latency_s"]
    return {n: reduction(m.get("decode_floor_token_latency_s"), base) for n, m in systems.items() if n != baseline}


def paired_vs_baseline(records_by_system: dict[str, list[RequestRecord]],
                       baseline_name: str = BASELINE) -> dict[str, Any]:
    """Per system: mean token latency of it and the baseline over the requests both served, and the reduction."""
    baseline = records_by_system.get(baseline_name)
    if baseline is None:
        return {}
    out = {}
    for name, records in records_by_system.items():
        if name == baseline_name:
            continue
        ours, theirs, count = paired_token_latency(records, baseline)
        out[name] = {"num_requests": count, "mean_token_latency_s": ours, "baseline_mean_token_latency_s": theirs,
                     "reduction_mean_token_latency": reduction(ours, theirs)}
    return out
