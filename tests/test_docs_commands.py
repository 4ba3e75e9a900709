"""Every `mfs ...` / `build-engines ...` command in the guides' bash blocks parses with the real CLI (README's own
commands: tests/test_examples.py). Continued lines are joined; `$S` stands for a trace seed; a command holding
`...` is an abbreviation of the one above it and is skipped."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_examples import COMMAND, assert_all_parse

DOCS = Path(__file__).resolve().parents[1] / "docs"
GUIDES = ("getting-started.md", "BENCHMARKS.md", "SIMULATOR.md")


def guide_commands(name: str) -> list[str]:
    found = []
    for block in re.findall(r"```bash\n(.*?)```", (DOCS / name).read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            match = COMMAND.match(line.strip())
            if match:
                command = match.group(1).strip().removesuffix("&").strip().replace("$S", "0")
                if "..." not in command.split():
                    found.append(command)
    return found


@pytest.mark.parametrize("name", GUIDES)
def test_every_command_in_the_guides_parses(name):
    found = guide_commands(name)
    assert found, f"docs/{name} has no mfs command in a bash block"
    assert_all_parse(found, f"docs/{name}")


def test_getting_started_lists_exactly_the_extras_of_pyproject():
    import tomllib

    extras = tomllib.loads((DOCS.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    rows = re.findall(r"^\| `([\w-]+)` \| (.*?) \| (.*?) \|$", (DOCS / "getting-started.md").read_text(), flags=re.M)
    assert sorted(name for name, _, _ in rows) == sorted(extras)
    for name, _, brings in rows:
        for requirement in extras[name]:
            project = re.split(r"[\[<>=;\s]", requirement, maxsplit=1)[0]
            if project == "mfs-serve":                                    # the test extra names the others
                continue
            assert project in brings or name == "test", f"docs/getting-started.md: extra {name} lacks {project}"
