"""Optional dependencies: a command whose extra is missing says so in one line (orchestrator/serve/optional.py)."""
from __future__ import annotations

import sys

import pytest

from orchestrator.serve import cli, optional


def test_missing_message_names_the_extra_for_optional_modules_only():
    exc = ModuleNotFoundError("No module named 'tritonclient.grpc'", name="tritonclient.grpc")
    assert optional.missing_message(exc, "mfs serve") == \
        "mfs serve needs the optional package tritonclient: pip install 'mfs-serve[triton]'"
    assert optional.missing_message(ModuleNotFoundError(name="torch"), "mfs serve") is None
    with pytest.raises(ModuleNotFoundError) as info:
        optional.require("surely_not_a_module_here", "mfs x")
    assert info.value.name == "surely_not_a_module_here"


def test_a_subcommand_missing_its_extra_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "needs_extra_cmd.py").write_text("import mfs_test_missing_dep\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(optional.EXTRAS, "mfs_test_missing_dep", "bench")
    monkeypatch.setitem(cli.SUBCOMMANDS, "needs-extra", ("needs_extra_cmd", "a command with a missing extra"))
    assert cli.main(["needs-extra"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mfs needs-extra needs the optional package mfs_test_missing_dep: pip install 'mfs-serve[bench]'"]
    # a missing module that no extra brings is a broken install: its error is not swallowed
    (tmp_path / "broken_cmd.py").write_text("import mfs_test_not_an_extra\n")
    monkeypatch.setitem(cli.SUBCOMMANDS, "broken", ("broken_cmd", "a broken command"))
    with pytest.raises(ModuleNotFoundError):
        cli.main(["broken"])
    sys.modules.pop("needs_extra_cmd", None)
