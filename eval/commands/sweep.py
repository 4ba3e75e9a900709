"""`python -m eval.commands.sweep`: the bench sweeps (eval/bench/sweep.py), each bench as `mfs bench` runs it
(eval/commands/bench.py: the baseline split re-scored on a simulated pilot)."""
from __future__ import annotations

import sys

from eval.bench import sweep
from eval.commands.bench import run_bench


def main(argv: list[str] | None = None) -> int:
    return sweep.main(argv, run=run_bench)


if __name__ == "__main__":
    sys.exit(main())
