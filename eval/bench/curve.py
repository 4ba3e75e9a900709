"""Latency-vs-load curves (pure): the knee, the reductions there, the SLO and the capacity at the SLO.

A curve is the list written under `curve` in the bench JSON: one point per session arrival rate,
`{"rate": r, "systems": {name: metrics}, ...}`, rates ascending. Readings between grid points are
interpolated linearly in log rate, so no figure depends on where the grid happens to fall:
- knee: the rate where the baseline's mean token latency reaches KNEE_FACTOR x its value at the lowest rate,
  interpolated between the last grid point below that and the first at or above it (None when the curve does
  not get there). Every system's latency is interpolated at that rate and the reductions are read there. The
  grid reading (the first grid point at or past the factor) is kept beside it, labelled as such.
- SLO: absolute p90 TTFT and p90 TPOT limits when given; otherwise TTFT_SLO_X x and TPOT_SLO_X x the
  lightest-rate baseline's p50 TTFT and p50 TPOT (a relative SLO).
- capacity at the SLO: per system, the rate at which the first of its p90 TTFT and p90 TPOT crosses its limit,
  interpolated between the last passing grid point and the first failing one; every lower grid point must
  pass (a noisy pass above a failing rate does not count). None when the lowest rate fails; the highest rate
  as a lower bound when no rate fails. The capacity ratio (mfs / baseline) is given only when the baseline
  has a capacity and it is not a lower bound.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from eval.bench.metrics import reduction

KNEE_FACTOR = 2.0
TTFT_SLO_X = 5.0
TPOT_SLO_X = 2.0
BASELINE = "baseline"
LATENCY = "mean_token_latency_s"


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_p90_s: float
    tpot_p90_s: float
    rule: str

    def limits(self) -> dict[str, float]:
        return {"ttft_p90_s": self.ttft_p90_s, "tpot_p90_s": self.tpot_p90_s}

    def met(self, metrics: Mapping[str, Any]) -> bool:
        return all(metrics.get(key) is not None and metrics[key] <= limit for key, limit in self.limits().items())

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


def _metric(point: Mapping[str, Any], name: str, key: str = LATENCY) -> float | None:
    return (point["systems"].get(name) or {}).get(key)


def _log_fraction(low: float, high: float, rate: float) -> float:
    return (math.log(rate) - math.log(low)) / (math.log(high) - math.log(low))


def _rate_at_fraction(low: float, high: float, fraction: float) -> float:
    return math.exp(math.log(low) + fraction * (math.log(high) - math.log(low)))


def _crossing(low_rate: float, low_value: float, high_rate: float, high_value: float, target: float) -> float:
    """The rate in [low_rate, high_rate] where a value going from low_value (< target) to high_value (>= target)
    linearly in log rate reaches target."""
    return _rate_at_fraction(low_rate, high_rate, (target - low_value) / (high_value - low_value))


def value_at(curve: Sequence[Mapping[str, Any]], name: str, rate: float, key: str = LATENCY) -> float | None:
    """System `name`'s metric `key` at `rate`, interpolated linearly in log rate between the grid points around
    it (exact at a grid point); None outside the curve or where a neighbour lacks the value."""
    for low, high in zip(curve, curve[1:]):
        if low["rate"] <= rate <= high["rate"]:
            a, b = _metric(low, name, key), _metric(high, name, key)
            if rate == low["rate"]:
                return a
            if rate == high["rate"]:
                return b
            if a is None or b is None:
                return None
            return a + _log_fraction(low["rate"], high["rate"], rate) * (b - a)
    if len(curve) == 1 and curve[0]["rate"] == rate:
        return _metric(curve[0], name, key)
    return None


def grid_knee_rate(curve: Sequence[Mapping[str, Any]], factor: float = KNEE_FACTOR,
                   baseline: str = BASELINE) -> float | None:
    """The lowest grid rate where the baseline's mean token latency is >= factor x its lowest-rate value."""
    if not curve or _metric(curve[0], baseline) is None:
        return None
    target = factor * _metric(curve[0], baseline)
    return next((p["rate"] for p in curve if (_metric(p, baseline) or 0.0) >= target), None)


def knee_rate(curve: Sequence[Mapping[str, Any]], factor: float = KNEE_FACTOR,
              baseline: str = BASELINE) -> float | None:
    """The rate where the baseline's mean token latency reaches factor x its lowest-rate value, interpolated in
    log rate between the last grid point below it and the first at or above it."""
    grid = grid_knee_rate(curve, factor, baseline)
    if grid is None:
        return None
    target = factor * _metric(curve[0], baseline)
    index = next(i for i, p in enumerate(curve) if p["rate"] == grid)
    below = curve[index - 1]
    low, high = _metric(below, baseline), _metric(curve[index], baseline)
    if low is None or low >= target:       # a gap in the baseline's values: the grid reading is all there is
        return grid
    return _crossing(below["rate"], low, grid, high, target)


def reductions_at(curve: Sequence[Mapping[str, Any]], rate: float | None,
                  baseline: str = BASELINE) -> dict[str, float | None]:
    """Per system: 1 - its mean token latency / the baseline's, both interpolated at `rate` ({} when None)."""
    if rate is None or not curve or baseline not in curve[0]["systems"]:
        return {}
    base = value_at(curve, baseline, rate)
    names = dict.fromkeys(n for p in curve for n in p["systems"] if n != baseline)
    return {n: reduction(value_at(curve, n, rate), base) for n in names}


def mfs_against_at(curve: Sequence[Mapping[str, Any]], rate: float | None,
                   baseline: str = BASELINE) -> dict[str, float | None]:
    """Per system other than mfs and the baseline: 1 - mfs's mean token latency / that system's, both interpolated
    at `rate` (what MFS gains over, e.g., the elastic baseline where the reference baseline reaches its knee)."""
    if rate is None or not curve:
        return {}
    names = dict.fromkeys(n for p in curve for n in p["systems"] if n not in ("mfs", baseline))
    mine = value_at(curve, "mfs", rate)
    return {n: reduction(mine, value_at(curve, n, rate)) for n in names}


def attribution(reductions: Mapping[str, float | None]) -> dict[str, float | None]:
    """Per ablation (a system named no_*: MFS with one mechanism off): the points of reduction against the
    baseline that MFS loses without that mechanism (its worth; interactions make them not add up exactly)."""
    mine = reductions.get("mfs")
    return {n: (None if mine is None or r is None else mine - r) for n, r in reductions.items() if n.startswith("no_")}


def default_slo(curve: Sequence[Mapping[str, Any]], ttft_x: float = TTFT_SLO_X,
                tpot_x: float = TPOT_SLO_X, baseline: str = BASELINE) -> SLO | None:
    """A relative SLO: ttft_x and tpot_x times the lightest-rate baseline's p50 TTFT and p50 TPOT."""
    if not curve or baseline not in curve[0]["systems"]:
        return None
    light = curve[0]["systems"][baseline]
    ttft, tpot = light.get("ttft_p50_s"), light.get("tpot_p50_s")
    if ttft is None or tpot is None:
        return None
    return SLO(ttft_p90_s=ttft_x * ttft, tpot_p90_s=tpot_x * tpot,
               rule=f"p90 TTFT <= {ttft_x:g}x and p90 TPOT <= {tpot_x:g}x the baseline's p50 TTFT and p50 TPOT "
                    f"at the lowest rate ({curve[0]['rate']:g} sessions/s)")


def _capacity(curve: Sequence[Mapping[str, Any]], name: str, slo: SLO) -> float:
    last_pass = None
    for point in curve:
        metrics = point["systems"].get(name)
        if metrics is not None and slo.met(metrics):
            last_pass = point
            continue
        if last_pass is None or metrics is None:
            # failing (or failed: no metrics) at its lightest rate is a capacity of zero, never a dropped sample
            return 0.0 if last_pass is None else last_pass["rate"]
        # the first of the SLO's limits that the interpolated metrics cross, between the two grid points
        crossings = []
        for key, limit in slo.limits().items():
            value = metrics.get(key)
            if value is None:
                return last_pass["rate"]
            if value > limit:
                crossings.append(_crossing(last_pass["rate"], last_pass["systems"][name][key], point["rate"],
                                           value, limit))
        return min(crossings)
    return last_pass["rate"] if last_pass is not None else 0.0


def capacity_at_slo(curve: Sequence[Mapping[str, Any]], slo: SLO | None) -> dict[str, float | None]:
    """Per system: the interpolated rate up to which it meets the SLO; 0 when not even the lowest rate does (a
    seed on which a system fails counts against that system)."""
    if slo is None or not curve:
        return {}
    names = dict.fromkeys(n for p in curve for n in p["systems"])
    return {name: _capacity(curve, name, slo) for name in names}


def capacity_ratio(capacity: Mapping[str, float | None], lower_bound: Sequence[str], name: str = "mfs",
                   baseline: str = BASELINE) -> float | None:
    """name's capacity / the baseline's: 0 when `name` meets the SLO at no rate; None (undefined) when the baseline
    meets it at no rate or only a lower bound is known for it, or either was not run. When `name`'s own capacity is a
    lower bound, so is the ratio."""
    base, mine = capacity.get(baseline), capacity.get(name)
    if base is None or mine is None or not base or baseline in lower_bound:
        return None
    return mine / base


def summarize_curve(curve: Sequence[Mapping[str, Any]], slo: SLO | None, baseline: str = BASELINE) -> dict[str, Any]:
    """The top-level curve keys of the bench JSON. baseline: the system the knee, the reductions and the capacity
    ratio are read against ("baseline"; `mfs bench --peer` names its own, as the result's baseline_system)."""
    knee, grid_knee = knee_rate(curve, baseline=baseline), grid_knee_rate(curve, baseline=baseline)
    at_knee, at_grid_knee = reductions_at(curve, knee, baseline), reductions_at(curve, grid_knee, baseline)
    capacity = capacity_at_slo(curve, slo)
    highest = curve[-1]["rate"] if curve else None
    lower_bound = sorted(n for n, r in capacity.items() if r and r == highest)
    return {
        "knee_rate": knee,
        "knee_rule": f"rate where the baseline's mean token latency reaches {KNEE_FACTOR:g}x its lowest-rate value, "
                     "interpolated linearly in log rate between grid points",
        "reduction_at_knee": at_knee.get("mfs"),
        "reductions_at_knee": at_knee,
        "mfs_against_at_knee": mfs_against_at(curve, knee, baseline),
        "attribution_at_knee": attribution(at_knee),
        "knee_grid_rate": grid_knee,
        "reduction_at_grid_knee": at_grid_knee.get("mfs"),
        "capacity_at_slo": capacity,
        "capacity_at_slo_is_lower_bound": lower_bound,
        "capacity_ratio": capacity_ratio(capacity, lower_bound, baseline=baseline),
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
    if not any(result.get("baseline_system", BASELINE) in p["systems"] for p in curve):
        return "\n".join(lines)
    lines.append(_knee_line(result))
    slo = result.get("slo")
    if slo:
        capacity = result.get("capacity_at_slo") or {}
        bound = set(result.get("capacity_at_slo_is_lower_bound") or ())
        ratio = result.get("capacity_ratio")
        lines.append(f"capacity at the SLO ({slo['rule']}: {slo['ttft_p90_s'] * 1e3:.0f} ms, "
                     f"{slo['tpot_p90_s'] * 1e3:.1f} ms), interpolated: "
                     + ", ".join(f"{n} {'>=' if n in bound else ''}{r:.3g}/s" if r else f"{n} 0 (fails at the lightest rate)"
                                 for n, r in capacity.items())
                     + (f"; mfs / baseline {'>=' if 'mfs' in bound else ''}{ratio:.2f}x" if ratio is not None
                        else "; no capacity ratio (the baseline meets the SLO at no rate of this curve, or only a lower "
                             "bound is known)"))
    return "\n".join(lines)


def _knee_line(result: Mapping[str, Any]) -> str:
    knee, red = result.get("knee_rate"), result.get("reduction_at_knee")
    head = f"knee (baseline at {KNEE_FACTOR:g}x its lightest-rate token latency, interpolated): "
    if knee is None:
        return head + "not reached on these rates"
    text = head + f"{knee:.3g} sessions/s" + (f", mfs reduction there {red * 100:.1f}%" if red is not None else "")
    grid, grid_red = result.get("knee_grid_rate"), result.get("reduction_at_grid_knee")
    if grid is not None and grid_red is not None:
        text += f" (grid reading, not the headline: {grid:g} sessions/s, {grid_red * 100:.1f}%)"
    return text
