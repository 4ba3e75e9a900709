"""Bench sweeps: request rate x KV budget, `single` with ample memory, escalation.threshold (quality vs latency),
and the base setting repeated over trace seeds (the spread of the headline)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from eval.bench.cli import BenchSettings, run_bench
from eval.bench.metrics import mean
from eval.machine import machine

ROW_METRICS = ("mean_token_latency_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "e2e_p50_s", "throughput_tok_s",
               "prefix_hit_rate", "escalation_rate", "preemptions", "num_requests", "num_failed",
               "quality_reference_logprob", "decode_floor_token_latency_s")


def rows_of(result: dict[str, Any], **point: Any) -> list[dict[str, Any]]:
    """One flat row per system of a bench result, tagged with the sweep point."""
    rows = []
    for name, m in result["systems"].items():
        row = {**point, "system": name, **{k: m.get(k) for k in ROW_METRICS}}
        row["reduction_vs_baseline"] = result.get("reductions_vs_baseline", {}).get(name)
        paired = result.get("paired_vs_baseline", {}).get(name) or {}
        row["paired_reduction_vs_baseline"] = paired.get("reduction_mean_token_latency")
        row["reduction_ceiling"] = result.get("reduction_ceiling", {}).get(name)
        rows.append(row)
    return rows


def seed_spread(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system: n, mean, min and max over seeds of the reduction, the paired reduction and the ceiling
    (the most its token placement allows, see bench's decode floor) vs the baseline.
    One run is not a result here: the same seed run twice differs by several points."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["system"] for r in rows if r["system"] != "baseline"):
        entry: dict[str, Any] = {}
        for key in ("reduction_vs_baseline", "paired_reduction_vs_baseline", "reduction_ceiling"):
            values = [r[key] for r in rows if r["system"] == name and r.get(key) is not None]
            entry[key] = ({"n": len(values), "mean": mean(values), "min": min(values), "max": max(values)}
                          if values else None)
        out[name] = entry
    return out


def run_sweep(base: BenchSettings, rates: list[float], kv_pages: list[int], ample_pages: int | None,
              thresholds: list[float], seeds: Sequence[int] = (), log=print, run=None) -> dict[str, Any]:
    """run: the bench of one setting (None: eval.bench.cli.run_bench, no simulated split pilot; the sweep's command,
    eval/commands/sweep.py, hands in `mfs bench`'s, with it)."""
    run = run or run_bench
    out: dict[str, Any] = {"grid": [], "single_ample": [], "escalation": [], "seeds": [], "seed_spread": {},
                           "notes": [],
                           "settings": {"base": {k: getattr(base, k) for k in ("workload", "sessions", "seed", "family",
                                                                               "quick", "max_turns", "max_output_tokens")},
                                        "rates": rates, "kv_pages": kv_pages, "ample_pages": ample_pages,
                                        "escalation_thresholds": thresholds, "seeds": list(seeds),
                                        "machine": machine()}}
    for rate in rates:
        for pages in kv_pages:
            log(f"sweep: workload={base.workload} rate={rate} kv_pages={pages}")
            result = run(replace(base, rate=rate, kv_pages=pages))
            out["grid"] += rows_of(result, workload=base.workload, rate=rate, kv_pages=pages)
            out["notes"] += [f"rate={rate} kv_pages={pages}: {n}" for n in result["notes"]]
    if ample_pages:
        # Every request new and memory to spare: nothing to reuse, nothing to evict; the gain should vanish.
        log(f"sweep: workload=single kv_pages={ample_pages}")
        result = run(replace(base, workload="single", kv_pages=ample_pages))
        out["single_ample"] = rows_of(result, workload="single", rate=base.rate, kv_pages=ample_pages)
    for threshold in thresholds:
        log(f"sweep: escalation.threshold={threshold}")
        result = run(replace(base, systems=("mfs",), score_quality=True,
                             extra_overrides={**base.extra_overrides, "escalation.threshold": threshold}))
        out["escalation"] += rows_of(result, threshold=threshold, rate=base.rate, kv_pages=base.kv_pages)
    for seed in seeds:
        log(f"sweep: seed={seed} rate={base.rate} kv_pages={base.kv_pages}")
        result = run(replace(base, seed=seed))
        out["seeds"] += rows_of(result, seed=seed, workload=base.workload, rate=base.rate, kv_pages=base.kv_pages)
    if seeds:
        out["seed_spread"] = seed_spread(out["seeds"])
    return out


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None, run=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.commands.sweep", description=__doc__ + " Writes JSON (--out).")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workload", default="multiturn")
    parser.add_argument("--sessions", type=int, default=None)
    parser.add_argument("--rates", default="0.5,1.0,2.0", help="session arrivals per second (empty: no grid)")
    parser.add_argument("--kv-pages", default="384,768,2048")
    parser.add_argument("--ample-pages", type=int, default=8192, help="0 skips the `single` ample-memory point")
    parser.add_argument("--thresholds", default="", help="escalation.threshold values, e.g. 0.1,0.3,0.5 (mfs only)")
    parser.add_argument("--systems", default="mfs,baseline")
    parser.add_argument("--family", default="tiny")
    parser.add_argument("--seed", type=int, default=0, help="trace seed of the grid, single and threshold points")
    parser.add_argument("--seeds", type=_ints, default=[], help="also run the base setting (mfs bench's defaults, or --quick's) "
                                                  "once per seed, e.g. 0,1,2,3, and report the spread")
    parser.add_argument("--base-rate", type=float, default=None, help="base setting's rate (thresholds and seeds)")
    parser.add_argument("--base-kv-pages", type=int, default=None, help="base setting's KV pages (thresholds and seeds)")
    parser.add_argument("--out", default="sweep.json")
    args = parser.parse_args(argv)
    base = BenchSettings.quick_defaults() if args.quick else BenchSettings()
    base = replace(base, workload=args.workload, family=args.family, seed=args.seed, progress=False,
                   systems=tuple(s for s in args.systems.split(",") if s), score_quality=False,
                   **({"sessions": args.sessions} if args.sessions else {}),
                   **({"rate": args.base_rate} if args.base_rate else {}),
                   **({"kv_pages": args.base_kv_pages} if args.base_kv_pages else {}))
    started = time.monotonic()
    result = run_sweep(base, _floats(args.rates), [int(x) for x in _floats(args.kv_pages)], args.ample_pages or None,
                       _floats(args.thresholds), args.seeds,
                       log=lambda m: print(m, file=sys.stderr), run=run)
    result["settings"]["wall_s"] = round(time.monotonic() - started, 1)
    result["settings"]["command"] = "python -m eval.commands.sweep " + " ".join(argv if argv is not None else sys.argv[1:])
    Path(args.out).write_text(json.dumps(result, indent=1))
    for row in result["grid"] + result["single_ample"] + result["escalation"] + result["seeds"]:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    for name, spread in result["seed_spread"].items():
        for key, s in spread.items():
            if s:
                print(f"{name} {key} over {s['n']} seeds: mean {s['mean'] * 100:.1f}%, "
                      f"min {s['min'] * 100:.1f}%, max {s['max'] * 100:.1f}%")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit("the sweep runs as python -m eval.commands.sweep (the bench with its simulated split pilot)")
