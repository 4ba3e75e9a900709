"""Builds a step table from NVIDIA aiconfigurator's TensorRT-LLM (or vLLM / SGLang) performance database.

aiconfigurator-core needs numpy>=2.1 while this project pins numpy<2 (nvidia-pytriton), so it lives in its own
virtual environment and this module runs there as a script: it imports only the standard library, PyYAML and
aiconfigurator_core. The project side (`build_aic_table`) calls it as a subprocess and reads the JSON it prints.

    python -m venv ~/.cache/mfs/aiconfigurator-venv
    ~/.cache/mfs/aiconfigurator-venv/bin/pip install aiconfigurator-core==0.12.0
    MFS_AIC_PYTHON=~/.cache/mfs/aiconfigurator-venv/bin/python mfs simulate --family qwen3 --gpu h200_sxm ...

Queries (milliseconds, about 2 us each): decode_step_latency(batch, context, 1) for a decode step;
predict_prefill_latency(1, prefix + tokens, prefix) for a prefill chunk after a cached prefix;
mixed_step_latency(tokens, batch, context, 1) to fit how much a step holding both costs over the larger part,
and on a grid of prompt tokens and decode batches, what a prefill chunk adds to a decode step (mixed_extra_ms).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_VENV_PYTHON = Path.home() / ".cache" / "mfs" / "aiconfigurator-venv" / "bin" / "python"
# HF configs (architecture only, no weights) of models aiconfigurator-core 0.12.0 carries none for, as published on
# the Hugging Face hub: data/hf_configs/<org>--<name>/config.json; aiconfigurator prices them from their shapes
SHIPPED_HF_CONFIGS = Path(__file__).resolve().parent / "data" / "hf_configs"
DECODE_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CONTEXT = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)
PREFILL_TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
PREFIX = (0, 256, 1024, 2048, 4096, 8192, 16384, 32768)
# the mixed-step grid: a prefill chunk of MIXED_TOKENS beside MIXED_BATCH decodes at MIXED_CONTEXT
MIXED_TOKENS = (1, 16, 32, 64, 128, 256, 512, 1024, 2048)
MIXED_BATCH = (1, 4, 16, 32, 64, 128, 256)
MIXED_CONTEXT = 1024
MIX_POINTS = ((64, 8, 1024), (128, 32, 2048), (512, 8, 1024), (512, 64, 2048), (1024, 16, 4096), (256, 128, 1024))


class AIConfiguratorUnavailable(RuntimeError):
    """aiconfigurator-core is not installed where we looked; the message says how to install it."""


def aic_python() -> Path:
    return Path(os.environ.get("MFS_AIC_PYTHON") or DEFAULT_VENV_PYTHON)


def build_aic_table(members: list[tuple[str, str, int]], gpu: str, backend: str, python: Path | None = None,
                    timeout_s: float = 600.0) -> dict:
    """members: (name, HF model id, tensor-parallel size). Returns the table dict (mfs-step-table/1)."""
    python = python or aic_python()
    if not Path(python).exists():
        raise AIConfiguratorUnavailable(
            f"aiconfigurator-core not found (no {python}): it needs numpy>=2, so install it in its own venv: "
            f"python3.11 -m venv {DEFAULT_VENV_PYTHON.parent.parent} && {DEFAULT_VENV_PYTHON.parent}/pip install "
            "aiconfigurator-core==0.12.0 (or point MFS_AIC_PYTHON at a python that has it), or pass --step-table FILE")
    spec = ",".join(f"{name}={model}:{tp}" for name, model, tp in members)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([str(python), "-m", "eval.simulate.aic_table", "--members", spec, "--gpu", gpu,
                           "--backend", backend], capture_output=True, text=True, timeout=timeout_s, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    if proc.returncode != 0:
        raise AIConfiguratorUnavailable(f"aiconfigurator table build failed ({python}): {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout)


# ----------------------------------------------------------------------------- runs inside the aiconfigurator venv
def _system_memory_bytes(gpu: str) -> int:
    import aiconfigurator_core
    import yaml

    path = Path(aiconfigurator_core.__file__).parent / "systems" / f"{gpu}.yaml"
    if not path.is_file():
        raise SystemExit(f"aiconfigurator has no system {gpu!r} ({path} missing)")
    data = yaml.safe_load(path.read_text())
    return int(data["gpu"]["mem_capacity"])


def _model_path(model: str) -> str:
    """What aiconfigurator compiles: its own config of the model id, else the shipped config's folder."""
    import aiconfigurator_core

    own = Path(aiconfigurator_core.__file__).parent / "model_configs" / f"{model.replace('/', '--')}_config.json"
    shipped = SHIPPED_HF_CONFIGS / model.replace("/", "--")
    if own.is_file() or not (shipped / "config.json").is_file():
        return model
    return str(shipped)


def _hf_config(model: str) -> dict:
    import aiconfigurator_core

    path = Path(aiconfigurator_core.__file__).parent / "model_configs" / f"{model.replace('/', '--')}_config.json"
    if not path.is_file():
        path = SHIPPED_HF_CONFIGS / model.replace("/", "--") / "config.json"
    if not path.is_file():
        raise SystemExit(f"aiconfigurator has no model config for {model!r} (and {path} is not shipped)")
    return json.loads(path.read_text())


def _member_table(model: str, gpu: str, backend: str, tp: int) -> dict:
    from aiconfigurator_core.sdk.engine import EngineHandle

    handle = EngineHandle.compile(_model_path(model), gpu, backend, tp_size=tp)
    decode = [[handle.decode_step_latency(b, c, 1) for c in CONTEXT] for b in DECODE_BATCH]
    prefill = [[handle.predict_prefill_latency(1, p + t, p) for p in PREFIX] for t in PREFILL_TOKENS]
    overlaps = []
    for tokens, batch, context in MIX_POINTS:
        mixed = handle.mixed_step_latency(tokens, batch, context, 1, 0)
        p, d = handle.predict_prefill_latency(1, tokens, 0), handle.decode_step_latency(batch, context, 1)
        overlaps.append(max(0.0, (mixed - max(p, d)) / min(p, d)))
    overlaps.sort()
    mixed = [[handle.mixed_step_latency(t, b, MIXED_CONTEXT, 1, 0) - handle.decode_step_latency(b, MIXED_CONTEXT, 1)
              for b in MIXED_BATCH] for t in MIXED_TOKENS]
    return {"model": model, "tp": tp, "hf_config": _hf_config(model), "mix_overlap": overlaps[len(overlaps) // 2],
            "decode_ms": {"batch": list(DECODE_BATCH), "context": list(CONTEXT), "ms": decode},
            "prefill_ms": {"tokens": list(PREFILL_TOKENS), "prefix": list(PREFIX), "ms": prefill},
            "mixed_extra_ms": {"tokens": list(MIXED_TOKENS), "batch": list(MIXED_BATCH), "ms": mixed}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="step table from aiconfigurator (run in its own venv)")
    parser.add_argument("--members", required=True, help="name=model_id:tp,...")
    parser.add_argument("--gpu", required=True)
    parser.add_argument("--backend", default="trtllm")
    args = parser.parse_args(argv)
    import importlib.metadata as md

    version = md.version("aiconfigurator-core")
    members = {}
    for item in args.members.split(","):
        name, _, rest = item.partition("=")
        model, _, tp = rest.rpartition(":")
        members[name] = _member_table(model, args.gpu, args.backend, int(tp))
    table = {"format": "mfs-step-table/1", "source": f"aiconfigurator-core {version} ({args.backend} on {args.gpu})",
             "gpu": args.gpu, "backend": args.backend, "gpu_memory_bytes": _system_memory_bytes(args.gpu),
             "step_overhead_ms": 0.0, "copy_gb_s": 25.0, "members": members,
             "notes": ["decode_ms = decode_step_latency(batch, context, 1); prefill_ms = predict_prefill_latency(1, "
                       "prefix + tokens, prefix); mix_overlap = median over MIX_POINTS of (mixed_step_latency - "
                       "max(P, D)) / min(P, D); mixed_extra_ms = mixed_step_latency(tokens, batch, "
                       f"{MIXED_CONTEXT}, 1) - decode_step_latency(batch, {MIXED_CONTEXT}, 1)",
                       "copy_gb_s 25: arena <-> host tier over PCIe 5 at about half its 64 GB/s peak (assumed, "
                       "not from aiconfigurator)"]}
    json.dump(table, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
