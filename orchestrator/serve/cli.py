"""`mfs` command line: a thin dispatcher; each subcommand lives in the module that owns the feature.

Each feature module exposes `add_arguments(parser)` and `main(args) -> int`; imports are lazy so
`mfs --help` stays fast and a missing optional dependency only affects its own subcommand.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from orchestrator.serve.optional import DISTRIBUTION, missing_message

SUBCOMMANDS = {
    "serve": ("orchestrator.serve.server", "OpenAI-compatible server for a model family"),
    "bench": ("eval.commands.bench", "MFS against an independent-deployment baseline on ShareGPT traffic"),
    "simulate": ("eval.simulate.cli", "the real core in virtual time on a cost model (SIMULATED figures)"),
    "demo": ("eval.bench.demo", "replay a short ShareGPT multi-turn set through the tiny family and print a table"),
    "triton-up": ("engines.triton.server_process", "start a real Triton Inference Server on a model repository"),
    "dashboard": ("dashboard.launch", "Streamlit latency and hit-rate dashboard"),
    "fleet": ("orchestrator.serve.fleet", "many `mfs serve` replicas behind the SGLang Model Gateway"),
}


def version() -> str:
    """The installed package's version (a source tree that was never installed says so)."""
    from importlib.metadata import PackageNotFoundError, version as package_version

    try:
        return package_version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (not installed as a package)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mfs", description="MFS: serve a family of LLMs as one model")
    parser.add_argument("-V", "--version", action="version", version=f"mfs {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in ("-V", "--version"):
        print(f"mfs {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        parser.print_help()
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nmfs: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    name, rest = argv[0], argv[1:]
    module_name, help_text = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
        sub_parser = argparse.ArgumentParser(prog=f"mfs {name}", description=help_text)
        module.add_arguments(sub_parser)
        return int(module.main(sub_parser.parse_args(rest)) or 0)
    except ModuleNotFoundError as exc:
        message = missing_message(exc, f"mfs {name}")
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
