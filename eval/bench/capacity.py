"""Capacity at an absolute SLO, read from several rate grids of the same runs.

    python -m eval.bench.capacity --slo-ttft-s 0.3 --slo-tpot-s 0.1 FILE [FILE ...]

A system's capacity is the rate where its p90 TTFT or p90 TPOT crosses the SLO, interpolated between the two grid
points around the crossing (eval/bench/curve.py), so a coarse grid leaves it loose: a p90 TTFT that jumps from
90 ms to 5 s between 16 and 32 sessions/s puts the crossing anywhere in between. Finer grids around each system's
crossing run as files of their own (the same trace seeds, the systems and rates that need them). Simulated runs
are deterministic, so a rate that two files share gives the same figures there: the files of one seed are merged
per system, checked equal where they overlap, and each system's capacity is read from all its points. Prints each
seed's capacities, the ratio of MFS's to the static baseline's and its mean and 95% interval over the seeds.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from eval.bench.curve import SLO, capacity_at_slo, capacity_ratio
from eval.bench.intervals import interval, read_results

# the figures two files must agree on at a rate they share (same seed, same system)
_SAME = ("mean_token_latency_s", "ttft_p90_s", "tpot_p90_s")


class GridMismatch(ValueError):
    """Two files of one seed give different figures for a system at the same rate: not the same runs."""


def merge_points(results: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, dict[float, Mapping[str, Any]]]]:
    """seed -> system -> rate -> that point's metrics, over every per-run result (files without a curve, such as
    the means written beside --seeds runs, are skipped)."""
    merged: dict[int, dict[str, dict[float, Mapping[str, Any]]]] = {}
    for result in results:
        if not result.get("curve"):
            continue
        seed = int(result["settings"]["seed"])
        for point in result["curve"]:
            rate = float(point["rate"])
            for name, metrics in point["systems"].items():
                seen = merged.setdefault(seed, {}).setdefault(name, {}).setdefault(rate, metrics)
                differ = [key for key in _SAME if seen.get(key) != metrics.get(key)]
                if differ:
                    raise GridMismatch(f"seed {seed}, {name} at {rate:g} sessions/s: the files differ in "
                                       f"{', '.join(differ)} (not the same runs: another trace, setting or version)")
    return merged


def capacities(points: Mapping[str, Mapping[float, Mapping[str, Any]]], slo: SLO) -> dict[str, dict[str, Any]]:
    """system -> its capacity from all its points, and whether that is only a lower bound (met at its highest
    rate) or absent (not met at its lowest)."""
    found = {}
    for name, by_rate in points.items():
        curve = [{"rate": rate, "systems": {name: metrics}} for rate, metrics in sorted(by_rate.items())]
        capacity = capacity_at_slo(curve, slo)[name]
        found[name] = {"capacity": capacity, "lower_bound": bool(capacity) and capacity == curve[-1]["rate"],
                       "rates": [p["rate"] for p in curve]}
    return found


def summary(results: Sequence[Mapping[str, Any]], slo: SLO) -> dict[str, Any]:
    by_seed = {seed: capacities(points, slo) for seed, points in sorted(merge_points(results).items())}
    # the curve's own rule: MFS's over the static baseline's, None where the baseline's is absent or a lower bound
    ratios = {seed: capacity_ratio({n: f["capacity"] for n, f in found.items()},
                                   [n for n, f in found.items() if f["lower_bound"]])
              for seed, found in by_seed.items()}
    measured = [r for r in ratios.values() if r is not None]
    found_interval = interval(measured)
    return {"slo": slo.to_dict(), "by_seed": by_seed, "ratio_by_seed": ratios,
            "ratio": found_interval.to_dict() if found_interval else None,
            "ratio_is_lower_bound": any(found["mfs"]["lower_bound"] for found in by_seed.values() if "mfs" in found)}


def format_summary(found: Mapping[str, Any]) -> str:
    lines = []
    for seed, systems in found["by_seed"].items():
        parts = []
        for name, f in systems.items():
            value = "0 (fails at its lowest rate)" if not f["capacity"] else f"{f['capacity']:.1f}" + ("+" if f["lower_bound"] else "")
            parts.append(f"{name} {value}")
        r = found["ratio_by_seed"][seed]
        lines.append(f"seed {seed}: " + ", ".join(parts) + (f"; mfs / baseline {r:.2f}x" if r is not None else ""))
    r = found["ratio"]
    if r is not None:
        span = f" [{r['low']:.2f}, {r['high']:.2f}]" if r["low"] is not None else " (one seed: no interval)"
        lines.append(f"capacity ratio mfs / baseline: {r['mean']:.2f}x{span} over {r['n']} seed(s)"
                     + (" (a lower bound: MFS met the SLO at its highest rate on some seed)"
                        if found["ratio_is_lower_bound"] else ""))
    lines.append("sessions/s; + : met at the highest rate run (a lower bound); none: not met at the lowest")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench.capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="per-seed result files of one workload, from one or more grids")
    parser.add_argument("--slo-ttft-s", type=float, required=True, help="absolute p90 TTFT limit")
    parser.add_argument("--slo-tpot-s", type=float, required=True, help="absolute p90 TPOT limit")
    parser.add_argument("--out", help="write the capacities as JSON here")
    args = parser.parse_args(argv)
    slo = SLO(ttft_p90_s=args.slo_ttft_s, tpot_p90_s=args.slo_tpot_s,
              rule=f"p90 TTFT <= {args.slo_ttft_s:g} s and p90 TPOT <= {args.slo_tpot_s:g} s (given)")
    results = read_results(args.files, "python -m eval.bench.capacity")
    if results is None:
        return 2
    try:
        found = summary(results, slo)
    except GridMismatch as exc:
        print(f"python -m eval.bench.capacity: {exc}", file=sys.stderr)
        return 2
    if not found["by_seed"]:
        print("python -m eval.bench.capacity: no file with a load curve", file=sys.stderr)
        return 2
    print(format_summary(found))
    if args.out:
        Path(args.out).write_text(json.dumps(found, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
