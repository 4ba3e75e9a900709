"""The compiled core: the simulator's hot modules (the core's and its own) built to C extensions by mypyc
(build_scripts/compile_core.py), used instead of their Python sources when MFS_COMPILED_CORE names a build that
matches those sources. Standard library only: it runs before any compiled module is imported.

The sources stay the one definition: a build is a copy of them compiled as is (mypyc keeps Python's semantics for
type-checked code; `mfs simulate` gives byte-identical JSON either way, tests/test_compiled_core.py checks it),
and a build is refused with one line, not used, once any source of the two packages changed since it was made.
Nothing is compiled into the source tree, and only the simulator activates a build: tests, `mfs serve` and the
bench import the Python sources. `mfs simulate --compiled-core` sets the variable and re-executes itself.

Activation: the simulator's package (eval/simulate/__init__.py) calls activate() when it is first imported, which
puts the build's folder for each package of MODULES first in that package's __path__, so `import
orchestrator.core.scheduler` finds the extension there and every module that was not compiled still comes from the
sources. A process that imported one of MODULES from its source before that keeps the sources (one line says so):
compiled and Python copies of the same types cannot be mixed.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

ENV = "MFS_COMPILED_CORE"
REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO / "build" / "compiled_core"
MANIFEST = "manifest.json"

# What is compiled: the per-token and per-arrival path of a simulation (docs/SIMULATOR.md, "Speed").
# Every module here type-checks under mypy (mypyc refuses a module that does not), and none reads its own
# __file__ (an extension's __file__ is in the build folder).
MODULES = (
    "orchestrator.core.page_pool", "orchestrator.core.kv_cache", "orchestrator.core.sequence",
    "orchestrator.core.scheduler", "orchestrator.core.admission", "orchestrator.core.batching",
    "orchestrator.core.handover", "orchestrator.core.lifecycle", "orchestrator.core.placement",
    "orchestrator.core.preemption", "orchestrator.core.request_queue", "orchestrator.core.reservation",
    "orchestrator.core.snapshot", "orchestrator.core.parts", "orchestrator.core.escalation", "orchestrator.core.tiers",
    "orchestrator.core.host_tier", "orchestrator.core.block_hash", "orchestrator.core.complexity",
    "orchestrator.core.events",
    "orchestrator.core.types", "orchestrator.core.kv_layout", "orchestrator.core.router",
    "orchestrator.core.routing_inputs", "orchestrator.core.member_turns",
    "orchestrator.core.speculation", "orchestrator.core.draft_length", "orchestrator.core.demand",
    "eval.baseline.deployments", "eval.baseline.split_pool",
    "eval.simulate.executor", "eval.simulate.clock", "eval.simulate.node", "eval.simulate.fleet",
    "eval.simulate.confidence", "eval.simulate.escalation_model", "eval.simulate.cost_model",
    "eval.simulate.step_profile",
)


def source_path(module: str, root: Path = REPO) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".py")


# Every source a build depends on: the compiled modules and what they import (types declared there are compiled
# into their callers: a field turned from int to float would fail at run time), i.e. the two packages entire.
PACKAGES = ("orchestrator", "eval")


def source_digests(root: Path = REPO) -> dict[str, str]:
    """Relative path -> sha256 of every .py file of PACKAGES (what a build was made from)."""
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for package in PACKAGES for path in sorted((root / package).rglob("*.py"))
            if "__pycache__" not in path.parts}


def build_dir() -> Path | None:
    """The folder MFS_COMPILED_CORE names ("1": build/compiled_core), or None when it is unset or empty."""
    value = os.environ.get(ENV, "").strip()
    if not value or value == "0":
        return None
    return DEFAULT_DIR if value == "1" else Path(value)


def stale_reason(directory: Path) -> str | None:
    """Why the build in `directory` cannot stand for the sources (None: it can)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no build in {directory} (run `make compile-core`)"
    if manifest.get("python") != sys.implementation.cache_tag:
        return f"{directory} was built for {manifest.get('python')}, this is {sys.implementation.cache_tag}"
    modules = manifest.get("modules") or []
    if not modules:
        return f"{directory} lists no compiled module (an older build; run `make compile-core`)"
    unknown = [m for m in modules if m not in MODULES]
    if unknown:
        return f"{directory} holds modules this version does not compile ({', '.join(unknown)})"
    built, now = manifest.get("sources", {}), source_digests()
    changed = sorted(f for f in built.keys() | now.keys() if built.get(f) != now.get(f))
    if changed:
        return (f"{directory} is stale ({', '.join(Path(f).name for f in changed[:3])}"
                f"{' and more' if len(changed) > 3 else ''} changed since it was built; run `make compile-core`)")
    return None


_checked: dict[Path, str | None] = {}


def packages() -> list[str]:
    """The packages that hold MODULES (each gets the build's folder for it first in its __path__)."""
    return sorted({module.rsplit(".", 1)[0] for module in MODULES})


def activate() -> bool:
    """Puts the build MFS_COMPILED_CORE names first in the __path__ of every package of MODULES when that build is
    up to date and none of MODULES is loaded yet. Says in one line (stderr) why a named build is not used."""
    import importlib

    directory = build_dir()
    if directory is None:
        return False
    if directory not in _checked:
        _checked[directory] = stale_reason(directory) or _loaded_reason()
        if _checked[directory] is not None:
            print(f"{ENV}: {_checked[directory]}: using the Python sources", file=sys.stderr)
    if _checked[directory] is not None:
        return False
    for package in packages():
        path = importlib.import_module(package).__path__
        folder = str(directory.joinpath(*package.split(".")))
        if folder not in path:
            path.insert(0, folder)
    if str(directory) not in sys.path:
        sys.path.append(str(directory))       # mypyc's shared runtime module lies at the build's top
    return True


def _loaded_reason() -> str | None:
    loaded = sorted(m for m in MODULES if m in sys.modules)
    return f"{', '.join(loaded)} already imported from the sources" if loaded else None


def active_modules() -> list[str]:
    """The modules this process loads (or has loaded) compiled: where the import system finds each one now (an
    extension, not a .py), without importing it (the simulator imports some of them only in its workers)."""
    active = []
    for module in MODULES:
        loaded = sys.modules.get(module)
        origin = getattr(loaded, "__file__", None) if loaded is not None else _origin(module)
        if origin and not str(origin).endswith(".py"):
            active.append(module)
    return sorted(active)


def _origin(module: str) -> str | None:
    import importlib.util

    spec = importlib.util.find_spec(module)      # imports the parent package only
    return spec.origin if spec is not None else None
