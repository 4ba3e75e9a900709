"""The architecture's import rules, enforced by scanning imports (docs/ARCHITECTURE.md)."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The pure core (orchestrator/core/): policy and bookkeeping only; it may import the standard library,
# yaml and itself. Everything else (the edge, engines, torch, network clients) is above or beside it.
CORE_DIR = ROOT / "orchestrator" / "core"
ALLOWED_THIRD_PARTY_IN_CORE = {"yaml", "safetensors"}  # config files; checkpoint headers for layer lineages


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_core_imports_only_itself_the_stdlib_and_yaml():
    paths = sorted(CORE_DIR.glob("*.py"))
    assert len(paths) >= 15, "orchestrator/core/ lost its modules"
    for path in paths:
        for imp in imports_of(path):
            top = imp.split(".")[0]
            if imp.startswith("orchestrator."):
                assert imp.startswith("orchestrator.core"), f"{path.relative_to(ROOT)} imports {imp} (above the core)"
            else:
                assert top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY_IN_CORE, \
                    f"{path.relative_to(ROOT)} imports {imp} (not stdlib/yaml)"


def test_engines_import_only_the_core_from_orchestrator():
    paths = sorted((ROOT / "engines").rglob("*.py"))
    # The Triton python-backend model runs the core's EngineCore loop, never LocalServing from the edge.
    assert ROOT / "engines" / "triton" / "python_model" / "model.py" in paths
    for path in paths:
        orch = {imp for imp in imports_of(path) if imp.startswith("orchestrator")}
        assert all(imp.startswith("orchestrator.core") for imp in orch), \
            f"{path.relative_to(ROOT)} imports {sorted(orch)}: engines may use the core only"


def test_dashboard_talks_to_the_system_only_over_http_and_files():
    for path in (ROOT / "dashboard").glob("*.py"):
        bad = {imp for imp in imports_of(path) if imp.split(".")[0] in ("engines", "torch")
               or imp.startswith("orchestrator.core.scheduler") or imp.startswith("orchestrator.serve.serving")}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


# A module path above the core written as data (importlib by name, build lists): eval.*, orchestrator.serve.*
# or their file paths. Docstrings and comments may name them; code may not.
ABOVE_CORE_IN_STRINGS = re.compile(r"\b(eval|orchestrator[./]serve)[./][A-Za-z_]")


def code_strings(path: Path) -> list[str]:
    """Every string constant of the module that is not a docstring."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_core_names_no_eval_or_serve_module_in_its_code():
    offenders = {path.name: hits for path in sorted(CORE_DIR.glob("*.py"))
                 if (hits := [s for s in code_strings(path) if ABOVE_CORE_IN_STRINGS.search(s)])}
    assert not offenders, offenders


def test_the_core_strings_check_sees_a_module_name():
    assert ABOVE_CORE_IN_STRINGS.search("eval.simulate.node") and ABOVE_CORE_IN_STRINGS.search("orchestrator.serve.cli")
    assert ABOVE_CORE_IN_STRINGS.search("eval/simulate/node.py")
    assert not ABOVE_CORE_IN_STRINGS.search("evaluation") and not ABOVE_CORE_IN_STRINGS.search("served by")
