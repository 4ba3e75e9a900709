"""Native CPU kernels of the local engine: C sources under engines/local/native/, compiled on first use with the
machine's C compiler into a per-user cache, called through ctypes (which releases the GIL during the call).

Why a C file and not a torch extension: it needs no torch headers or ninja (compiles in under half a second here), it is
built for the CPU it runs on (-march=native), and where no compiler exists the engine keeps its torch path and
says so in one line. MFS_KERNEL_CACHE sets the cache folder (default ~/.cache/mfs/kernels).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("mfs.engine")

_SOURCE_DIR = Path(__file__).with_name("native")
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-std=c11")
_loaded: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("MFS_KERNEL_CACHE") or Path.home() / ".cache" / "mfs" / "kernels")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_signature() -> str:
    """-march=native builds for this CPU: the cache key includes its model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    wanted = [next((line for line in lines if line.startswith(k)), "") for k in ("model name", "flags")]
    return platform.machine() + "\n" + "\n".join(wanted)


def _build(name: str, compiler: str) -> Path:
    """Compiles native/<name>.c unless an identical build (same source and headers, compiler, flags, machine) is
    cached."""
    source = _SOURCE_DIR / f"{name}.c"
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    headers = [h.read_bytes() for h in sorted(_SOURCE_DIR.glob("*.h"))]      # what the sources #include
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, version.encode(), " ".join(_FLAGS).encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:                     # a read-only home: build beside the other temporary files
        folder = Path(tempfile.gettempdir()) / f"mfs-kernels-{os.getuid()}"
        folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{name}-{key}.so"
    if target.exists():
        return target
    # build beside the target and rename: processes starting together never load a half-written library
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *_FLAGS, "-o", str(built), str(source), "-lm"],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {source.name}: {' '.join(result.stderr.split())[-300:]}")
        os.replace(built, target)
    return target


def load(name: str) -> ctypes.CDLL | None:
    """The compiled library, or None (logged once, one line) where it cannot be built on this machine."""
    if name not in _loaded:
        library = None
        compiler = _compiler()
        try:
            if compiler is None:
                raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
            library = ctypes.CDLL(str(_build(name, compiler)))
        except (OSError, RuntimeError) as exc:
            log.warning("native kernel %s unavailable (%s): the engine uses its torch path", name, exc)
        _loaded[name] = library
    return _loaded[name]
