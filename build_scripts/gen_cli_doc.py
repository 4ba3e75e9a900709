"""docs/CLI.md, generated from the real argument parsers of `mfs` and `build-engines`.

    python -m build_scripts.gen_cli_doc            # rewrite docs/CLI.md
    python -m build_scripts.gen_cli_doc --check    # exit 1 when docs/CLI.md differs from what the parsers give

The subcommands are read at run time from `orchestrator.serve.cli.SUBCOMMANDS` (name -> module, help); each
module's `add_arguments(parser)` fills a parser built exactly as `mfs NAME` builds it, so the document cannot
drift from the code: tests/test_cli_doc.py regenerates it and compares.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DOC_PATH = REPO_ROOT / "docs" / "CLI.md"
HEADER = """# Command-line reference

Generated from the argument parsers by `python -m build_scripts.gen_cli_doc`; do not edit by hand
(tests/test_cli_doc.py fails when this file and the parsers disagree). Configuration keys are in
docs/CONFIG.md; `--set KEY=VALUE` takes any of them.

`mfs COMMAND --help` prints the same text for one command. `mfs --version` prints the installed version.
"""


def _subcommands() -> dict[str, tuple[str, str]]:
    from orchestrator.serve import cli

    return dict(cli.SUBCOMMANDS)


def _parser_for(prog: str, description: str, module_name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    importlib.import_module(module_name).add_arguments(parser)
    return parser


def _shown_default(action: argparse.Action) -> str:
    """The default as a reader needs it: none for flags and empty values, paths inside the source tree
    relative to its root (so the document is the same in every checkout)."""
    default = action.default
    if action.nargs == 0 or default in (None, False, argparse.SUPPRESS, [], ()):
        return ""
    text = str(default)
    root = str(REPO_ROOT) + "/"
    if text.startswith(root):
        text = text[len(root):]
    return f"`{text}`"


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    """One table row per argument: its flags (or name), its value, its default and its help."""
    rows = []
    for action in parser._actions:   # argparse has no public iterator over a parser's arguments
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            names = ", ".join(f"`{s}`" for s in action.option_strings)
        else:
            names = f"`{action.metavar or action.dest}` (positional)"
        if action.nargs == 0:
            value = ""
        elif action.choices is not None:
            value = " \\| ".join(f"`{c}`" for c in action.choices)
        else:
            value = f"`{action.metavar or action.dest.upper()}`".replace("|", "\\|")
            if action.nargs in ("+", "*"):
                value += " ..."
        shown_default = _shown_default(action)
        if action.required:
            shown_default = "required"
        help_text = (action.help or "").replace("%%", "%").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {names} | {value} | {shown_default} | {help_text} |")
    return rows


def _section(title: str, parser: argparse.ArgumentParser) -> str:
    # No usage line: argparse's wrapping of it differs between Python versions; the table says the same.
    lines = [f"## `{title}`", "", parser.description or "", "",
             "| argument | value | default | what |", "|---|---|---|---|"]
    lines += _option_rows(parser)
    return "\n".join(lines) + "\n"


def render() -> str:
    """The whole document, as the parsers give it now."""
    subcommands = _subcommands()
    parts = [HEADER, "| command | what |", "|---|---|"]
    parts += [f"| [`mfs {name}`](#mfs-{name}) | {help_text} |" for name, (_, help_text) in subcommands.items()]
    parts.append("| [`build-engines`](#build-engines) | family checkpoints -> TensorRT-LLM engines and a Triton "
                 "model repository |")
    text = "\n".join(parts) + "\n"
    for name, (module_name, help_text) in subcommands.items():
        text += "\n" + _section(f"mfs {name}", _parser_for(f"mfs {name}", help_text, module_name))
    build = importlib.import_module("build_scripts.build_engines")
    description = (build.__doc__ or "").strip().splitlines()[0] if build.__doc__ else ""
    text += "\n" + _section("build-engines", _parser_for("build-engines", description, build.__name__))
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m build_scripts.gen_cli_doc", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/CLI.md instead of writing it")
    parser.add_argument("--out", type=Path, default=DOC_PATH, help="where the document goes (default docs/CLI.md)")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run python -m build_scripts.gen_cli_doc", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
