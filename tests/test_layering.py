"""The architecture's import rules, enforced by scanning imports (docs/ARCHITECTURE.md)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The pure core: policy and bookkeeping only.
CORE = ["types", "config", "family", "block_hash", "page_pool", "kv_cache", "complexity", "router",
        "escalation", "scheduler", "sequence", "tiers", "events", "errors", "engine_api"]
FORBIDDEN_IN_CORE = ("torch", "engines", "orchestrator.server", "orchestrator.serving", "fastapi", "uvicorn",
                     "httpx", "tritonclient", "socket", "requests")


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_core_imports_no_engine_server_or_torch():
    for name in CORE:
        path = ROOT / "orchestrator" / f"{name}.py"
        assert path.is_file(), f"core module {name} missing"
        bad = {imp for imp in imports_of(path) if imp.split(".")[0] in FORBIDDEN_IN_CORE or imp in FORBIDDEN_IN_CORE}
        assert not bad, f"orchestrator/{name}.py imports {sorted(bad)}"


def test_engines_import_only_core_types_from_orchestrator():
    allowed = {"orchestrator.types", "orchestrator.family", "orchestrator.config", "orchestrator.errors",
               "orchestrator.engine_api"}
    for path in (ROOT / "engines" / "local").glob("*.py"):
        orch = {imp for imp in imports_of(path) if imp.startswith("orchestrator")}
        assert orch <= allowed, f"{path.relative_to(ROOT)} imports {sorted(orch - allowed)}"


def test_dashboard_talks_to_the_system_only_over_http_and_files():
    for path in (ROOT / "dashboard").glob("*.py"):
        bad = {imp for imp in imports_of(path) if imp.split(".")[0] in ("engines", "torch")
               or imp in ("orchestrator.scheduler", "orchestrator.serving")}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
