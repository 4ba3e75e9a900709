"""Latency-vs-load curves (pure): the knee, the reduction at the knee, the SLO and the capacity at the SLO.

A curve is the list written under `curve` in the bench JSON: one point per session arrival rate,
`{"rate": r, "systems": {name: metrics}, ...}`, rates ascending. The rules (docs/BENCHMARKS.md 3a):
- knee: the lowest rate where the baseline's mean token latency is at least KNEE_FACTOR x its value at
  the lowest rate (None when no rate gets there: the curve did not reach the knee);
- SLO: p90 TTFT <= TTFT_SLO_X x and p90 TPOT <= TPOT_SLO_X x the lightest-rate baseline's p50 TTFT and
  p50 TPOT, unless absolute limits are given;
- capacity at the SLO: per system, the highest rate r such that the system meets the SLO at r and at every
  lower rate of the curve (a noisy pass above a failing rate does not count); None when the lowest fails.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from eval.bench.metrics import reduction

KNEE_FACTOR = 2.0
TTFT_SLO_X = 5.0
TPOT_SLO_X = 2.0
BASELINE = "baseline"


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_p90_s: float
    tpot_p90_s: float
    rule: str

    def met(self, metrics: Mapping[str, Any]) -> bool:
        ttft, tpot = metrics.get("ttft_p90_s"), metrics.get("tpot_p90_s")
        return ttft is not None and tpot is not None and ttft <= self.ttft_p90_s and tpot <= self.tpot_p90_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_rates(text: str) -> tuple[float, ...]:
    """'0.25,0.5,1' -> (0.25, 0.5, 1.0): ascending, positive, no repeats; ValueError says what is wrong."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--rates expects comma-separated numbers, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--rates expects positive session arrival rates, got {text!r}")
    if len(set(rates)) != len(rates):
        raise ValueError(f"--rates has a repeated rate: {text!r}")
    return tuple(sorted(rates))


def _latency(point: Mapping[str, Any], name: str) -> float | None:
    return (point["systems"].get(name) or {}).get("mean_token_latency_s")


def knee_rate(curve: Sequence[Mapping[str, Any]], factor: float = KNEE_FACTOR) -> float | None:
    """The lowest rate where the baseline's mean token latency is >= factor x its lowest-rate value."""
    if not curve or BASELINE not in curve[0]["systems"]:
        return None
    light = _latency(curve[0], BASELINE)
    if light is None:
        return None
    for point in curve:
        value = _latency(point, BASELINE)
        if value is not None and value >= factor * light:
            return point["rate"]
    return None


def reductions_at(curve: Sequence[Mapping[str, Any]], rate: float | None) -> dict[str, float | None]:
    """Per system: 1 - its mean token latency / the baseline's, at `rate` ({} when rate is None)."""
    point = next((p for p in curve if p["rate"] == rate), None)
    if point is None or BASELINE not in point["systems"]:
        return {}
    base = _latency(point, BASELINE)
    return {n: reduction(_latency(point, n), base) for n in point["systems"] if n != BASELINE}


def default_slo(curve: Sequence[Mapping[str, Any]], ttft_x: float = TTFT_SLO_X,
                tpot_x: float = TPOT_SLO_X) -> SLO | None:
    """ttft_x and tpot_x times the lightest-rate baseline's p50 TTFT and p50 TPOT."""
    if not curve or BASELINE not in curve[0]["systems"]:
        return None
    light = curve[0]["systems"][BASELINE]
    ttft, tpot = light.get("ttft_p50_s"), light.get("tpot_p50_s")
    if ttft is None or tpot is None:
        return None
    return SLO(ttft_p90_s=ttft_x * ttft, tpot_p90_s=tpot_x * tpot,
               rule=f"p90 TTFT <= {ttft_x:g}x and p90 TPOT <= {tpot_x:g}x the baseline's p50 TTFT and p50 TPOT "
                    f"at the lowest rate ({curve[0]['rate']:g} sessions/s)")


def capacity_at_slo(curve: Sequence[Mapping[str, Any]], slo: SLO | None) -> dict[str, float | None]:
    """Per system: the highest rate up to which every rate of the curve meets the SLO (None: not even the
    lowest does)."""
    if slo is None or not curve:
        return {}
    names = list(dict.fromkeys(n for p in curve for n in p["systems"]))
    out: dict[str, float | None] = {}
    for name in names:
        best = None
        for point in curve:
            metrics = point["systems"].get(name)
            if metrics is None or not slo.met(metrics):
                break
            best = point["rate"]
        out[name] = best
    return out


def summarize_curve(curve: Sequence[Mapping[str, Any]], slo: SLO | None) -> dict[str, Any]:
    """The top-level curve keys of the bench JSON."""
    knee = knee_rate(curve)
    at_knee = reductions_at(curve, knee)
    capacity = capacity_at_slo(curve, slo)
    highest = curve[-1]["rate"] if curve else None
    return {
        "knee_rate": knee,
        "knee_rule": f"lowest rate where the baseline's mean token latency >= {KNEE_FACTOR:g}x its lowest-rate value",
        "reduction_at_knee": at_knee.get("mfs"),
        "reductions_at_knee": at_knee,
        "capacity_at_slo": capacity,
        "capacity_at_slo_is_lower_bound": sorted(n for n, r in capacity.items() if r is not None and r == highest),
        "slo": slo.to_dict() if slo else None,
    }


def format_curve(result: Mapping[str, Any]) -> str | None:
    """The curve as a table (one row per rate and system), then the knee and the capacities; None for a
    single-rate result."""
    curve = result.get("curve") or []
    if len(curve) < 2:
        return None
    header = (f"{'rate/s':>7} {'system':<16}{'tok-lat ms':>11}{'floor ms':>10}{'ttft90 ms':>11}{'tpot90 ms':>11}"
              f"{'hit':>7}{'preempt':>9}{'reroute':>9}{'vs base':>9}")
    lines = [header, "-" * len(header)]

    def cell(value, scale=1.0, width=11, digits=2):
        return f"{'-':>{width}}" if value is None else f"{value * scale:>{width}.{digits}f}"

    for point in curve:
        for name, m in point["systems"].items():
            red = (point.get("reductions_vs_baseline") or {}).get(name)
            lines.append(f"{point['rate']:>7g} {name:<16}" + cell(m.get("mean_token_latency_s"), 1e3)
                         + cell(m.get("decode_floor_token_latency_s"), 1e3, 10) + cell(m.get("ttft_p90_s"), 1e3)
                         + cell(m.get("tpot_p90_s"), 1e3) + cell(m.get("prefix_hit_rate"), 1, 7)
                         + f"{m.get('preemptions', 0):>9}{m.get('reroutes', 0):>9}"
                         + (f"{red * 100:>8.1f}%" if red is not None else f"{'':>9}"))
    if not any(BASELINE in p["systems"] for p in curve):
        return "\n".join(lines)
    knee = result.get("knee_rate")
    red = result.get("reduction_at_knee")
    lines.append(f"knee (baseline at {KNEE_FACTOR:g}x its lightest-rate token latency): "
                 + (f"{knee:g} sessions/s, mfs reduction there {red * 100:.1f}%" if knee is not None and red is not None
                    else f"{knee:g} sessions/s" if knee is not None else "not reached on these rates"))
    slo = result.get("slo")
    if slo:
        capacity = result.get("capacity_at_slo") or {}
        bound = set(result.get("capacity_at_slo_is_lower_bound") or ())
        lines.append(f"capacity at the SLO ({slo['rule']}: {slo['ttft_p90_s'] * 1e3:.0f} ms, "
                     f"{slo['tpot_p90_s'] * 1e3:.1f} ms): "
                     + ", ".join(f"{n} {'>=' if n in bound else ''}{r:g}/s" if r is not None else f"{n} none"
                                 for n, r in capacity.items()))
    return "\n".join(lines)
