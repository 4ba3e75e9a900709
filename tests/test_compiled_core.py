"""The compiled core (eval/simulate/compiled.py, build_scripts/compile_core.py): a build made by mypyc from
the sources gives the same simulation, byte for byte, and a build that no longer matches the sources is refused."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from build_scripts.compile_core import compile_core
from eval.simulate import cli as sim_cli
from eval.simulate.compare_runs import differences
from eval.simulate import compiled

ROOT = Path(__file__).resolve().parent.parent
# Small modules, one per package that activates a build, and the static split's pool (a compiled PagePool's
# subclass is compiled with it); the whole set takes minutes of C compiling; its figures equal the interpreted
# run's: docs/SIMULATOR.md, "Speed"
SUBSET = ("orchestrator.core.page_pool", "eval.baseline.split_pool", "eval.simulate.clock")


def test_every_compiled_module_exists_and_never_reads_its_own_file():
    for module in compiled.MODULES:
        source = compiled.source_path(module).read_text()
        # an extension's __file__ lies in the build folder: data found next to the source would be missed
        assert "__file__" not in source, module


def test_a_stale_build_is_refused_in_one_line_and_the_sources_are_used(tmp_path, monkeypatch, capsys):
    manifest = {"python": sys.implementation.cache_tag, "modules": list(SUBSET), "sources": compiled.source_digests()}
    (tmp_path / compiled.MANIFEST).write_text(json.dumps(manifest))
    assert compiled.stale_reason(tmp_path) is None
    # a module the build did not compile changed: its types are compiled into the callers, so it counts too
    manifest["sources"]["orchestrator/core/config.py"] = "0" * 64
    (tmp_path / compiled.MANIFEST).write_text(json.dumps(manifest))
    assert "config.py changed" in compiled.stale_reason(tmp_path)
    monkeypatch.setenv(compiled.ENV, str(tmp_path))
    monkeypatch.setattr(compiled, "_checked", {})
    paths = {package: list(importlib.import_module(package).__path__) for package in compiled.packages()}
    assert compiled.activate() is False
    assert {package: list(importlib.import_module(package).__path__) for package in paths} == paths
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stale" in err[0] and "using the Python sources" in err[0]
    del manifest["sources"]["orchestrator/core/config.py"]            # a source added since: stale as well
    (tmp_path / compiled.MANIFEST).write_text(json.dumps(manifest))
    assert "config.py changed" in compiled.stale_reason(tmp_path)
    manifest["python"] = "cpython-0"
    (tmp_path / compiled.MANIFEST).write_text(json.dumps(manifest))
    assert "built for cpython-0" in compiled.stale_reason(tmp_path)
    manifest["python"], manifest["modules"] = sys.implementation.cache_tag, ["orchestrator.serve.server"]
    (tmp_path / compiled.MANIFEST).write_text(json.dumps(manifest))
    assert "does not compile" in compiled.stale_reason(tmp_path)
    assert "no build" in compiled.stale_reason(tmp_path / "missing")


def test_an_up_to_date_build_is_refused_once_its_modules_were_imported_from_the_sources(tmp_path, monkeypatch, capsys):
    manifest = {"python": sys.implementation.cache_tag, "modules": list(SUBSET), "sources": compiled.source_digests()}
    (tmp_path / compiled.MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.setenv(compiled.ENV, str(tmp_path))
    monkeypatch.setattr(compiled, "_checked", {})
    assert "orchestrator.core.page_pool" in sys.modules          # this test process imported the sources already
    assert compiled.activate() is False
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already imported from the sources" in err[0]
    import orchestrator.core

    assert str(tmp_path / "orchestrator" / "core") not in orchestrator.core.__path__


def test_the_core_package_activates_nothing():
    source = (ROOT / "orchestrator" / "core" / "__init__.py").read_text()
    assert "import" not in source and "compiled" not in source


def test_compiled_core_flag_without_a_build_says_how_to_make_one(tmp_path, monkeypatch):
    monkeypatch.delenv(compiled.ENV, raising=False)
    monkeypatch.setattr(compiled, "DEFAULT_DIR", tmp_path / "none")
    with pytest.raises(SystemExit, match="make compile-core"):
        sim_cli.use_compiled_core()


def _simulate(out: Path, env: dict[str, str]) -> dict:
    command = [sys.executable, "-m", "orchestrator.serve.cli", "simulate", "--family", "tiny", "--cost-model", "measured",
               "--quick", "--seed", "0", "--systems", "mfs,baseline", "--no-progress", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


def test_a_compiled_build_simulates_exactly_as_the_sources(tmp_path):
    build = compile_core(tmp_path / "build", quiet=True, modules=SUBSET)
    assert compiled.stale_reason(build) is None
    env = {k: v for k, v in os.environ.items() if k != compiled.ENV}
    python = _simulate(tmp_path / "python.json", env)
    fast = _simulate(tmp_path / "compiled.json", {**env, compiled.ENV: str(build)})
    assert python["simulated"]["core"] == {"compiled_modules": []}
    assert fast["simulated"]["core"] == {"compiled_modules": sorted(SUBSET)}
    assert differences(python, fast) == []
