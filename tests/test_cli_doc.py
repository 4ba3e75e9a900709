"""docs/CLI.md is what the parsers give: regenerated here and compared, so a flag added, removed or
re-described without `python -m build_scripts.gen_cli_doc` fails the suite."""
from __future__ import annotations

import argparse

from build_scripts import gen_cli_doc
from orchestrator.serve import cli


def test_cli_doc_matches_the_parsers():
    expected = gen_cli_doc.render()
    current = gen_cli_doc.DOC_PATH.read_text()
    assert current == expected, "docs/CLI.md is out of date: run python -m build_scripts.gen_cli_doc"


def test_every_subcommand_and_flag_is_in_the_doc():
    text = gen_cli_doc.DOC_PATH.read_text()
    for name, (module_name, help_text) in cli.SUBCOMMANDS.items():
        assert f"## `mfs {name}`" in text
        parser = gen_cli_doc._parser_for(f"mfs {name}", help_text, module_name)
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert f"`{flag}`" in text, f"mfs {name} {flag} missing from docs/CLI.md"
    assert "## `build-engines`" in text


def test_check_mode_reports_a_stale_doc(tmp_path):
    stale = tmp_path / "CLI.md"
    stale.write_text("# out of date\n")
    assert gen_cli_doc.main(["--check", "--out", str(stale)]) == 1
    assert gen_cli_doc.main(["--out", str(stale)]) == 0
    assert gen_cli_doc.main(["--check", "--out", str(stale)]) == 0
