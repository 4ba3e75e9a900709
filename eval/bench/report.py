"""The text report of `mfs bench`: the per-system table at the headline rate, the decode floor and paired
lines, then the load curve (eval/bench/curve.py)."""
from __future__ import annotations

from typing import Any

from eval.bench.curve import format_curve


TABLE_COLUMNS = (("mean_token_latency_s", "tok-lat ms", 1e3), ("ttft_p50_s", "ttft50 ms", 1e3),
                 ("ttft_p99_s", "ttft99 ms", 1e3), ("tpot_p50_s", "tpot50 ms", 1e3), ("tpot_p99_s", "tpot99 ms", 1e3),
                 ("e2e_p50_s", "e2e50 s", 1), ("throughput_tok_s", "tok/s", 1), ("prefix_hit_rate", "hit", 1),
                 ("escalation_rate", "esc", 1), ("preemptions", "preempt", 1), ("reroutes", "reroutes", 1),
                 ("num_requests", "reqs ok", 1),
                 ("num_failed", "failed", 1), ("quality_reference_logprob", "quality", 1))


def format_table(result: dict[str, Any]) -> str:
    header = f"{'system':<18}" + "".join(f"{label:>11}" for _, label, _ in TABLE_COLUMNS)
    lines = [header, "-" * len(header)]
    for name, m in result["systems"].items():
        cells = []
        for key, _, scale in TABLE_COLUMNS:
            value = m.get(key)
            cells.append(f"{'-':>11}" if value is None else f"{value * scale:>11.3f}" if isinstance(value, float)
                         else f"{value:>11}")
        lines.append(f"{name:<18}" + "".join(cells))
    red = result.get("reduction_mean_token_latency")
    if red is not None:
        lines.append(f"mean token latency reduction, mfs vs baseline: {red * 100:.1f}%")
    floor_line = decode_floor_line(result)
    if floor_line:
        lines.append(floor_line)
    failed = {name: m.get("num_failed") for name, m in result["systems"].items() if m.get("num_failed")}
    if failed:
        lines.append(f"requests refused or failed (left out of the latency figures): {failed}")
        paired = paired_line(result)
        if paired:
            lines.append(paired)
    curve = format_curve(result)
    if curve:
        lines += [f"(the rows above: the headline rate, {result.get('headline_rate'):g} sessions/s)", "", curve]
    return "\n".join(lines)


def decode_floor_line(result: dict[str, Any], name: str = "mfs") -> str | None:
    """The decode floors and what they leave for `name`, in words; None when a figure is missing."""
    systems = result["systems"]
    ceiling = (result.get("reduction_ceiling") or {}).get(name)
    floors = {n: systems[n].get("decode_floor_token_latency_s") for n in (name, "baseline") if n in systems}
    if ceiling is None or None in floors.values():
        return None
    return (f"decode floor (each token one solo decode step of its member, no waiting): "
            + ", ".join(f"{n} {v * 1e3:.2f}" for n, v in floors.items())
            + f" ms/token; the most {name}'s token placement allows: a {ceiling * 100:.1f}% reduction")


def paired_line(result: dict[str, Any], name: str = "mfs") -> str | None:
    """`name` against the baseline over the requests both served, in words; None when there is no figure."""
    paired = (result.get("paired_vs_baseline") or {}).get(name)
    if not paired or paired.get("reduction_mean_token_latency") is None:
        return None
    return (f"over the {paired['num_requests']} requests both served: {paired['mean_token_latency_s'] * 1e3:.2f} vs "
            f"{paired['baseline_mean_token_latency_s'] * 1e3:.2f} ms/token, "
            f"reduction {paired['reduction_mean_token_latency'] * 100:.1f}%")
