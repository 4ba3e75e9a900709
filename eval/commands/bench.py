"""`mfs bench`: eval/bench/cli.py's bench, its baseline split re-scored on a pilot simulated on this machine's
measured cost model (eval/simulate/replay.py measured_split_pilot), so no wall time goes to the pilot; with --peer,
MFS against real peer software over HTTP (eval/bench/peer_bench.py)."""
from __future__ import annotations

import argparse
from typing import Any

from eval.bench import cli, peer_bench
from eval.bench.cli import BenchSettings
from eval.simulate.replay import measured_split_pilot


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's parser: the bench's flags, then the real peer's (eval/bench/peer_bench.py)."""
    cli.add_arguments(parser)
    peer_bench.add_arguments(parser)


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    return cli.run_bench(settings, split_pilot=measured_split_pilot)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "peer", None):
        return peer_bench.main(args)
    return cli.main(args, split_pilot=measured_split_pilot)
