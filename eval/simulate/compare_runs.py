"""Determinism check: two `mfs simulate` JSON files must agree on every simulated figure.

    python -m eval.simulate.compare_runs before.json after.json

The simulator is a deterministic function of its inputs (trace, configs, cost model, seeds), so a change that
only makes it faster must leave every figure identical. Only the fields that measure this machine differ
between runs and are skipped: wall and CPU times of the simulation, the trace build and the whole command, the
command line itself, and the machine (settings.machine). Exits 1 and lists the first differences when anything else
differs.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

# Keys whose values are timings of this machine (or the command that was typed), never simulated figures.
# `core`: which build of the core ran (Python sources or the compiled modules), which must not change a figure.
# `machine`: settings.machine (eval/machine.py: Python, torch, the CPU model and its core counts).
MACHINE_KEYS = frozenset({"wall_s", "cpu_s", "trace_build_s", "simulate_s", "command", "core", "machine"})


def differences(a: Any, b: Any, path: str = "", limit: int = 20, skip: frozenset[str] = frozenset()) -> list[str]:
    """Paths where a and b differ (exactly: floats included), skipping MACHINE_KEYS and `skip`; at most `limit`."""
    out: list[str] = []
    _walk(a, b, path, out, limit, MACHINE_KEYS | skip)
    return out


def _walk(a: Any, b: Any, path: str, out: list[str], limit: int, skip: frozenset[str]) -> None:
    if len(out) >= limit:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(dict.fromkeys([*a, *b])):
            if key in skip:
                continue
            if key not in a or key not in b:
                out.append(f"{path}/{key}: only in {'second' if key not in a else 'first'}")
                continue
            _walk(a[key], b[key], f"{path}/{key}", out, limit, skip)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} items vs {len(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{path}[{i}]", out, limit, skip)
    elif a != b or type(a) is not type(b):
        out.append(f"{path}: {a!r} vs {b!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--skip", action="append", default=[], metavar="KEY",
                        help="also skip this key wherever it appears (e.g. settings, when one run built the trace "
                             "and the other replayed it with --trace: the same trace, other command-line settings)")
    args = parser.parse_args(argv)
    with open(args.first) as f:
        first = json.load(f)
    with open(args.second) as f:
        second = json.load(f)
    found = differences(first, second, skip=frozenset(args.skip))
    if found:
        print(f"DIFFERENT: {args.first} vs {args.second}")
        for line in found:
            print(f"  {line}")
        return 1
    print(f"identical (timing fields skipped): {args.first} == {args.second}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
