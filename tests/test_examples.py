"""The shipped examples: every config loads and validates, every command in them parses with the real CLI."""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from orchestrator.core.config import load_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# a command line in an example: `mfs SUBCOMMAND ...` or `build-engines ...`, at a line start or after `#   `
COMMAND = re.compile(r"^(?:#\s+)?((?:mfs|build-engines)\s.*?)(?:\s+#.*)?$")


def example_files(pattern: str) -> list[Path]:
    return sorted(EXAMPLES.glob(pattern))


def commands() -> list[tuple[str, str]]:
    found = []
    for path in example_files("*"):
        for line in path.read_text().splitlines():
            match = COMMAND.match(line.strip())
            if match:
                found.append((path.name, match.group(1)))
    return found


def parse(command: str) -> argparse.Namespace:
    """Parses one command with the parser its program uses (mfs: the subcommand's own parser)."""
    from orchestrator.serve.cli import SUBCOMMANDS

    words = shlex.split(command)
    if words[0] == "build-engines":
        module, rest = importlib.import_module("build_scripts.build_engines"), words[1:]
    else:
        assert words[1] in SUBCOMMANDS, f"{command!r}: mfs has no subcommand {words[1]!r}"
        module, rest = importlib.import_module(SUBCOMMANDS[words[1]][0]), words[2:]
    parser = argparse.ArgumentParser(prog=words[0], exit_on_error=False)
    module.add_arguments(parser)
    return parser.parse_args(rest)


@pytest.mark.parametrize("path", example_files("*.yaml"), ids=lambda p: p.name)
def test_every_example_config_loads_and_validates(path):
    config = load_config(path)
    assert config.family


def test_the_cpu_example_is_the_tiny_family_on_the_local_engine():
    config = load_config(EXAMPLES / "tiny-cpu.yaml")
    assert (config.family, config.engine.kind, config.engine.device) == ("tiny", "local", "cpu")
    assert load_config(EXAMPLES / "gpu-triton.yaml").engine.kind == "triton"


def test_every_command_in_the_examples_parses():
    found = commands()
    assert {name for name, _ in found} >= {"tiny-cpu.yaml", "gpu-triton.yaml", "fleet.sh"}
    for name, command in found:
        try:
            parse(command)
        except (argparse.ArgumentError, SystemExit) as exc:
            pytest.fail(f"{name}: {command!r} does not parse: {exc}")


def test_mfs_version_names_the_installed_package(capsys):
    from importlib.metadata import version

    from orchestrator.serve.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mfs {version('mfs-serve')}"


def readme_commands() -> list[str]:
    """`mfs ...` and `build-engines ...` lines of README.md's bash blocks (comments cut)."""
    text = (EXAMPLES.parent / "README.md").read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            match = COMMAND.match(line.strip())
            if match:
                found.append(match.group(1))
    return found


def assert_all_parse(commands: list[str], where: str) -> None:
    """Every command parses with its program's parser (`mfs --version` has none of its own)."""
    for command in commands:
        if command.split()[:2] == ["mfs", "--version"]:
            continue
        try:
            parse(command)
        except (argparse.ArgumentError, SystemExit) as exc:
            pytest.fail(f"{where}: {command!r} does not parse: {exc}")


def test_every_command_in_the_readme_parses():
    found = readme_commands()
    assert any(c.startswith("mfs serve") for c in found) and any(c.startswith("mfs simulate") for c in found)
    assert_all_parse(found, "README")
