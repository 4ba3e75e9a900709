"""`make compile-core` (`python -m build_scripts.compile_core`): the simulator's hot modules
(eval/simulate/compiled.py MODULES) compiled to C extensions with mypyc into build/compiled_core/.

The sources are copied to a temporary folder and compiled there, so nothing lands in the source tree; the build
folder gets the extensions (in their packages' folders), mypyc's shared runtime module, and a manifest with the
digest of every source of the two packages, against which eval/simulate/compiled.py refuses a stale build.
Needs mypy (the `test` and `fast-sim` extras) and a C compiler with Python's headers.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eval.simulate.compiled import DEFAULT_DIR, MANIFEST, MODULES, REPO, source_digests, source_path


class CompileError(RuntimeError):
    pass


def compile_core(out: Path = DEFAULT_DIR, quiet: bool = False, modules: tuple[str, ...] = MODULES) -> Path:
    """modules: a subset of MODULES (the tests build a few: the whole set takes minutes of C compiling)."""
    if not set(modules) <= set(MODULES):
        raise CompileError(f"not compilable here: {sorted(set(modules) - set(MODULES))}")
    if importlib.util.find_spec("mypyc") is None:
        raise CompileError("mypyc is not installed: pip install 'mypy==2.4.1' (or the project's fast-sim extra)")
    started = time.monotonic()
    digests = source_digests()
    with tempfile.TemporaryDirectory(prefix="mfs-compile-core-") as tmp:
        work = Path(tmp)
        # the packages the compiled modules import (mypy type-checks against them; only MODULES are compiled)
        for package in ("orchestrator", "eval"):
            shutil.copytree(REPO / package, work / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        files = [str(source_path(m, work).relative_to(work)) for m in modules]
        if not quiet:
            print(f"compile-core: mypyc on {len(files)} modules (3-4 minutes of C compiling on 2 cores) ...",
                  flush=True)
        # A module that is not compiled only lends its types to those that are: its own findings (a missing stub
        # package such as yaml's, a dataclass helper typeshed reads otherwise) do not stop a build; every compiled
        # module must still type-check.
        done = subprocess.run([sys.executable, "-m", "mypyc", "--follow-imports=silent", *files], cwd=work,
                              capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise CompileError(f"mypyc failed (exit {done.returncode}):\n{tail}")
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for module in modules:
            package_dir = work.joinpath(*module.split(".")[:-1])
            name = module.rsplit(".", 1)[1]
            built = sorted(package_dir.glob(f"{name}.*.so"))
            if not built:
                raise CompileError(f"mypyc left no extension for {module}")
            target = out.joinpath(*module.split(".")[:-1])
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built[0], target / built[0].name)
        runtime = sorted(work.glob("*__mypyc.*.so"))
        if not runtime:
            raise CompileError("mypyc left no shared runtime module")
        shutil.copy2(runtime[0], out / runtime[0].name)
    if source_digests() != digests:
        shutil.rmtree(out)
        raise CompileError("the sources changed while compiling: run it again")
    import mypy.version

    (out / MANIFEST).write_text(json.dumps({"python": sys.implementation.cache_tag, "mypy": mypy.version.__version__,
                                            "modules": list(modules), "sources": digests}, indent=1))
    if not quiet:
        print(f"compile-core: {len(modules)} modules in {out} ({time.monotonic() - started:.0f} s); "
              f"use them with `mfs simulate --compiled-core` or MFS_COMPILED_CORE=1")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m build_scripts.compile_core", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help=f"build folder (default: {DEFAULT_DIR})")
    args = parser.parse_args(argv)
    try:
        compile_core(args.out)
    except CompileError as exc:
        raise SystemExit(f"compile-core: {exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
