"""`mfs demo`: a short ShareGPT multi-turn replay through the family on the local engine, as a small table."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from eval.bench.cli import BenchSettings, run_bench

# Small enough for well under a minute per system on 2 CPU cores: a handful of sessions, short turns.
DEMO = dict(sessions=6, rate=1.0, kv_pages=512, max_turns=3, max_prompt_tokens=384, max_output_tokens=48, think_s=1.0)


def demo_settings(family: str, seed: int, with_baseline: bool) -> BenchSettings:
    return BenchSettings(workload="multiturn", sessions=DEMO["sessions"], rate=DEMO["rate"], kv_pages=DEMO["kv_pages"],
                         systems=("mfs", "baseline") if with_baseline else ("mfs",), seed=seed, family=family,
                         quick=True, max_turns=DEMO["max_turns"], max_prompt_tokens=DEMO["max_prompt_tokens"],
                         max_output_tokens=DEMO["max_output_tokens"], think_s=DEMO["think_s"], score_quality=False,
                         baseline_split="proportional")   # the operator's default split: no pilot, no search


def format_demo(result: dict[str, Any]) -> str:
    lines = [f"replayed {result['workload']['num_requests']} requests from {result['workload']['num_sessions']} "
             f"ShareGPT sessions ({result['workload']['name']}, seed {result['workload']['seed']})"]
    for name, m in result["systems"].items():
        lines.append(f"\n[{name}]")
        lines.append(f"  {'member':<10}{'requests':>10}")
        for member, n in sorted(m["requests_by_member"].items()):
            lines.append(f"  {member:<10}{n:>10}")
        lines.append(f"  prefix-cache hit rate : {_pct(m['prefix_hit_rate'])}")
        lines.append(f"  TTFT p50              : {_ms(m['ttft_p50_s'])}")
        lines.append(f"  TPOT p50              : {_ms(m['tpot_p50_s'])}")
        escalations = ", ".join(f"{k}: {v}" for k, v in m["escalations"].items() if v) or "none"
        # a request can escalate twice (s -> m -> l): requests escalated, then every hop
        lines.append(f"  escalated requests    : {sum(r['escalated'] for r in m['per_request'])} (hops {escalations})")
    reduction = result.get("reduction_mean_token_latency")
    if reduction is not None:
        direction = "lower" if reduction >= 0 else "higher"
        lines.append(f"\nmean token latency, mfs vs baseline: {_pct(abs(reduction))} {direction}")
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", default="tiny", help="shipped family name or family directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mfs-only", action="store_true", help="skip the static-split baseline replay")
    parser.add_argument("--out", default=None, help="also write the bench-format JSON here")


def main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    result = run_bench(demo_settings(args.family, args.seed, with_baseline=not args.mfs_only))
    print(format_demo(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\n({time.monotonic() - started:.0f} s)")
    return 0
