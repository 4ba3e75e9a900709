"""A model family as MFS sees it: members (small to large), their KV shapes, layer lineages, tokenizer identity.

Loaded once from a family directory (family.yaml + one Hugging Face checkpoint folder per member). Layer lineages
are hashed from the weights here (numpy via safetensors, no torch). A checkpoint whose config.json carries
`mfs_random_weights: {seed, std}` has no weight files: the local engine draws every tensor from (seed, tensor name)
(timing runs on real shapes, build_scripts/random_family.py), and its lineages hash those draws' identities, so
members with the same seed and widths share their common lower layers.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from orchestrator.core.types import MemberName

SHIPPED_FAMILIES_DIR = Path(__file__).resolve().parents[2] / "engines" / "families"
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class FamilyError(ValueError):
    """A family or checkpoint problem; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class MemberSpec:
    name: MemberName
    index: int                          # 0 = smallest
    checkpoint_dir: Path
    architecture: str                   # llama | qwen2
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_tokens: int
    layer_lineages: tuple[str, ...]     # one per layer, see module docstring
    tokenizer_hash: str
    eos_token_ids: tuple[int, ...]
    serving: dict = field(default_factory=dict)  # per-member extras from family.yaml (batch sizes, kv share)

    def kv_bytes_per_token_per_layer(self, dtype_bytes: int) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def tokens_per_block(self, page_bytes: int, dtype_bytes: int) -> int:
        """Tokens one page holds for one layer, rounded down to a power of two."""
        raw = page_bytes // self.kv_bytes_per_token_per_layer(dtype_bytes)
        if raw < 1:
            raise FamilyError(f"member {self.name}: page of {page_bytes} bytes holds no token "
                              f"({self.kv_bytes_per_token_per_layer(dtype_bytes)} bytes per token per layer)")
        return 1 << (raw.bit_length() - 1)

    def residual_fits_page(self, page_bytes: int, dtype_bytes: int) -> bool:
        """A residual block (hidden state of one block of tokens) must fit in one page to be cached."""
        return self.tokens_per_block(page_bytes, dtype_bytes) * self.hidden_size * dtype_bytes <= page_bytes

    def residual_lineage(self) -> str:
        return self.layer_lineages[-1] + ":residual"

    @property
    def drafts_only(self) -> bool:
        """Resident only to draft for the larger members (family.yaml `drafts_only: true`): no request is routed
        to it, and separate deployments have no server of it (each speculating one keeps its own copy)."""
        return self.serving.get("drafts_only", False) is True


@dataclass(frozen=True, slots=True)
class FamilySpec:
    name: str
    members: tuple[MemberSpec, ...]     # small to large
    root: Path | None = None

    # name -> member, built once: member() is called per token and per request on the scheduling path
    _by_name: dict[str, MemberSpec] = field(default=None, init=False, repr=False, compare=False)
    # the members requests go to, built once: routing, placement and admission read it per request
    _serving: list[str] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {m.name: m for m in self.members})
        object.__setattr__(self, "_serving", [m.name for m in self.members if not m.drafts_only])
        for m in self.members:
            flag = m.serving.get("drafts_only", False)
            if not isinstance(flag, bool):
                raise FamilyError(f"member {m.name}: drafts_only must be true or false, got {flag!r}")
            if flag and m.index != 0:
                raise FamilyError(f"member {m.name}: only the smallest member may be drafts_only (the smallest "
                                  "member drafts for the larger ones)")
        if self.members and not self.serving_names:
            raise FamilyError(f"family {self.name}: every member is drafts_only; requests need a member to go to")

    def member(self, name: str) -> MemberSpec:
        return self._by_name[name]

    @property
    def member_names(self) -> list[str]:
        return [m.name for m in self.members]

    @property
    def drafter(self) -> MemberSpec | None:
        """The drafts_only member, if the family has one (only the smallest member may be)."""
        return self.members[0] if self.members and self.members[0].drafts_only else None

    @property
    def serving_names(self) -> list[str]:
        """The members requests are routed to, small to large: every member but a drafts_only one (shared: do not
        modify)."""
        return self._serving

    def shared_depth(self, a: str, b: str) -> int:
        """Number of leading layers whose lineages agree (0 for an independent family)."""
        la, lb = self.member(a).layer_lineages, self.member(b).layer_lineages
        depth = 0
        while depth < min(len(la), len(lb)) and la[depth] == lb[depth]:
            depth += 1
        return depth

    def is_nested(self) -> bool:
        return all(self.shared_depth(a.name, b.name) == a.num_layers
                   for a, b in zip(self.members, self.members[1:]))

    def context_tokens(self) -> int:
        return max(m.context_tokens for m in self.members)


def resolve_family_dir(family: str | Path) -> Path:
    """A shipped family name ('tiny') or a directory holding family.yaml."""
    candidate = Path(family)
    if candidate.is_dir():
        return candidate.resolve()
    shipped = SHIPPED_FAMILIES_DIR / str(family)
    if shipped.is_dir():
        return shipped
    known = sorted(p.name for p in SHIPPED_FAMILIES_DIR.iterdir() if p.is_dir()) if SHIPPED_FAMILIES_DIR.is_dir() else []
    raise FamilyError(f"family {family!r}: not a directory and not a shipped family (shipped: {', '.join(known) or 'none'})")


def load_family(family: str | Path) -> FamilySpec:
    """Loads and checks family.yaml and every member checkpoint's config, tokenizer and weights' lineage."""
    root = resolve_family_dir(family)
    manifest_path = root / "family.yaml"
    if not manifest_path.is_file():
        raise FamilyError(f"{manifest_path}: missing (a family directory needs family.yaml)")
    try:
        manifest = yaml.safe_load(manifest_path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise FamilyError(f"{manifest_path}: not valid YAML: {exc}") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("members"), list) or not manifest["members"]:
        raise FamilyError(f"{manifest_path}: field 'members' must be a non-empty list")
    name = manifest.get("name")
    if not isinstance(name, str) or not name:
        raise FamilyError(f"{manifest_path}: field 'name' must be a non-empty string")
    members = []
    for index, entry in enumerate(manifest["members"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise FamilyError(f"{manifest_path}: members[{index}] needs a string 'name'")
        checkpoint = root / str(entry.get("checkpoint", entry["name"]))
        serving = {k: v for k, v in entry.items() if k not in ("name", "checkpoint")}
        members.append(_load_member(entry["name"], index, checkpoint, serving))
    spec = FamilySpec(name=name, members=tuple(members), root=root)
    sizes = [m.num_layers * m.hidden_size for m in spec.members]
    if sizes != sorted(sizes):
        raise FamilyError(f"{manifest_path}: members must be ordered small to large "
                          f"(layers x width: {dict(zip(spec.member_names, sizes))})")
    if len(set(spec.member_names)) != len(spec.members):
        raise FamilyError(f"{manifest_path}: member names must be unique")
    if name in spec.member_names:
        raise FamilyError(f"{manifest_path}: family name {name!r} must differ from every member name")
    return spec


def read_checkpoint_config(checkpoint: Path) -> dict:
    config_path = checkpoint / "config.json"
    if not config_path.is_file():
        raise FamilyError(f"{config_path}: missing (expected a Hugging Face checkpoint folder)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise FamilyError(f"{config_path}: not valid JSON: {exc}") from exc
    archs = config.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise FamilyError(f"{config_path}: field 'architectures' = {archs!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        if not isinstance(config.get(key), int) or config[key] <= 0:
            raise FamilyError(f"{config_path}: field '{key}' must be a positive integer, got {config.get(key)!r}")
    config["_arch"] = arch
    return config


def _load_member(name: str, index: int, checkpoint: Path, serving: dict) -> MemberSpec:
    if not checkpoint.is_dir():
        raise FamilyError(f"member {name}: checkpoint folder {checkpoint} is missing")
    config = read_checkpoint_config(checkpoint)
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    tokenizer_file = checkpoint / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FamilyError(f"member {name}: {tokenizer_file} is missing")
    tokenizer_hash = hashlib.blake2b(tokenizer_file.read_bytes(), digest_size=16).hexdigest()
    return MemberSpec(
        name=MemberName(name), index=index, checkpoint_dir=checkpoint, architecture=config["_arch"],
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"], num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads, head_dim=head_dim,
        vocab_size=config["vocab_size"], context_tokens=config.get("max_position_embeddings", 2048),
        layer_lineages=layer_lineages(checkpoint, config), tokenizer_hash=tokenizer_hash, eos_token_ids=eos_ids, serving=serving,
    )


RANDOM_WEIGHTS_KEY = "mfs_random_weights"     # config.json: {"seed": int, "std": float}; no weight files


def random_weights(checkpoint: Path, config: dict) -> dict | None:
    """The checkpoint's random-weights declaration, checked; None for a checkpoint with weight files."""
    spec = config.get(RANDOM_WEIGHTS_KEY)
    if spec is None:
        return None
    if (not isinstance(spec, dict) or not isinstance(spec.get("seed"), int)
            or not isinstance(spec.get("std"), (int, float)) or spec["std"] <= 0):
        raise FamilyError(f"{checkpoint / 'config.json'}: field '{RANDOM_WEIGHTS_KEY}' must be "
                          f"{{\"seed\": int, \"std\": positive number}}, got {spec!r}")
    return spec


def llama_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama / Qwen2 checkpoint of this config.json holds, by Hugging Face name."""
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    dim = config.get("head_dim") or hidden // heads
    biased = config["_arch"] == "qwen2" or bool(config.get("attention_bias"))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden),
                                          "model.norm.weight": (hidden,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (heads * dim, hidden),
                       p + "self_attn.k_proj.weight": (kv_heads * dim, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * dim, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * dim),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter)})
        if biased:
            shapes.update({p + "self_attn.q_proj.bias": (heads * dim,), p + "self_attn.k_proj.bias": (kv_heads * dim,),
                           p + "self_attn.v_proj.bias": (kv_heads * dim,)})
            if config["_arch"] != "qwen2":
                shapes[p + "self_attn.o_proj.bias"] = (hidden,)
    return shapes


def _random_digests(config: dict, spec: dict) -> dict[str, str]:
    """What identifies a drawn tensor: seed, spread, name and shape (the engine draws it from exactly these)."""
    return {name: hashlib.blake2b(f"random|{spec['seed']}|{spec['std']}|{name}|{shape}".encode(),
                                  digest_size=16).hexdigest()
            for name, shape in llama_tensor_shapes(config).items()}


def _file_digests(checkpoint: Path) -> dict[str, str]:
    from safetensors import safe_open

    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise FamilyError(f"{checkpoint}: no *.safetensors weights found")
    digests: dict[str, str] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as handle:
                for key in handle.keys():
                    digests[key] = hashlib.blake2b(handle.get_tensor(key).tobytes(), digest_size=16).hexdigest()
        except Exception as exc:  # safetensors raises several types for a corrupt file
            raise FamilyError(f"{file}: cannot read weights: {exc}") from exc
    return digests


def layer_lineages(checkpoint: Path, config: dict) -> tuple[str, ...]:
    """lineage[l] = H(lineage[l-1], weights of layer l); lineage[-1] = H(embeddings, rope and attention settings)."""
    spec = random_weights(checkpoint, config)
    digests = _file_digests(checkpoint) if spec is None else _random_digests(config, spec)
    embed_key = "model.embed_tokens.weight"
    if embed_key not in digests:
        raise FamilyError(f"{checkpoint}: weights lack '{embed_key}'")
    settings = {k: config.get(k) for k in ("rope_theta", "rope_scaling", "rms_norm_eps", "num_attention_heads",
                                           "num_key_value_heads", "head_dim", "hidden_act", "_arch")}
    running = hashlib.blake2b((digests[embed_key] + json.dumps(settings, sort_keys=True)).encode(),
                              digest_size=16).hexdigest()
    lineages = []
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        layer_digest = "".join(f"{k}={digests[k]};" for k in sorted(digests) if k.startswith(prefix))
        if not layer_digest:
            raise FamilyError(f"{checkpoint}: weights lack layer {layer} ('{prefix}*')")
        running = hashlib.blake2b((running + layer_digest).encode(), digest_size=16).hexdigest()
        lineages.append(running)
    return tuple(lineages)


def dtype_bytes(dtype: str) -> int:
    return _DTYPE_BYTES[dtype]
