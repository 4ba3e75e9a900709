"""Loads a Hugging Face Llama / Qwen2 checkpoint folder into plain tensors (fused per layer) plus its rope table
(or draws them, for a checkpoint declared `mfs_random_weights`: timing runs on real shapes without weight files)."""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from orchestrator.core.family import FamilyError, llama_tensor_shapes, random_weights, read_checkpoint_config

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The fields of config.json the forward pass needs, checked and normalised."""

    arch: str                      # llama | qwen2
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None      # {"rope_type": "llama3"|"linear", ...}; None = default rope
    qkv_bias: bool
    o_bias: bool
    tie_word_embeddings: bool
    context_tokens: int
    eos_token_ids: tuple[int, ...]


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer; q/k/v and gate/up are fused so each is one matmul."""

    input_norm: torch.Tensor        # [hidden]
    qkv: torch.Tensor               # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None   # [(heads + 2 * kv_heads) * head_dim]
    o: torch.Tensor                 # [hidden, heads * head_dim]
    o_bias: torch.Tensor | None     # [hidden]
    post_norm: torch.Tensor         # [hidden]
    gate_up: torch.Tensor           # [2 * intermediate, hidden]
    down: torch.Tensor              # [hidden, intermediate]


@dataclass(slots=True)
class CheckpointWeights:
    config: ModelConfig
    embed: torch.Tensor             # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor              # [hidden]
    lm_head: torch.Tensor           # [vocab, hidden]; the embedding itself when tied
    inv_freq: torch.Tensor          # [head_dim // 2] float32, rope scaling applied


def model_config(checkpoint: Path) -> ModelConfig:
    config = read_checkpoint_config(checkpoint)
    config_path = checkpoint / "config.json"
    hidden, num_heads = config["hidden_size"], config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    head_dim = config.get("head_dim") or hidden // num_heads
    if num_heads % num_kv_heads:
        raise FamilyError(f"{config_path}: field 'num_key_value_heads' = {num_kv_heads} does not divide "
                          f"num_attention_heads = {num_heads}")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise FamilyError(f"{config_path}: field 'hidden_act' = {act!r} is not supported (only 'silu')")
    if config.get("use_sliding_window"):
        raise FamilyError(f"{config_path}: field 'use_sliding_window' = true is not supported")
    if config.get("mlp_bias"):
        raise FamilyError(f"{config_path}: field 'mlp_bias' = true is not supported")
    rope_theta, rope_scaling = _rope_settings(config, config_path)
    eos = config.get("eos_token_id")
    qwen2 = config["_arch"] == "qwen2"
    return ModelConfig(
        arch=config["_arch"], num_layers=config["num_hidden_layers"], hidden_size=hidden,
        intermediate_size=config["intermediate_size"], num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, vocab_size=config["vocab_size"], rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta, rope_scaling=rope_scaling,
        qkv_bias=qwen2 or bool(config.get("attention_bias")), o_bias=not qwen2 and bool(config.get("attention_bias")),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        context_tokens=int(config.get("max_position_embeddings", 2048)),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ()),
    )


def _rope_settings(config: dict, config_path: Path) -> tuple[float, dict | None]:
    """transformers 4.x writes rope_theta + rope_scaling; 5.x writes rope_parameters (theta inside)."""
    field_name = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    params = dict(config.get(field_name) or {})
    rope_theta = float(params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in _ROPE_TYPES:
        raise FamilyError(f"{config_path}: field '{field_name}' rope_type = {rope_type!r} is not supported "
                          f"(supported: {', '.join(_ROPE_TYPES)})")
    if rope_type == "default":
        return rope_theta, None
    needed = ("factor",) if rope_type == "linear" else (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    for key in needed:
        if not isinstance(params.get(key), (int, float)):
            raise FamilyError(f"{config_path}: field '{field_name}.{key}' must be a number for rope_type {rope_type!r}")
    return rope_theta, {"rope_type": rope_type, **{k: float(params[k]) for k in needed}}


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32), with llama3 / linear scaling as transformers computes them."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.float()
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return (inv_freq / factor).float()
    old_context = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, smoothed, scaled).float()


def _weight_files(checkpoint: Path) -> tuple[dict[str, Path], Path]:
    """(tensor name -> file, the file that lists them): from model.safetensors.index.json or model.safetensors."""
    index_path = checkpoint / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text()).get("weight_map")
        except json.JSONDecodeError as exc:
            raise FamilyError(f"{index_path}: not valid JSON: {exc}") from exc
        if not isinstance(weight_map, dict):
            raise FamilyError(f"{index_path}: field 'weight_map' must be an object")
        files = {name: checkpoint / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise FamilyError(f"{index_path}: shard {shard} is missing")
        return files, index_path
    single = checkpoint / "model.safetensors"
    if not single.is_file():
        raise FamilyError(f"{single}: missing (no model.safetensors nor model.safetensors.index.json)")
    try:
        with safe_open(str(single), framework="pt") as handle:
            return {name: single for name in handle.keys()}, single
    except Exception as exc:  # safetensors raises several types for a corrupt header
        raise FamilyError(f"{single}: cannot read weights: {exc}") from exc


class _TensorReader:
    """Reads named tensors with a shape check, keeping each safetensors file open once."""

    def __init__(self, checkpoint: Path, dtype: torch.dtype, device: str | torch.device) -> None:
        self.files, self.source = _weight_files(checkpoint)
        self.dtype, self.device = dtype, device
        self.handles: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.files:
            raise FamilyError(f"{self.source}: tensor '{name}' is missing")
        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = safe_open(str(file), framework="pt")
        try:
            tensor = self.handles[file].get_tensor(name)
        except Exception as exc:
            raise FamilyError(f"{file}: cannot read tensor '{name}': {exc}") from exc
        if tuple(tensor.shape) != shape:
            raise FamilyError(f"{file}: tensor '{name}' has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor.to(device=self.device, dtype=self.dtype)


class _RandomTensorReader:
    """A checkpoint declared `mfs_random_weights` (family.py): each tensor drawn from (seed, name) on the device,
    so the same name and shape give the same values in every member (a nested random family shares its lower
    layers, as its lineages say). Norm weights are ones and biases zeros, as a fresh model's are."""

    def __init__(self, checkpoint: Path, spec: dict, config: dict, dtype: torch.dtype,
                 device: str | torch.device) -> None:
        self.source = checkpoint / "config.json"
        self.seed, self.std = spec["seed"], float(spec["std"])
        self.shapes = llama_tensor_shapes(config)
        self.dtype, self.device = dtype, torch.device(device)

    def has(self, name: str) -> bool:
        return name in self.shapes

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if self.shapes.get(name) != shape:
            raise FamilyError(f"{self.source}: tensor '{name}' has shape {self.shapes.get(name)}, expected {shape}")
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        seed = int.from_bytes(hashlib.blake2b(f"{self.seed}|{name}".encode(), digest_size=8).digest(), "little")
        generator = torch.Generator(device=self.device).manual_seed(seed & (2**63 - 1))
        drawn = torch.randn(shape, generator=generator, device=self.device, dtype=torch.float32)
        return drawn.mul_(self.std).to(self.dtype)


def load_checkpoint(checkpoint: str | Path, dtype: str = "float32", device: str | torch.device = "cpu",
                    reuse_layers: dict[int, LayerWeights] | None = None) -> CheckpointWeights:
    """Loads every tensor onto `device` in `dtype`.

    reuse_layers: layer index -> already loaded weights known to be identical (same lineage); those
    layers are not read again and the tensors are shared.
    """
    checkpoint = Path(checkpoint)
    if dtype not in TORCH_DTYPES:
        raise FamilyError(f"dtype {dtype!r} is not supported (supported: {', '.join(TORCH_DTYPES)})")
    config = model_config(checkpoint)
    raw = read_checkpoint_config(checkpoint)
    spec = random_weights(checkpoint, raw)
    reader = (_TensorReader(checkpoint, TORCH_DTYPES[dtype], device) if spec is None
              else _RandomTensorReader(checkpoint, spec, raw, TORCH_DTYPES[dtype], device))
    hidden, vocab = config.hidden_size, config.vocab_size
    embed = reader.get("model.embed_tokens.weight", (vocab, hidden))
    reuse_layers = reuse_layers or {}
    layers = [reuse_layers.get(l) or _load_layer(reader, config, l) for l in range(config.num_layers)]
    norm = reader.get("model.norm.weight", (hidden,))
    lm_head = embed if config.tie_word_embeddings or not reader.has("lm_head.weight") else \
        reader.get("lm_head.weight", (vocab, hidden))
    return CheckpointWeights(config=config, embed=embed, layers=layers, norm=norm, lm_head=lm_head,
                             inv_freq=rope_inv_freq(config).to(device))


def _load_layer(reader: _TensorReader, config: ModelConfig, layer: int) -> LayerWeights:
    p = f"model.layers.{layer}."
    hidden, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_heads * d, config.num_kv_heads * d
    qkv = torch.cat([reader.get(p + "self_attn.q_proj.weight", (q_out, hidden)),
                     reader.get(p + "self_attn.k_proj.weight", (kv_out, hidden)),
                     reader.get(p + "self_attn.v_proj.weight", (kv_out, hidden))])
    qkv_bias = None
    if config.qkv_bias:
        qkv_bias = torch.cat([reader.get(p + "self_attn.q_proj.bias", (q_out,)),
                              reader.get(p + "self_attn.k_proj.bias", (kv_out,)),
                              reader.get(p + "self_attn.v_proj.bias", (kv_out,))])
    return LayerWeights(
        input_norm=reader.get(p + "input_layernorm.weight", (hidden,)),
        qkv=qkv, qkv_bias=qkv_bias,
        o=reader.get(p + "self_attn.o_proj.weight", (hidden, q_out)),
        o_bias=reader.get(p + "self_attn.o_proj.bias", (hidden,)) if config.o_bias else None,
        post_norm=reader.get(p + "post_attention_layernorm.weight", (hidden,)),
        gate_up=torch.cat([reader.get(p + "mlp.gate_proj.weight", (inter, hidden)),
                           reader.get(p + "mlp.up_proj.weight", (inter, hidden))]),
        down=reader.get(p + "mlp.down_proj.weight", (hidden, inter)),
    )
