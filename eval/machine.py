"""The machine a result was produced on, recorded as `settings.machine` by `mfs bench` and `mfs simulate` alike.

Timings are this machine's (measured figures, and the wall time of a simulation), so every result says which CPU
and how many cores ran it. `python -m eval.simulate.compare_runs` skips the whole `machine` field: it never holds a
simulated figure.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")


def machine(cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """Python, torch and the CPU: its model, logical and physical core counts and the cores this process may use.

    torch is described as already imported (bench); a process that has not imported it (simulate, which never
    needs it) gets its installed version only, rather than paying for the import."""
    text = _read(cpuinfo)
    torch = sys.modules.get("torch")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__ if torch is not None else _installed_version("torch"),
        "cpu_model": cpu_model(text),
        "cpu_count": os.cpu_count(),                    # logical cores (hardware threads) of the machine
        "cpu_physical_cores": physical_cores(text),
        "cpu_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "cuda": torch.cuda.is_available() if torch is not None else None,
    }


def cpu_model(cpuinfo_text: str) -> str | None:
    """/proc/cpuinfo's first 'model name' (x86 Linux); else platform.processor(), else the architecture."""
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or None


def physical_cores(cpuinfo_text: str) -> int | None:
    """Distinct (physical id, core id) pairs of /proc/cpuinfo; psutil's count where those are missing (not x86
    Linux); None when neither says."""
    cores, physical, core = set(), None, None
    for line in [*cpuinfo_text.splitlines(), ""]:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "physical id":
            physical = value.strip()
        elif key == "core id":
            core = value.strip()
        elif not key:                                    # a blank line ends one processor's block
            if core is not None:
                cores.add((physical, core))
            physical, core = None, None
    if cores:
        return len(cores)
    try:
        import psutil
    except ImportError:
        return None
    return psutil.cpu_count(logical=False)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
