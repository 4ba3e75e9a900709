"""`mfs bench`: eval/bench/cli.py's bench, its baseline split re-scored on a pilot simulated on this machine's
measured cost model (eval/simulate/replay.py measured_split_pilot), so no wall time goes to the pilot."""
from __future__ import annotations

import argparse
from typing import Any

from eval.bench import cli
from eval.bench.cli import BenchSettings, add_arguments  # noqa: F401 (the subcommand's parser)
from eval.simulate.replay import measured_split_pilot


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    return cli.run_bench(settings, split_pilot=measured_split_pilot)


def main(args: argparse.Namespace) -> int:
    return cli.main(args, split_pilot=measured_split_pilot)
