"""Families to simulate: a shipped tiny family as it is (the nested `tiny`, the separate-weight `tiny-sep`), or a
paper-scale family described by its members' HF configs (from aiconfigurator's model_configs, carried in the step
table), and how GPU memory becomes KV pages; which recorded confidences a family's simulated replies read.

A paper-scale member is a MemberSpec built from its HF config: its real layer count and KV shape (so pages and
tokens per block follow the real model), lineages of its own (the members are separately trained models: no
page is shared between them), and the shipped tiny tokenizer (no other tokenizer is on disk and none may be
downloaded; token counts of ShareGPT text under it are what the trace holds, see TOKENIZER_NOTE).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval.simulate.confidence import ConfidenceLibrary
from eval.simulate.paths import DEFAULT_LIBRARY, confidences_path
from eval.weights import weight_bytes
from orchestrator.core.family import FamilyError, FamilySpec, MemberSpec, load_family
from orchestrator.core.types import MemberName

# name -> members (simulated name, HF model id), small to large
PRESETS: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen3": (("qwen3-0.6b", "Qwen/Qwen3-0.6B"), ("qwen3-1.7b", "Qwen/Qwen3-1.7B"), ("qwen3-8b", "Qwen/Qwen3-8B")),
    "qwen3-large": (("qwen3-1.7b", "Qwen/Qwen3-1.7B"), ("qwen3-8b", "Qwen/Qwen3-8B"), ("qwen3-32b", "Qwen/Qwen3-32B")),
    "llama3.1": (("llama3.1-8b", "meta-llama/Meta-Llama-3.1-8B"), ("llama3.1-70b", "meta-llama/Meta-Llama-3.1-70B")),
    # the same two members served, with the family's 1B resident to draft for both (no request goes to it)
    "llama3.1-draft1b": (("llama3.2-1b", "meta-llama/Llama-3.2-1B"), ("llama3.1-8b", "meta-llama/Meta-Llama-3.1-8B"),
                         ("llama3.1-70b", "meta-llama/Meta-Llama-3.1-70B")),
}
# family -> its drafts_only member (MemberSpec.drafts_only): resident to draft, routed no request, no deployment of
# its own among the separate deployments
DRAFTS_ONLY: dict[str, str] = {"llama3.1-draft1b": "llama3.2-1b"}
KV_DTYPE_BYTES = 2                  # bf16 KV cache (TensorRT-LLM's default for bf16 models)
DEFAULT_BLOCK_TOKENS = 32           # TensorRT-LLM KvCacheConfig.tokens_per_block default
FREE_GPU_MEMORY_FRACTION = 0.9      # TensorRT-LLM KvCacheConfig.free_gpu_memory_fraction default
WEIGHT_FIT_FRACTION = 0.8           # a member whose weights exceed this share of its GPUs gets more GPUs (TP)
# Host memory for the KV host tier, per GPU of a node: DGX H100 / H200 carry 2 TiB of system memory for 8 GPUs
# (256 GiB each); half of that share goes to the tier (TensorRT-LLM's kv_cache_host_memory_bytes, SGLang's
# HiCache, LMCache's CPU buffer). The shipped config's 256 MB sizes the tiny family's tier, not a GPU node's.
HOST_TIER_GIB_PER_GPU = 128.0
TOKENIZER_NOTE = ("token counts come from the shipped tiny family's tokenizer (a 4096-token BPE trained on "
                  "ShareGPT); no tokenizer of the simulated family is on disk. Its vocabulary is ~37x smaller "
                  "than Qwen3's (151,936) or Llama 3.1's (128,256), so the same text is likely MORE tokens here "
                  "(roughly 1.2-1.5x): prompts, replies and KV footprints are biased long, step costs slightly high.")


def kv_bytes_per_token_per_layer(hf: dict[str, Any]) -> int:
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return 2 * (hf.get("num_key_value_heads") or heads) * head_dim * KV_DTYPE_BYTES


def page_bytes_for(hf_configs: list[dict[str, Any]], block_tokens: int) -> int:
    """One page = one layer's K and V for block_tokens tokens of the widest member (narrower members fit more)."""
    return block_tokens * max(kv_bytes_per_token_per_layer(hf) for hf in hf_configs)


def tensor_parallel(weights: int, gpu_memory_bytes: int) -> int:
    """GPUs a member needs (a power of two) so its weights take at most WEIGHT_FIT_FRACTION of their memory."""
    tp = 1
    while weights / tp > WEIGHT_FIT_FRACTION * gpu_memory_bytes:
        tp *= 2
    return tp


def paper_family(name: str, members: list[tuple[str, dict[str, Any]]]) -> FamilySpec:
    """FamilySpec for (member name, HF config) pairs, small to large, with the shipped tokenizer (and the preset's
    drafts_only member marked so)."""
    tiny = load_family("tiny")
    tokenizer_member = tiny.members[0]
    specs = []
    for index, (member, hf) in enumerate(members):
        heads = hf["num_attention_heads"]
        layers = hf["num_hidden_layers"]
        lineages = tuple(hashlib.blake2b(f"{member}|layer{l}".encode(), digest_size=16).hexdigest()
                         for l in range(layers))
        specs.append(MemberSpec(
            name=MemberName(member), index=index, checkpoint_dir=tokenizer_member.checkpoint_dir,
            architecture="llama", num_layers=layers, hidden_size=hf["hidden_size"], num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab_size=tokenizer_member.vocab_size, context_tokens=int(hf.get("max_position_embeddings", 32768)),
            layer_lineages=lineages, tokenizer_hash=tokenizer_member.tokenizer_hash,
            eos_token_ids=tokenizer_member.eos_token_ids,
            # its checkpoint_dir is the shipped tokenizer's: the weights the baseline's operator split reads are these
            serving={"weight_bytes": weight_bytes(hf), **({"drafts_only": True} if DRAFTS_ONLY.get(name) == member
                                                          else {})}))
    return FamilySpec(name=name, members=tuple(specs))


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """How one device group's memory becomes pages (all figures in bytes)."""

    gpus: int
    memory_bytes: int
    weight_bytes: int
    free_fraction: float
    page_bytes: int

    @property
    def kv_bytes(self) -> int:
        return max(0, int((self.memory_bytes - self.weight_bytes) * self.free_fraction))

    @property
    def num_pages(self) -> int:
        return self.kv_bytes // self.page_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "memory_gib": round(self.memory_bytes / 2**30, 2),
                "weights_gib": round(self.weight_bytes / 2**30, 2), "free_fraction": self.free_fraction,
                "kv_gib": round(self.kv_bytes / 2**30, 2), "page_bytes": self.page_bytes, "num_pages": self.num_pages}


def default_library(family_name: str) -> Path:
    """The confidences a family's simulated replies read by default: its own recording when one is kept
    (eval/simulate/paths.py), else the nested tiny family's (members borrowed by relative size, said in the JSON)."""
    own = confidences_path(family_name)
    return own if own.is_file() else DEFAULT_LIBRARY


def recorded_members(library: ConfidenceLibrary, fallback: list[str]) -> list[str]:
    """The recorded family's members small to large (its family.yaml, where it is a shipped family), for
    ConfidenceLibrary.map_members; `fallback` where the recorded family is not on disk."""
    try:
        return load_family(library.family).member_names
    except FamilyError:
        return fallback
