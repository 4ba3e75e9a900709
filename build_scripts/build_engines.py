"""`build-engines`: a family's checkpoints -> TensorRT-LLM engines (or local-engine models) + one Triton repository."""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

from build_scripts import triton_repo
from build_scripts.trtllm_commands import CONVERT_SCRIPT, BuildSettings, MemberBuild, member_build, shell_line
from orchestrator.core.config import MFSConfig
from orchestrator.core.family import FamilyError, FamilySpec, dtype_bytes, load_family

DEFAULT_BUDGET_GB = {"tensorrtllm": 16.0, "python": 0.0625}   # python: the local engine's default 64 MB arena
GIB = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", required=True, help="family directory or shipped family name (e.g. tiny)")
    parser.add_argument("--out", required=True, type=Path, help="output directory (engines, logs, triton_repo/)")
    parser.add_argument("--backend", choices=("tensorrtllm", "python"), default="tensorrtllm")
    parser.add_argument("--dry-run", action="store_true",
                        help="write the Triton repository and print the build commands without running them")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every member's engine")
    parser.add_argument("--kv-budget-gb", type=float, default=None,
                        help="ONE KV budget for the whole family, split across members "
                             "(default: 16 for tensorrtllm, 0.0625 for python)")
    parser.add_argument("--trtllm-examples", type=Path, default=Path("TensorRT-LLM/examples"),
                        help="TensorRT-LLM examples/ directory holding llama/ and qwen/ convert_checkpoint.py")
    parser.add_argument("--scheduler-policy", choices=("guaranteed_no_evict", "max_utilization"),
                        default="guaranteed_no_evict", help="tensorrt_llm batch_scheduler_policy")
    parser.add_argument("--gpu", action="append", default=[], metavar="MEMBER=IDS",
                        help="tensorrt_llm gpu_device_ids of one member, e.g. tiny-l=1 or llama-8b=2,3 (repeat)")
    parser.add_argument("--page-bytes", type=int, default=None, help="python backend: local arena page size")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                        help="python backend: local engine dtype (default: the MFS config default)")


def main(argv: list[str] | argparse.Namespace | None = None) -> int:
    if isinstance(argv, argparse.Namespace):
        args = argv
    else:
        parser = argparse.ArgumentParser(prog="build-engines", description=__doc__)
        add_arguments(parser)
        args = parser.parse_args(argv)
    try:
        family = load_family(args.family)
    except FamilyError as exc:
        print(f"build-engines: {exc}", file=sys.stderr)
        return 2
    budget_gb = args.kv_budget_gb if args.kv_budget_gb is not None else DEFAULT_BUDGET_GB[args.backend]
    if budget_gb <= 0:
        print("build-engines: --kv-budget-gb must be positive", file=sys.stderr)
        return 2
    budget_bytes = int(budget_gb * GIB)
    out: Path = args.out.resolve()
    try:
        if args.backend == "python":
            return _build_python(args, family, out, budget_bytes)
        return _build_tensorrtllm(args, family, out, budget_bytes)
    except ValueError as exc:
        print(f"build-engines: {exc}", file=sys.stderr)
        return 2


# ----------------------------------------------------------------------------- tensorrtllm
def missing_prerequisites(examples_dir: Path, family: FamilySpec) -> list[str]:
    """What stops the real build on this machine (empty = all present)."""
    missing = []
    if importlib.util.find_spec("tensorrt_llm") is None:
        missing.append("the tensorrt_llm Python package (pip install tensorrt_llm==0.18.*, or the NGC "
                       "tritonserver:<yy.mm>-trtllm-python-py3 container)")
    if shutil.which("trtllm-build") is None:
        missing.append("the trtllm-build command on PATH (installed with tensorrt_llm)")
    if not _gpu_present():
        missing.append("an NVIDIA GPU (nvidia-smi -L lists none)")
    for arch in sorted({m.architecture for m in family.members}):
        script = examples_dir / CONVERT_SCRIPT[arch]
        if not script.is_file():
            missing.append(f"{script} (pass --trtllm-examples pointing at TensorRT-LLM's examples/)")
    return missing


def _gpu_present() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def _parse_gpu_map(entries: list[str], family: FamilySpec) -> dict[str, str]:
    gpus = {}
    for entry in entries:
        member, sep, ids = entry.partition("=")
        if not sep or member not in family.member_names or not ids:
            raise ValueError(f"--gpu {entry!r}: expected MEMBER=IDS with MEMBER in {family.member_names}")
        gpus[member] = ids
    return gpus


def _build_tensorrtllm(args: argparse.Namespace, family: FamilySpec, out: Path, budget_bytes: int) -> int:
    examples = args.trtllm_examples.resolve()
    settings = {m.name: BuildSettings.for_member(m, args.tp) for m in family.members}
    builds = [member_build(m, out, examples, settings[m.name]) for m in family.members]
    if not args.dry_run:
        missing = missing_prerequisites(examples, family)
        if missing:
            print("build-engines: cannot build TensorRT-LLM engines here; missing:\n  - " + "\n  - ".join(missing)
                  + "\nRun with --dry-run to write the Triton repository and print the exact commands, or use "
                    "--backend python to serve the local engine through Triton.", file=sys.stderr)
            return 3
    gpus = _parse_gpu_map(args.gpu, family)
    split = triton_repo.split_kv_budget(
        family, budget_bytes, dtype_bytes(next(iter(settings.values())).dtype),
        {name: s.tokens_per_block for name, s in settings.items()})
    if args.dry_run:
        _print_commands(builds, out)
    else:
        _run_builds(builds, out)
    repo = out / "triton_repo"
    repo.mkdir(parents=True, exist_ok=True)
    for build, kv in zip(builds, split):
        config = triton_repo.tensorrt_llm_config(build.member, build.engine_dir, kv, build.settings.max_batch_size,
                                                 args.scheduler_policy, gpus.get(build.member), family.name)
        triton_repo.write_config(repo / build.member, config)
    triton_repo.write_manifest(repo, family, "tensorrtllm", budget_bytes, split,
                               {"engines": {b.member: str(b.engine_dir) for b in builds}, "tp_size": args.tp})
    _print_split(split, budget_bytes)
    print(f"Triton repository: {repo}\nnext: tritonserver --model-repository {repo} "
          f"(tensorrtllm backend), then: mfs serve --engine triton --triton-url 127.0.0.1:8101")
    return 0


def _print_commands(builds: list[MemberBuild], out: Path) -> None:
    lines = ["#!/bin/sh", "# Written by build-engines --dry-run: run on a GPU machine with TensorRT-LLM.", "set -e"]
    for build in builds:
        lines += [f"# {build.member}", shell_line(build.convert), shell_line(build.build)]
    out.mkdir(parents=True, exist_ok=True)
    script = out / "build_commands.sh"
    script.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[1:]))
    print(f"(also written to {script})")


def _run_builds(builds: list[MemberBuild], out: Path) -> None:
    from tqdm import tqdm

    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    steps = [(b.member, kind, argv) for b in builds for kind, argv in (("convert", b.convert), ("build", b.build))]
    with tqdm(total=len(steps), unit="step", desc="build-engines") as bar:
        for member, kind, argv in steps:
            bar.set_postfix_str(f"{member}: {kind}")
            log_path = logs / f"{member}-{kind}.log"
            with log_path.open("w") as log:
                log.write(shell_line(argv) + "\n")
                log.flush()
                done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                tail = "".join(log_path.read_text().splitlines(keepends=True)[-20:])
                raise ValueError(f"{member} {kind} failed (exit {done.returncode}); log {log_path}:\n{tail}")
            bar.update(1)


# ----------------------------------------------------------------------------- python (local engine in Triton)
def _build_python(args: argparse.Namespace, family: FamilySpec, out: Path, budget_bytes: int) -> int:
    defaults = MFSConfig()
    page_bytes = args.page_bytes or defaults.pool.page_bytes
    dtype = args.dtype or defaults.engine.dtype
    tpb = {m.name: m.tokens_per_block(page_bytes, dtype_bytes(dtype)) for m in family.members}
    split = triton_repo.split_kv_budget(family, budget_bytes, dtype_bytes(dtype), tpb, page_bytes=page_bytes)
    repo = out / "triton_repo"
    repo.mkdir(parents=True, exist_ok=True)
    for member, kv in zip(family.members, split):
        max_batch = int(member.serving.get("max_batch_size", 64))
        config = triton_repo.python_member_config(member.name, family.root, kv, page_bytes, dtype, max_batch,
                                                  family.name)
        triton_repo.write_config(repo / member.name, config)
        triton_repo.install_python_model(repo / member.name)
    triton_repo.write_manifest(repo, family, "python", budget_bytes, split,
                               {"page_bytes": page_bytes, "dtype": dtype})
    _print_split(split, budget_bytes)
    print(f"Triton repository: {repo}\nnext: mfs triton-up --repo {repo}, then: "
          f"mfs serve --engine triton --triton-url 127.0.0.1:8101")
    return 0


def _print_split(split: list[triton_repo.MemberKV], budget_bytes: int) -> None:
    print(f"KV budget {budget_bytes / GIB:.4g} GiB split:")
    for kv in split:
        print(f"  {kv.member}: share {kv.share:.3f}, {kv.max_tokens} tokens "
              f"({kv.max_tokens // kv.tokens_per_block} blocks of {kv.tokens_per_block}), "
              f"{kv.used_bytes / 2**20:.1f} MiB" + (f", {kv.num_pages} local pages" if kv.num_pages else ""))


if __name__ == "__main__":
    sys.exit(main())
