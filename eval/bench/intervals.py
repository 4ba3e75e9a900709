"""Means and 95% intervals of the curve figures over several runs (trace seeds x repeats).

    python -m eval.bench.intervals run_s0.json run_s1.json ... [--out intervals.json]

Each file is a `mfs bench` or `mfs simulate` result with a load curve. The curve figures are read again from
each file's stored curve with the current rules (eval/bench/curve.py: the interpolated knee and capacity), so
files written under older rules are summarised the same way. The interval is Student's t over the runs
(mean +- t(0.975, n - 1) x s / sqrt(n)); one run gives a mean and no interval, and is not a result.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eval.bench.curve import BASELINE, SLO, default_slo, summarize_curve
from eval.bench.metrics import reduction

# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom; past 30 the nearest lower entry.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
         29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}
# Settings that may differ between the runs of one interval: what picks the trace, what each run derived from
# its trace (the searched split, the configs built from it) and what was typed.
_RUN_KEYS = frozenset({"seed", "trace_file", "save_trace", "progress", "record_confidences", "static_split",
                       "static_split_traffic_share", "static_split_requests_by_member", "configs", "baseline_split",
                       "command", "wall_s"})
# The figures an interval is given for: top-level keys, and per-system maps.
FIGURES = ("reduction_at_knee", "knee_rate", "capacity_ratio", "reduction_at_grid_knee")
PER_SYSTEM = ("reductions_at_knee", "mfs_against_at_knee", "attribution_at_knee", "capacity_at_slo")


def t_quantile_975(df: int) -> float:
    if df < 1:
        raise ValueError("an interval needs at least two runs")
    if df in _T975:
        return _T975[df]
    below = [k for k in _T975 if k <= df]
    return 1.96 if df > 120 else _T975[max(below)]


@dataclass(frozen=True, slots=True)
class Interval:
    mean: float
    low: float | None          # None with one value: no interval
    high: float | None
    n: int
    values: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "values": list(self.values)}


def interval(values: Sequence[float]) -> Interval | None:
    """Mean and 95% t-interval of `values` (None when empty)."""
    values = tuple(float(v) for v in values)
    if not values:
        return None
    mean = statistics.fmean(values)
    if len(values) == 1:
        return Interval(mean, None, None, 1, values)
    half = t_quantile_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return Interval(mean, mean - half, mean + half, len(values), values)


def resummarize(result: Mapping[str, Any]) -> dict[str, Any]:
    """The curve keys of one result, recomputed from its stored curve with the current rules (its SLO kept
    when it was given in absolute terms, rebuilt from the curve when it was relative)."""
    curve = result.get("curve") or []
    settings = result.get("settings") or {}
    baseline = result.get("baseline_system", BASELINE)      # `mfs bench --peer` reads against its own
    if settings.get("slo_ttft_s") is not None and settings.get("slo_tpot_s") is not None:
        slo: SLO | None = SLO(settings["slo_ttft_s"], settings["slo_tpot_s"], (result.get("slo") or {}).get("rule", ""))
    else:
        slo = default_slo(curve, settings.get("slo_ttft_x", 5.0), settings.get("slo_tpot_x", 2.0), baseline)
    return summarize_curve(curve, slo, baseline)


def intervals_over(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per figure (and per system for the per-system maps): the interval over the runs that have it."""
    summaries = [resummarize(r) for r in results]
    out: dict[str, Any] = {}
    for key in FIGURES:
        found = interval([s[key] for s in summaries if s.get(key) is not None])
        out[key] = found.to_dict() if found else None
        out[f"{key}_missing"] = sum(1 for s in summaries if s.get(key) is None)
    for key in PER_SYSTEM:
        names = dict.fromkeys(n for s in summaries for n in (s.get(key) or {}))
        out[key] = {n: (lambda i: i.to_dict() if i else None)(
            interval([s[key][n] for s in summaries if (s.get(key) or {}).get(n) is not None])) for n in names}
    out["mfs_against_by_rate"] = mfs_against_by_rate(results)
    return out


def mfs_against_by_rate(results: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per grid rate every run has, per other system: 1 - mfs's mean token latency / that system's, over the runs
    (the curve where no knee is reached: how much faster or slower MFS is at each load)."""
    curves = [{p["rate"]: p["systems"] for p in r.get("curve") or []} for r in results]
    rates = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    out: dict[str, dict[str, Any]] = {}
    for rate in rates:
        names = dict.fromkeys(n for c in curves for n in c[rate] if n != "mfs")
        row = {}
        for name in names:
            values = [reduction(c[rate].get("mfs", {}).get("mean_token_latency_s"),
                                c[rate].get(name, {}).get("mean_token_latency_s")) for c in curves]
            found = interval([v for v in values if v is not None])
            row[name] = found.to_dict() if found else None
        out[f"{rate:g}"] = row
    return out


def differing_settings(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """Settings (other than the trace seed and the like) that differ between the runs."""
    keys = dict.fromkeys(k for r in results for k in (r.get("settings") or {}) if k not in _RUN_KEYS)
    return [k for k in keys if len({json.dumps((r.get("settings") or {}).get(k), sort_keys=True) for r in results}) > 1]


def _pct(found: Mapping[str, Any] | None) -> str:
    if not found:
        return "-"
    if found["low"] is None:
        return f"{found['mean'] * 100:.1f}% (one run: no interval)"
    return f"{found['mean'] * 100:.1f}% [{found['low'] * 100:.1f}, {found['high'] * 100:.1f}] (n={found['n']})"


def _plain(found: Mapping[str, Any] | None, unit: str) -> str:
    if not found:
        return "-"
    if found["low"] is None:
        return f"{found['mean']:.3g}{unit} (one run: no interval)"
    return f"{found['mean']:.3g}{unit} [{found['low']:.3g}, {found['high']:.3g}] (n={found['n']})"


def format_intervals(found: Mapping[str, Any]) -> str:
    lines = ["means with 95% intervals over the runs (Student's t):",
             f"  knee rate (interpolated)          {_plain(found['knee_rate'], '/s')}",
             f"  mfs reduction at the knee         {_pct(found['reduction_at_knee'])}",
             f"  (grid reading, not the headline)  {_pct(found['reduction_at_grid_knee'])}",
             f"  capacity ratio mfs / baseline     {_plain(found['capacity_ratio'], 'x')}"
             + (f"; {found['capacity_ratio_missing']} run(s) without a ratio" if found["capacity_ratio_missing"] else "")]
    for name, value in found["reductions_at_knee"].items():
        if name != "mfs":
            lines.append(f"  {name} against the baseline at the knee {_pct(value)}")
    for name, value in found.get("mfs_against_at_knee", {}).items():
        lines.append(f"  mfs against {name} at the knee {_pct(value)}")
    for name, value in found.get("attribution_at_knee", {}).items():
        lines.append(f"  points of reduction lost with {name} (what that mechanism is worth) {_pct(value)}")
    for rate, row in found.get("mfs_against_by_rate", {}).items():
        lines.append(f"  at {rate} sessions/s, mfs against: " + "; ".join(f"{n} {_pct(v)}" for n, v in row.items()))
    return "\n".join(lines)


def parse_seeds(text: str) -> tuple[int, ...]:
    """'0,1,2' or '0-4' -> the trace seeds (no repeats); ValueError says what is wrong."""
    try:
        if "-" in text and "," not in text:
            low, high = (int(x) for x in text.split("-"))
            seeds = tuple(range(low, high + 1))
        else:
            seeds = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--seeds expects '0,1,2' or '0-4', got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds expects distinct seeds, got {text!r}")
    return seeds


def run_file(out: str | Path, seed: int, repeat: int, repeats: int) -> Path:
    """Where one run of a multi-seed command writes its result: OUT_seedS[_repR].json beside OUT."""
    out = Path(out)
    tail = f"_seed{seed}" + (f"_rep{repeat}" if repeats > 1 else "")
    return out.with_name(out.stem + tail + (out.suffix or ".json"))


def write_over_runs(out: str | Path, files: Sequence[Path], command: str | None) -> dict[str, Any]:
    """The intervals over the runs' files, written to OUT (what a multi-seed command ends with) and printed."""
    results = [json.loads(Path(f).read_text()) for f in files]
    found = intervals_over(results)
    differ = differing_settings(results)
    Path(out).write_text(json.dumps({"command": command, "files": [str(f) for f in files],
                                     "differing_settings": differ, "intervals": found}, indent=1))
    print(format_intervals(found))
    print(f"wrote {out} (the intervals over {len(files)} runs)")
    return found


def read_results(paths: Sequence[str], prog: str) -> list[dict[str, Any]] | None:
    """Each result file's JSON; None (after one line on stderr naming the file) when one cannot be read."""
    results = []
    for name in paths:
        try:
            results.append(json.loads(Path(name).read_text()))
        except (OSError, ValueError) as exc:
            print(f"{prog}: cannot read {name}: {exc}", file=sys.stderr)
            return None
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench.intervals", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="bench or simulate result JSON files with a load curve")
    parser.add_argument("--out", default=None, help="write the intervals here as JSON")
    args = parser.parse_args(argv)
    results = read_results(args.files, "python -m eval.bench.intervals")
    if results is None:
        return 2
    found = intervals_over(results)
    differ = differing_settings(results)
    if differ:
        print(f"warning: the runs differ in settings other than the trace seed: {', '.join(differ)}")
    print(format_intervals(found))
    if args.out:
        Path(args.out).write_text(json.dumps({"files": list(args.files), "differing_settings": differ,
                                              "intervals": found}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
