"""Writes a family of real layer shapes with random weights: timing runs (the simulator's validation on a GPU)
need the shapes of a real family, not its weights, and nothing may be downloaded.

Each member is a Hugging Face checkpoint folder holding config.json (the shapes, plus `mfs_random_weights`:
seed and spread) and the shipped tokenizer's files; no weight file. The local engine draws every tensor from
(seed, tensor name) when it loads (engines/local/checkpoint.py), on its own device, so a 1B-8B family costs
no disk and loads in seconds. In a nested preset the members share one seed and one width, so the smaller
ones are the larger one's lower layers (same lineages: cross-member KV sharing and merged forwards apply).

What differs from the real models, on purpose:
- the vocabulary is the shipped tokenizer's (4,096 ids, the only tokenizer on disk), not the real one (128,256
  for Llama 3): the embedding and head are smaller, which matters most for the smallest member's step;
- the replies are noise: with near-uniform next-token distributions every request would escalate, so timing
  runs turn escalation off (`--set escalation.enabled=false`);
- Llama architecture only (no Qwen3 q/k norms in the local engine).

    python -m build_scripts.random_family --preset llama3.2-1b-nested --out /tmp/randfam
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from eval.weights import weight_bytes
from orchestrator.core.family import RANDOM_WEIGHTS_KEY, SHIPPED_FAMILIES_DIR

TOKENIZER_SOURCE = SHIPPED_FAMILIES_DIR / "tiny" / "tiny-l"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float = 500000.0


# Llama 3.2 1B / 3B and Llama 3.1 8B layer shapes (their published config.json files).
LLAMA32_1B = Shape(16, 2048, 8192, 32, 8, 64)
LLAMA32_3B = Shape(28, 3072, 8192, 24, 8, 128)
LLAMA31_8B = Shape(32, 4096, 14336, 32, 8, 128)

PRESETS: dict[str, tuple[str, list[tuple[str, Shape]]]] = {
    # Llama-3.2-1B's widths; members 8 / 12 / 16 layers deep, nested like the shipped tiny family
    "llama3.2-1b-nested": ("nested", [("rand-s", Shape(8, 2048, 8192, 32, 8, 64)),
                                      ("rand-m", Shape(12, 2048, 8192, 32, 8, 64)), ("rand-l", LLAMA32_1B)]),
    # three separately trained sizes: each member its own seed, nothing shared
    "llama3-1b-3b-8b": ("independent", [("rand-1b", LLAMA32_1B), ("rand-3b", LLAMA32_3B), ("rand-8b", LLAMA31_8B)]),
    # small enough for the test suite on a CPU
    "tiny": ("nested", [("rand-s", Shape(2, 64, 128, 4, 2, 16, 10000.0)),
                               ("rand-m", Shape(3, 64, 128, 4, 2, 16, 10000.0)),
                               ("rand-l", Shape(4, 64, 128, 4, 2, 16, 10000.0))]),
}


def member_config(shape: Shape, seed: int, std: float, base: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": base["vocab_size"],
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": shape.rope_theta,
        "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "bos_token_id": base.get("bos_token_id"), "eos_token_id": base.get("eos_token_id"),
        "pad_token_id": base.get("pad_token_id"), RANDOM_WEIGHTS_KEY: {"seed": seed, "std": std},
    }


def write_family(preset: str, out: Path, seed: int = 0, std: float = 0.02, force: bool = False) -> Path:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} is not empty (pass --force to replace it)")
        shutil.rmtree(out)
    kind, members = PRESETS[preset]
    base = json.loads((TOKENIZER_SOURCE / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for index, (name, shape) in enumerate(members):
        member_seed = seed if kind == "nested" else seed + index     # nested: one draw, shared lower layers
        config = member_config(shape, member_seed, std, base)
        folder = out / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for file in TOKENIZER_FILES:
            if (TOKENIZER_SOURCE / file).is_file():
                shutil.copy2(TOKENIZER_SOURCE / file, folder / file)
        # bf16 bytes, what a GPU serves: the baseline's operator split reads family.yaml's weight_bytes
        entries.append({"name": name, "checkpoint": name, "weight_bytes": weight_bytes(config)})
    manifest = {"name": f"random-{preset}", "kind": kind, "members": entries}
    header = (f"# Random weights of real shapes (build_scripts/random_family.py --preset {preset} --seed {seed} "
              f"--std {std}): for timing runs only; the replies are noise.\n")
    (out / "family.yaml").write_text(header + yaml.safe_dump(manifest, sort_keys=False))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m build_scripts.random_family", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3.2-1b-nested", choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, help="the family directory to write (family.yaml + member folders)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=0.02, help="spread of the drawn weights (a fresh model's)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)
    if args.std <= 0:
        parser.error("--std must be positive")
    try:
        out = write_family(args.preset, Path(args.out), args.seed, args.std, args.force)
    except (ValueError, FileExistsError) as exc:
        print(f"random_family: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}/family.yaml ({args.preset}: random weights, drawn by the engine at load)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
