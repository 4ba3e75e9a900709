"""How many bytes a family's members' weights take: the one estimate from a dense decoder's shape, and each
member's figure as the compared systems and the simulator's GPU memory read it."""
from __future__ import annotations

import json
from typing import Any

from orchestrator.core.family import FamilySpec, MemberSpec

WEIGHT_DTYPE_BYTES = 2              # bf16 weights, as a GPU serves them


def weight_bytes(hf: dict[str, Any]) -> int:
    """bf16 weight bytes of a dense decoder from its HF config (embeddings, attention, MLP, norms)."""
    hidden, layers = hf["hidden_size"], hf["num_hidden_layers"]
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hidden // heads
    embed = hf["vocab_size"] * hidden * (1 if hf.get("tie_word_embeddings") else 2)
    attention = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2
    mlp = 3 * hidden * hf["intermediate_size"]
    return (embed + layers * (attention + mlp + 2 * hidden) + hidden) * WEIGHT_DTYPE_BYTES


def member_weight_bytes(family: FamilySpec) -> dict[str, int]:
    """Bytes of each member's weights: what the family says (`serving.weight_bytes`: the simulator's paper-scale
    members, whose checkpoint_dir is only the shipped tokenizer, and random-weight families), else its checkpoint
    files, else weight_bytes of its own config.json (exact: its MLP width and tied embeddings are there, not in
    MemberSpec), else of its shape (test fakes with no checkpoint). The files are counted where they exist because
    they are what the operator deploys, in the dtype they are stored in (the shipped tiny family's are float32,
    twice the bf16 estimate)."""
    out = {}
    for m in family.members:
        if m.serving.get("weight_bytes"):
            out[m.name] = int(m.serving["weight_bytes"])
            continue
        files = [f for pattern in ("*.safetensors", "*.bin") for f in m.checkpoint_dir.glob(pattern)]
        size = sum(f.stat().st_size for f in files if f.is_file())
        out[m.name] = size or weight_bytes(member_config(m))
    return out


def member_config(member: MemberSpec) -> dict[str, Any]:
    """The HF config weight_bytes reads for a member: its checkpoint's config.json, else shape_config."""
    path = member.checkpoint_dir / "config.json"
    return json.loads(path.read_text()) if path.is_file() else shape_config(member)


def shape_config(member: MemberSpec) -> dict[str, Any]:
    """The HF config keys weight_bytes reads, from a member's shape alone (it carries no MLP width nor tying: the
    common MLP of 4 x hidden, tied embeddings)."""
    return {"hidden_size": member.hidden_size, "num_hidden_layers": member.num_layers,
            "num_attention_heads": member.num_heads, "num_key_value_heads": member.num_kv_heads,
            "head_dim": member.head_dim, "vocab_size": member.vocab_size, "intermediate_size": 4 * member.hidden_size,
            "tie_word_embeddings": True}
