"""`mfs triton-up`: runs nvidia-pytriton's tritonserver binary on a model repository, on 127.0.0.1, until stopped."""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
STUB_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"   # the stub must match this interpreter


class TritonNotFoundError(RuntimeError):
    """nvidia-pytriton (which ships the tritonserver binary) is not installed."""


@dataclass(frozen=True, slots=True)
class TritonInstall:
    binary: Path
    libs_dir: Path            # nvidia_pytriton.libs: the binary's bundled shared libraries
    backends_dir: Path        # pytriton/tritonserver/backends
    stubs_dir: Path           # pytriton/tritonserver/python_backend_stubs/<py>

    @classmethod
    def find(cls) -> TritonInstall:
        try:
            import pytriton
        except ImportError as exc:
            raise TritonNotFoundError("nvidia-pytriton is not installed (pip install nvidia-pytriton)") from exc
        server = Path(pytriton.__file__).resolve().parent / "tritonserver"
        install = cls(binary=server / "bin" / "tritonserver", libs_dir=server.parent.parent / "nvidia_pytriton.libs",
                      backends_dir=server / "backends", stubs_dir=server / "python_backend_stubs" / STUB_PYTHON)
        for path in (install.binary, install.backends_dir / "python", install.stubs_dir):
            if not path.exists():
                raise TritonNotFoundError(f"nvidia-pytriton install is incomplete: {path} is missing")
        return install

    def assemble_backends(self, target: Path) -> Path:
        """<target>/python/ = the python backend + the stub for this interpreter (what --backend-directory wants)."""
        python_dir = target / "python"
        if not (python_dir / "triton_python_backend_stub").is_file():
            shutil.copytree(self.backends_dir / "python", python_dir, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
            shutil.copy2(self.stubs_dir / "triton_python_backend_stub", python_dir)
            utils = self.stubs_dir / "triton_python_backend_utils.py"
            if utils.is_file():
                shutil.copy2(utils, python_dir)
        return target


# Default ports: one block apart from `mfs serve` (8000, like vLLM) and `mfs fleet` (8000 and up), since every GPU
# recipe runs Triton and `mfs serve` side by side; the metrics port stays the gRPC port + 1, as in Triton's own
# 8000/8001/8002 (orchestrator/serve/triton_serving.py derives the metrics URL from the gRPC URL that way).
HTTP_PORT, GRPC_PORT, METRICS_PORT = 8100, 8101, 8102


@dataclass(slots=True)
class TritonProcess:
    """One tritonserver process (its own process group) for a repository; a context manager for tests."""

    repo: Path
    grpc_port: int = GRPC_PORT
    http_port: int = HTTP_PORT
    metrics_port: int = METRICS_PORT
    exit_timeout_s: int = 5
    log_path: Path | None = None
    extra_pythonpath: tuple[str, ...] = ()
    quiet: bool = True                 # no log_path: discard the server's output (False: inherit the terminal)
    process: subprocess.Popen | None = field(default=None, init=False)
    _workdir: tempfile.TemporaryDirectory | None = field(default=None, init=False)
    _log_file: object = field(default=None, init=False)

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self, backends_dir: Path, binary: Path) -> list[str]:
        return [str(binary), "--model-repository", str(Path(self.repo).resolve()),
                "--backend-directory", str(backends_dir),
                "--http-address", "127.0.0.1", "--http-port", str(self.http_port),
                "--grpc-address", "127.0.0.1", "--grpc-port", str(self.grpc_port),
                "--metrics-address", "127.0.0.1", "--metrics-port", str(self.metrics_port),
                "--allow-metrics", "true", "--allow-gpu-metrics", "false", "--allow-cpu-metrics", "false",
                "--exit-timeout-secs", str(self.exit_timeout_s), "--log-verbose", "0"]

    def environment(self, install: TritonInstall) -> dict[str, str]:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(install.libs_dir), env.get("LD_LIBRARY_PATH")) if p)
        # The stub runs model.py with the server's environment: it must import torch (this venv) and the project.
        site = [p for p in sys.path if p.endswith("site-packages")]
        parts = [str(PROJECT_ROOT), *self.extra_pythonpath, *site, env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
        env.setdefault("OMP_NUM_THREADS", "1")   # one model per member: keep each stub from taking every core
        return env

    def start(self) -> TritonProcess:
        install = TritonInstall.find()
        self._workdir = tempfile.TemporaryDirectory(prefix="mfs-triton-")
        backends = install.assemble_backends(Path(self._workdir.name) / "backends")
        out = subprocess.DEVNULL if self.quiet else None
        if self.log_path is not None:
            self._log_file = open(self.log_path, "ab")
            out = self._log_file
        self.process = subprocess.Popen(self.command(backends, install.binary), env=self.environment(install),
                                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def is_ready(self) -> bool:
        """HTTP /v2/health/ready: 200 once the server AND every model in the repository are ready."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"tritonserver exited (code {code}) before it was ready{self._log_hint()}")
            if self.is_ready():
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f} s{self._log_hint()}")

    def kill(self) -> None:
        """SIGKILL the whole group (server and python stubs): what a crash looks like to clients."""
        self._signal_group(signal.SIGKILL)
        if self.process is not None:
            self.process.wait()

    def stop(self) -> int | None:
        """SIGTERM (Triton waits up to exit_timeout_s for in-flight requests), then SIGKILL the group."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.exit_timeout_s + 10)
            except subprocess.TimeoutExpired:
                pass
        # Stubs left behind (the server died first) still hold the group: reap them all.
        self._signal_group(signal.SIGKILL)
        self.process.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None
        return self.process.returncode

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)   # start_new_session=True: the group id is the server's pid
        except ProcessLookupError:
            pass

    def _log_hint(self) -> str:
        if self.log_path is None or not Path(self.log_path).is_file():
            return ""
        tail = Path(self.log_path).read_text(errors="replace").splitlines()[-15:]
        return f"; log {self.log_path}:\n" + "\n".join(tail)

    def __enter__(self) -> TritonProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ----------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", required=True, type=Path, help="Triton model repository (build-engines --out DIR/triton_repo)")
    parser.add_argument("--grpc-port", type=int, default=GRPC_PORT,
                        help="the Triton URL of `mfs serve --engine triton`")
    parser.add_argument("--http-port", type=int, default=HTTP_PORT,
                        help="Triton's HTTP API (not 8000: `mfs serve` listens there)")
    parser.add_argument("--metrics-port", type=int, default=METRICS_PORT, help="Prometheus metrics (gRPC port + 1)")
    parser.add_argument("--exit-timeout-s", type=int, default=5, help="how long SIGTERM waits for in-flight requests")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument("--log", type=Path, default=None, help="server log file (default: this terminal)")


def main(args: argparse.Namespace) -> int:
    if not Path(args.repo).is_dir():
        print(f"mfs triton-up: repository {args.repo} is not a directory", file=sys.stderr)
        return 2
    server = TritonProcess(repo=args.repo, grpc_port=args.grpc_port, http_port=args.http_port,
                           metrics_port=args.metrics_port, exit_timeout_s=args.exit_timeout_s, log_path=args.log,
                           quiet=False)
    stopping = False

    def on_signal(signum, _frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.start()
        deadline = time.monotonic() + args.ready_timeout_s
        while not stopping and not server.is_ready():
            if server.process.poll() is not None or time.monotonic() > deadline:
                print(f"mfs triton-up: tritonserver failed to become ready (exit {server.process.poll()})",
                      file=sys.stderr)
                return 1
            time.sleep(0.25)
        if not stopping:
            print(f"triton ready: grpc {server.grpc_url}, http 127.0.0.1:{server.http_port}, "
                  f"metrics {server.metrics_url}", flush=True)
        while not stopping and server.process.poll() is None:
            time.sleep(0.25)
        if not stopping:
            print(f"mfs triton-up: tritonserver exited with code {server.process.returncode}", file=sys.stderr)
            return 1
        return 0
    except TritonNotFoundError as exc:
        print(f"mfs triton-up: {exc}", file=sys.stderr)
        return 2
    finally:
        server.stop()
