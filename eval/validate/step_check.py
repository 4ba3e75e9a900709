"""Checks a step table against real steps: real execute() seconds over the table's prediction, by step kind.

The validation (validate.py) saves every real step of every system (`real_r{rate}.pkl` in its --work-dir: the
shapes of each member batch and the seconds execute() took). On a drifting machine a table timed at another
moment predicts every step off by some factor k; what the table must get right is the relation between kinds of
steps. So the check reports, per kind of decode-only step (one member alone, or nested members merged into one
forward), the median of real / predicted, once with the table's ride_overlap and once with riders priced as
forwards of their own (1.0); and the ride overlap the real merged steps imply,
(real / k - host) / riders with k the single-member steps' median ratio.

    python -m eval.validate.step_check --runs '.cache/mfs/validation/real_r*.pkl' \\
        --table eval/simulate/tables/tiny_measured.json [--system mfs]
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import pickle
import statistics
from collections.abc import Iterable, Sequence

from eval.simulate.cost_model import BatchShape, TableCostModel
from eval.simulate.step_table import StepTable, load_table

Step = tuple[Sequence[BatchShape], float]


def without_riders(table: StepTable) -> StepTable:
    """The same table with every rider priced as a forward of its own (the grid before ride_overlap existed)."""
    return dataclasses.replace(table, members={n: dataclasses.replace(m, ride_overlap=1.0)
                                               for n, m in table.members.items()})


def kind_of(shapes: Sequence[BatchShape]) -> str:
    members = "+".join(sorted(s.member for s in shapes))
    return ("merged " if any(not s.own_forward for s in shapes) else "alone ") + members


def check(steps: Iterable[Step], table: StepTable) -> dict[str, dict[str, float]]:
    """Per decode-only step kind: steps, median real / predicted with ride_overlap (`with`) and without
    (`without`); for merged kinds also `implied_ride_overlap`. Key "k": the single-member steps' median ratio."""
    priced, flat = TableCostModel(table), TableCostModel(without_riders(table))
    by_kind: dict[str, list[tuple[float, float, float, float, float]]] = {}
    for shapes, seconds in steps:
        if not shapes or any(s.prefills for s in shapes):
            continue
        host = sum(flat.batch_s(s) for s in shapes if s.own_forward)
        riders = sum(flat.batch_s(s) for s in shapes if not s.own_forward)
        by_kind.setdefault(kind_of(shapes), []).append(
            (seconds, sum(priced.batch_s(s) for s in shapes), host + riders, host, riders))
    alone = [real / flat_s for kind, rows in by_kind.items() if kind.startswith("alone")
             for real, _, flat_s, _, _ in rows if flat_s > 0]
    k = statistics.median(alone) if alone else None
    out: dict[str, dict[str, float]] = {}
    for kind, rows in sorted(by_kind.items()):
        entry = {"steps": float(len(rows)),
                 "with": statistics.median(r / p for r, p, _, _, _ in rows if p > 0),
                 "without": statistics.median(r / f for r, _, f, _, _ in rows if f > 0)}
        if kind.startswith("merged") and k:
            entry["implied_ride_overlap"] = statistics.median((r / k - h) / d for r, _, _, h, d in rows if d > 0)
        out[kind] = entry
    if k is not None:
        out["k"] = {"steps": float(len(alone)), "with": k, "without": k}
    return out


def load_steps(pattern: str, system: str) -> list[Step]:
    steps: list[Step] = []
    for path in sorted(glob.glob(pattern)):
        with open(path, "rb") as f:
            saved = pickle.load(f)
        steps += [(shapes, seconds) for shapes, seconds in saved["steps"].get(system, {}).get("observations", [])]
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.validate.step_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", required=True, help="glob of the validation's saved real runs (real_r*.pkl)")
    parser.add_argument("--table", default="eval/simulate/tables/tiny_measured.json")
    parser.add_argument("--system", default="mfs")
    args = parser.parse_args(argv)
    steps = load_steps(args.runs, args.system)
    if not steps:
        parser.error(f"no steps of system {args.system!r} in {args.runs}")
    result = check(steps, load_table(args.table))
    print(f"{'step kind':34} {'steps':>6} {'real/table':>11} {'riders as own forward':>22} {'implied ride':>13}")
    for kind, entry in result.items():
        implied = entry.get("implied_ride_overlap")
        print(f"{kind:34} {int(entry['steps']):6d} {entry['with']:11.2f} {entry['without']:22.2f} "
              f"{'' if implied is None else f'{implied:.2f}':>13}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
