"""The TensorRT-LLM build steps of one member: convert_checkpoint.py, then trtllm-build, as argv lists.

Pure: no tensorrt_llm import, so --dry-run can print the exact commands on a machine without it.
Targets TensorRT-LLM 0.17 / 0.18 (examples/llama and examples/qwen convert scripts, trtllm-build flags).
"""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core.family import MemberSpec

CONVERT_SCRIPT = {"llama": "llama/convert_checkpoint.py", "qwen2": "qwen/convert_checkpoint.py"}


@dataclass(frozen=True, slots=True)
class BuildSettings:
    """Engine limits of one member (family.yaml member entry keys of the same name override the defaults)."""

    tokens_per_block: int = 32
    max_batch_size: int = 64
    max_num_tokens: int = 8192
    max_seq_len: int = 8192
    dtype: str = "float16"
    tp_size: int = 1

    @classmethod
    def for_member(cls, member: MemberSpec, tp_size: int) -> BuildSettings:
        serving, d = member.serving, cls()
        settings = cls(
            tokens_per_block=int(serving.get("tokens_per_block", d.tokens_per_block)),
            max_batch_size=int(serving.get("max_batch_size", d.max_batch_size)),
            max_num_tokens=int(serving.get("max_num_tokens", d.max_num_tokens)),
            # The engine never needs more than the checkpoint's context window.
            max_seq_len=int(serving.get("max_seq_len", min(d.max_seq_len, member.context_tokens))),
            dtype=str(serving.get("dtype", d.dtype)),
            tp_size=int(serving.get("tp_size", tp_size)),
        )
        settings.validate(member.name)
        return settings

    def validate(self, member: str) -> None:
        tpb = self.tokens_per_block
        if tpb < 1 or tpb & (tpb - 1):
            raise ValueError(f"member {member}: tokens_per_block must be a power of two, got {tpb}")
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"member {member}: {name} must be positive, got {getattr(self, name)}")
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"member {member}: dtype must be float16, bfloat16 or float32, got {self.dtype}")


@dataclass(frozen=True, slots=True)
class MemberBuild:
    member: str
    checkpoint_out: Path            # TensorRT-LLM checkpoint (convert output)
    engine_dir: Path                # trtllm-build output, what the tensorrt_llm model loads
    convert: list[str]
    build: list[str]
    settings: BuildSettings


def member_build(member: MemberSpec, out_dir: Path, examples_dir: Path, settings: BuildSettings,
                 python: str = sys.executable) -> MemberBuild:
    if member.architecture not in CONVERT_SCRIPT:
        raise ValueError(f"member {member.name}: no TensorRT-LLM convert script for {member.architecture}")
    checkpoint_out = out_dir / "trtllm_checkpoints" / member.name
    engine_dir = out_dir / "engines" / member.name
    convert = [
        python, str(examples_dir / CONVERT_SCRIPT[member.architecture]),
        "--model_dir", str(member.checkpoint_dir),
        "--output_dir", str(checkpoint_out),
        "--dtype", settings.dtype,
        "--tp_size", str(settings.tp_size),
    ]
    build = [
        "trtllm-build",
        "--checkpoint_dir", str(checkpoint_out),
        "--output_dir", str(engine_dir),
        "--gemm_plugin", "auto",
        "--gpt_attention_plugin", "auto",
        "--kv_cache_type", "paged",
        # Paged context FMHA is what lets a new request attend to REUSED blocks (KV reuse needs it).
        "--use_paged_context_fmha", "enable",
        "--remove_input_padding", "enable",
        "--tokens_per_block", str(settings.tokens_per_block),
        "--max_batch_size", str(settings.max_batch_size),
        "--max_num_tokens", str(settings.max_num_tokens),
        "--max_seq_len", str(settings.max_seq_len),
    ]
    return MemberBuild(member=member.name, checkpoint_out=checkpoint_out, engine_dir=engine_dir,
                       convert=convert, build=build, settings=settings)


def shell_line(argv: list[str]) -> str:
    return shlex.join(argv)
