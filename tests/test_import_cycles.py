"""No import circles among the project's modules: every import, at module level or inside a function
(a deferred import still ties the two modules together), is an edge of one graph, which must be acyclic."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("orchestrator", "engines", "eval", "build_scripts", "dashboard")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name an import statement in the file can load: 'from a.b import c' may load a.b or a.b.c."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: resolve against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = package[:len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(path, module):
            # The module a name refers to is its longest project-module prefix ('a.b.C' -> 'a.b').
            parts = name.split(".")
            for end in range(len(parts), 0, -1):
                candidate = ".".join(parts[:end])
                if candidate in modules:
                    targets.add(candidate)
                    break
        # Package __init__ files are empty here; an edge to one is not a dependency on its siblings.
        graph[module] = {t for t in targets if t != module and modules[t].name != "__init__.py"}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_circle_through_a_deferred_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
    # A function-level import is an edge too.
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from orchestrator.serve.server import Edge\n")
    assert "orchestrator.serve.server.Edge" in imported_names(source, "x.m")


def test_the_graph_sees_known_edges():
    graph = import_graph()
    assert "orchestrator.core.scheduler" in graph["orchestrator.core.engine_core"]
    assert "orchestrator.serve.triton_serving" in graph["orchestrator.serve.factory"]   # a deferred import
    assert len(graph) >= 60


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)
