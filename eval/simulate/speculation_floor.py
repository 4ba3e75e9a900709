"""What draft-target speculation can give at best on a step table's costs: per larger member, its token latency
for draft lengths k = 0..max_k at a few batch sizes, with the smallest member drafting (acceptance.pairs_of).

Per k, two floors and an estimate, each for a batch of `batch` requests at `context` tokens, every step a pure
decode step:
  drafts on the path   (k draft forwards + one verify of k + 1 rows) / tokens per verify: what the core's
                       speculation costs when the drafts run before the verify on the target's own device, with
                       the draft forwards at their cheapest (one row each: no catch-up rows, nothing else in them)
  drafts hidden        one verify / tokens per verify: what it would cost if drafting took no time on the target's
                       path at all (the most any overlap of drafting with verification could give)
  drafts ahead         an estimate for drafting on other devices during the verify (post-verify drafting, as in
                       PEARL): the drafter continues k tokens past its own drafts while the target verifies; they
                       stand as the next round's drafts only when the round accepted every draft and the target's
                       own token matched the drafter's next (a^(k+1)), else the next round waits for k new draft
                       forwards: a round costs max(verify, k draft forwards) then, verify + k draft forwards
                       otherwise, per tokens per verify; the draft forwards priced as in this table
Tokens per verify: 1 + a + ... + a^k, a the pair's per-token acceptance (acceptance.py: published figures for a
paper-scale family). No queueing, no prefill, no scheduling: a floor, which serving under load only raises.

With --result (`mfs simulate --rate R --out` files, whose per_request rows it reads) and --target, it also says,
per file, what token latency the requests that reached the largest member would need for `system` to be --target
below the baseline's mean token latency, the other requests kept at what they took: set against the floors,
whether any speculation can reach the target there. From the file's step profile (simulation.step_profile) it
adds what the largest member's steps gave in the run, for `system` and the baseline: the batch a decoding request
saw, the device time it waited per token with and without the prompt prefill in those steps, and the floor at
the system's own batch and context.

    python -m eval.simulate.speculation_floor --table eval/simulate/tables/llama3.1_h200_sxm_trtllm_tp2-2.json
    python -m eval.simulate.speculation_floor --table ... --result r1.json r2.json --target 0.561
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from eval.simulate.acceptance import acceptance_table, tokens_per_verify
from eval.simulate.cost_model import BatchShape, TableCostModel
from eval.simulate.step_table import StepTable, load_table

DEFAULT_BATCHES = (1, 8, 32)
DEFAULT_CONTEXT = 1024
DEFAULT_MAX_K = 8


def family_of(path: Path, table: StepTable) -> str:
    """The family a step table file describes: its name up to the GPU (setup.py names them
    {family}_{gpu}_{backend}_tp....json)."""
    marker = f"_{table.gpu}_" if table.gpu else None
    if marker is None or marker not in path.name:
        raise ValueError(f"{path.name}: cannot tell the family from the file name; pass --family")
    return path.name.split(marker)[0]


def floors(table: StepTable, family: str, batches: tuple[int, ...] = DEFAULT_BATCHES,
           context: int = DEFAULT_CONTEXT, max_k: int = DEFAULT_MAX_K,
           acceptance_override: float | None = None) -> list[dict[str, Any]]:
    """Per larger member and batch size: the token latency (ms) at each k of each floor, and the best k of each."""
    cost = TableCostModel(table)
    names = list(table.members)
    acceptance = acceptance_table(family, names, acceptance_override)
    drafter, rows = names[0], []
    for target in names[1:]:
        a = acceptance.of(f"{drafter}->{target}").greedy
        for batch in batches:
            decode_s = cost.batch_s(BatchShape(drafter, (context,) * batch, ()))
            plain_ms = cost.batch_s(BatchShape(target, (context,) * batch, ())) * 1e3
            on_path, hidden, ahead = [plain_ms], [plain_ms], [plain_ms]
            for k in range(1, max_k + 1):
                verify_s = cost.batch_s(BatchShape(target, (), (), verifies=((k + 1, context),) * batch))
                tokens = tokens_per_verify(a, k)
                on_path.append((k * decode_s + verify_s) / tokens * 1e3)
                hidden.append(verify_s / tokens * 1e3)
                ready = a ** (k + 1)
                ahead.append((ready * max(verify_s, k * decode_s) + (1 - ready) * (verify_s + k * decode_s))
                             / tokens * 1e3)
            row: dict[str, Any] = {"drafter": drafter, "target": target, "acceptance": a, "batch": batch,
                                   "context": context, "draft_forward_ms": decode_s * 1e3}
            for name, values in (("on_path", on_path), ("hidden", hidden), ("ahead", ahead)):
                row[f"drafts_{name}_ms"] = values
                row[f"best_k_{name}"] = min(range(len(values)), key=values.__getitem__)
            rows.append(row)
    return rows


def needed(result: dict[str, Any], member: str, target: float, system: str = "mfs") -> dict[str, Any]:
    """The mean token latency the requests that reached `member` would need for `system` to be `target` below the
    baseline's mean token latency, the other requests at what they took (a result file's per_request rows)."""
    systems = result.get("systems", {})
    for name in (system, "baseline"):
        if not systems.get(name, {}).get("per_request"):
            raise ValueError(f"the result has no per_request rows for {name!r} (one `mfs simulate --rate R` run "
                             "with --out keeps them)")

    def served(rows: list[dict[str, Any]]) -> list[tuple[float, bool]]:
        """(token latency, reached `member`) of the requests the headline counts (metrics.RequestRecord.ok)."""
        return [(r["e2e_s"] / r["output_tokens"], member in r["members"]) for r in rows
                if r.get("error") is None and r.get("e2e_s") is not None and r["output_tokens"] > 0]

    ours, base = served(systems[system]["per_request"]), served(systems["baseline"]["per_request"])
    baseline_mean = sum(latency for latency, _ in base) / len(base)
    reached = [latency for latency, hit in ours if hit]
    others = sum(latency for latency, hit in ours if not hit)
    if not reached:
        raise ValueError(f"no request of {system!r} reached {member!r}")
    # mean over all = (others + len(reached) * x) / len(ours) = (1 - target) * baseline_mean
    allowed = ((1 - target) * baseline_mean * len(ours) - others) / len(reached)
    return {"system": system, "member": member, "target": target, "baseline_mean_ms": baseline_mean * 1e3,
            "system_mean_ms": (others + sum(reached)) / len(ours) * 1e3,
            "requests": len(ours), "reached_member": len(reached),
            "member_requests_mean_ms": sum(reached) / len(reached) * 1e3,
            "member_requests_needed_ms": allowed * 1e3}


def at_measured_batch(result: dict[str, Any], member: str, table: StepTable, family: str, max_k: int,
                      system: str = "mfs", acceptance_override: float | None = None) -> dict[str, Any]:
    """What `member`'s steps in the run gave against the floor at the run's own batch and context: per system and
    the baseline, the step profile of the steps that ran `member` alone (simulation.step_profile: the batch a
    decoding request saw, its context, the device time it waited per token, that time less what prompt prefill in
    the same steps added), and the drafts-on-path floor at the system's batch and context, the best k up to
    max_k."""
    cost_model = result.get("simulated", {}).get("cost_model", {})
    out: dict[str, Any] = {"member": member, "mixed_steps": cost_model.get("mixed_steps", "overlap")}
    for name in (system, "baseline"):
        profile = result.get("systems", {}).get(name, {}).get("simulation", {}).get("step_profile")
        if not profile:
            raise ValueError(f"the result has no step profile for {name!r} (simulation.step_profile: a result "
                             "written by this version of `mfs simulate`)")
        if member not in profile:
            raise ValueError(f"{name!r} has no steps that ran {member!r} alone (kinds: {', '.join(profile)})")
        entry = profile[member]
        out[name] = {key: entry[key] for key in ("batch", "mean_context", "tokens_per_request_step", "token_period_ms",
                                                 "token_period_without_prompts_ms", "prompt_tokens", "steps")}
    batch = max(1, round(out[system]["batch"]))
    context = max(1, round(out[system]["mean_context"]))
    row = next(r for r in floors(table, family, (batch,), context, max_k, acceptance_override) if r["target"] == member)
    k = row["best_k_on_path"]
    out["floor"] = {"batch": batch, "context": context, "best_k": k, "drafts_on_path_ms": row["drafts_on_path_ms"][k],
                    "no_speculation_ms": row["drafts_on_path_ms"][0]}
    return out


def print_floors(rows: list[dict[str, Any]], source: str) -> None:
    print(f"speculation floors (SIMULATED costs: {source}); ms per token of the target, k = 0, 1, ...")
    for row in rows:
        head = f"{row['drafter']}->{row['target']} a={row['acceptance']:.3f} batch {row['batch']} ctx {row['context']}"
        print(head)
        for key, best in (("drafts_on_path_ms", "best_k_on_path"), ("drafts_ahead_ms", "best_k_ahead"),
                          ("drafts_hidden_ms", "best_k_hidden")):
            values = " ".join(f"{v:6.2f}" for v in row[key])
            print(f"  {key[:-3].replace('_', ' '):16s} {values}   best k={row[best]}: {row[key][row[best]]:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="what draft-target speculation can give at best on a step "
                                                 "table's costs")
    parser.add_argument("--table", required=True, type=Path, help="an mfs-step-table/1 file (eval/simulate/tables)")
    parser.add_argument("--family", help="the family whose acceptance figures apply (default: from the file name)")
    parser.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)),
                        help="batch sizes, comma-separated (default %(default)s)")
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="tokens attended (default %(default)s)")
    parser.add_argument("--max-k", type=int, default=DEFAULT_MAX_K, help="largest draft length (default %(default)s)")
    parser.add_argument("--acceptance", type=float,
                        help="per-token acceptance of every pair instead of the family's figures (a sweep point)")
    parser.add_argument("--result", type=Path, nargs="+",
                        help="`mfs simulate --rate R --out` files with per_request rows (one check each)")
    parser.add_argument("--target", type=float, default=0.561,
                        help="the reduction against the baseline to check with --result (default %(default)s)")
    parser.add_argument("--system", default="mfs", help="the system of --result to check (default %(default)s)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here too")
    args = parser.parse_args(argv)
    try:
        table = load_table(args.table)
        family = args.family or family_of(args.table, table)
        batches = tuple(int(b) for b in args.batches.split(",") if b.strip())
        if not batches or min(batches) < 1 or args.context < 1 or args.max_k < 1:
            raise ValueError("--batches, --context and --max-k must be positive")
        if not 0 < args.target < 1:
            raise ValueError(f"--target {args.target}: a reduction is in (0, 1)")
        rows = floors(table, family, batches, args.context, args.max_k, args.acceptance)
        checks = []
        largest = list(table.members)[-1]
        for path in args.result or ():
            result = json.loads(path.read_text())
            check = needed(result, largest, args.target, args.system)
            if any(result.get("systems", {}).get(name, {}).get("simulation", {}).get("step_profile")
                   for name in (args.system, "baseline")):
                check["measured"] = at_measured_batch(result, largest, table, family, args.max_k, args.system,
                                                      args.acceptance)
            checks.append({"result": path.name, **check})
    except (OSError, ValueError, KeyError) as exc:
        print(f"speculation_floor: {exc}", file=sys.stderr)
        return 2
    print_floors(rows, table.source)
    for check in checks:
        print(f"{check['result']}: {check['system']} {check['system_mean_ms']:.2f} ms mean token latency against the "
              f"baseline's {check['baseline_mean_ms']:.2f}; the {check['reached_member']} of {check['requests']} "
              f"requests that reached {check['member']} take {check['member_requests_mean_ms']:.2f} ms per token and "
              f"would need {check['member_requests_needed_ms']:.2f} for {check['target']:.1%} below")
        m = check.get("measured")
        if m is None:
            print("  (no step profile in this file: it predates simulation.step_profile)")
            continue
        for name in (check["system"], "baseline"):
            e = m[name]
            print(f"  {name}: {m['member']}'s steps: batch {e['batch']:.1f} at context {e['mean_context']:.0f}, "
                  f"{e['tokens_per_request_step']:.2f} tokens a request a step; a decoding request waited "
                  f"{e['token_period_ms']:.2f} ms of device time per token, {e['token_period_without_prompts_ms']:.2f} "
                  f"without the prompt prefill in those steps")
        f = m["floor"]
        print(f"  floor at {check['system']}'s batch {f['batch']} and context {f['context']} (drafts on the path, "
              f"no prompts, no queueing): {f['drafts_on_path_ms']:.2f} ms at k = {f['best_k']} "
              f"({f['no_speculation_ms']:.2f} without speculation)")
    if args.out is not None:
        args.out.write_text(json.dumps({"format": "mfs-speculation-floor/1", "simulated": True,
                                        "cost_model": table.source, "table": args.table.name, "family": family,
                                        "floors": rows, "needed": checks}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
