"""Trains the shipped tiny SEPARATE-WEIGHT family: three independent Llamas sharing the nested family's tokenizer."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from build_scripts import short_replies
from build_scripts.train_tiny_family import (
    EarlyExitLlama,
    TinyShape,
    member_config,
    member_state_dict,
)
from orchestrator.sharegpt import iter_conversations

FAMILY_NAME = "tiny-sep"
# small to large, about 1 : 4 : 16 in parameters (the 4096-token embedding dominates the small ones); every
# member keeps 2 KV heads x head_dim 64, so all get the same tokens per KV page; sep-l is tiny-l's shape.
MEMBERS = {
    "sep-s": TinyShape(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=2),
    "sep-m": TinyShape(hidden_size=160, intermediate_size=448, num_layers=3, num_heads=4),
    "sep-l": TinyShape(hidden_size=256, intermediate_size=640, num_layers=8, num_heads=4),
}
USAGE = """\
Each member is its own network trained from scratch (no shared layers, so MFS sees separate lineages) on
ShareGPT chats whose assistant replies are cut short and closed by <|eot|> (build_scripts/short_replies.py),
so the models learn to end replies. Members train one after another, smallest first; each saves model,
optimizer, step and RNG state to --checkpoint-dir every --save-every steps, and rerunning the same command
resumes there. Deterministic for a seed. Writes one standalone Hugging Face checkpoint per member (fp16),
family.yaml, training.json and README.md under --out.

    python -m build_scripts.train_separate_family --out engines/families/tiny-sep

On a CPU shared with other work, run it niced with OMP_WAIT_POLICY=PASSIVE: busy-waiting OpenMP threads
otherwise burn the little CPU a niced job gets (measured: half the CPU per step, 2-3x the wall time).
"""
DEFAULT_STEPS = {"sep-s": 700, "sep-m": 700, "sep-l": 700}
# a second cosine cycle from the first one's last checkpoint (a warm restart at a lower peak): the deeper and the
# smallest members are furthest from done after one cycle (sep-l's held-out loss was above sep-m's, sep-s rarely
# ended a greedy reply)
DEFAULT_EXTRA_STEPS = {"sep-s": 700, "sep-m": 0, "sep-l": 500}
DEFAULT_EXTRA_LR = 1e-3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DEFAULT_CHECKPOINT_DIR = Path.home() / ".cache" / "mfs" / "train-tiny-sep"


def parameter_count(shape: TinyShape) -> int:
    return sum(p.numel() for p in EarlyExitLlama(shape).parameters())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"engines/families/{FAMILY_NAME}")
    parser.add_argument("--steps", default=",".join(str(DEFAULT_STEPS[m]) for m in MEMBERS),
                        help="optimizer steps, one number for every member or one per member small to large")
    parser.add_argument("--extra-steps", default=",".join(str(DEFAULT_EXTRA_STEPS[m]) for m in MEMBERS),
                        help="steps of a second cosine cycle after the first, one number or one per member")
    parser.add_argument("--extra-lr", type=float, default=DEFAULT_EXTRA_LR, help="peak learning rate of that cycle")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--window", type=int, default=1024, help="training sequence length (tokens)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=None, help="ShareGPT conversations read (default all)")
    parser.add_argument("--tokenizer-from", default="engines/families/tiny/tiny-l",
                        help="checkpoint folder whose tokenizer files are copied byte for byte (same ids, same hash)")
    parser.add_argument("--checkpoint-dir", default=str(DEFAULT_CHECKPOINT_DIR))
    parser.add_argument("--save-every", type=int, default=25, help="steps between resumable checkpoints")
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--eos-prompts", type=int, default=48,
                        help="held-out first turns generated greedily (128-token cap) to count replies that end")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast")
    args = parser.parse_args(argv)
    steps = [int(s) for s in str(args.steps).split(",")]
    if len(steps) not in (1, len(MEMBERS)):
        parser.error(f"--steps: give 1 or {len(MEMBERS)} numbers")
    args.member_steps = dict(zip(MEMBERS, steps * len(MEMBERS) if len(steps) == 1 else steps))
    extra = [int(s) for s in str(args.extra_steps).split(",")]
    if len(extra) not in (1, len(MEMBERS)):
        parser.error(f"--extra-steps: give 1 or {len(MEMBERS)} numbers")
    args.member_extra_steps = dict(zip(MEMBERS, extra * len(MEMBERS) if len(extra) == 1 else extra))
    return args


# ----------------------------------------------------------------------------- data
def load_data(tokenizer, args: argparse.Namespace):
    """Shuffled (seeded) conversations, 2% held out; train/val windows of window+1 tokens with loss weights."""
    conversations = list(iter_conversations(limit=args.conversations))
    random.Random(args.seed).shuffle(conversations)
    num_val = max(min(50, len(conversations) // 2), len(conversations) // 50)
    val, train = conversations[:num_val], conversations[num_val:]
    data = {"train": short_replies.weighted_windows(tokenizer, train, args.window + 1, args.seed),
            "val": short_replies.weighted_windows(tokenizer, val, args.window + 1, args.seed)}
    return data, val


def batch_indices(step: int, batch_size: int, num_windows: int, seed: int, member_index: int) -> torch.Tensor:
    """Windows for one step: a fresh seeded permutation per epoch, so a resumed run needs only the step."""
    first = step * batch_size
    out = []
    for i in range(first, first + batch_size):
        epoch = i // num_windows
        generator = torch.Generator().manual_seed(seed * 1000 + member_index * 100 + epoch)
        perm = torch.randperm(num_windows, generator=generator)
        out.append(perm[i % num_windows])
    return torch.stack(out)


def token_losses(model: EarlyExitLlama, ids: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [batch, seq-1] of predicting ids[:, 1:]."""
    depth = model.s.num_layers
    logits = model.exit_logits(ids[:, :-1], {depth})[depth]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                           reduction="none").view(ids.shape[0], -1)


# ----------------------------------------------------------------------------- resumable training
def _atomic_save(state: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a kill mid-write leaves the previous checkpoint intact


def run_identity(name: str, args: argparse.Namespace) -> dict:
    """What a checkpoint must match to be resumed (changing any of it would change the run)."""
    return {"member": name, "shape": dataclasses.asdict(MEMBERS[name]), "steps": args.member_steps[name],
            "batch_size": args.batch_size, "window": args.window, "lr": args.lr, "seed": args.seed,
            "conversations": args.conversations, "bf16": args.bf16,
            "rule": [short_replies.BUDGET_MEDIAN, short_replies.BUDGET_SIGMA, short_replies.BUDGET_MAX,
                     short_replies.EOT_WEIGHT, short_replies.CONTEXT_WEIGHT]}


def cycle_identity(name: str, args: argparse.Namespace) -> dict:
    """The second cycle's settings: a checkpoint past the first cycle must have been trained with these."""
    return {"extra_steps": args.member_extra_steps[name], "extra_lr": args.extra_lr}


def learning_rate(step: int, steps: int, extra_steps: int, args: argparse.Namespace) -> float:
    """Linear warm-up then cosine decay over the first cycle; the second restarts the cosine at --extra-lr."""
    if step < steps:
        warmup = max(1, steps // 20)
        return args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
    return args.extra_lr * 0.5 * (1 + math.cos(math.pi * (step - steps) / extra_steps))


def train_member(name: str, index: int, windows, args: argparse.Namespace) -> tuple[EarlyExitLlama, dict]:
    """AdamW over one or two cosine cycles, loss weighted per token (short_replies); resumes from its checkpoint."""
    from tqdm import tqdm

    shape = dataclasses.replace(MEMBERS[name], context_tokens=args.window)
    torch.manual_seed(args.seed * 1000 + index)  # each member its own init: separate lineages
    model = EarlyExitLlama(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    steps, identity = args.member_steps[name], run_identity(name, args)
    extra_steps, cycle = args.member_extra_steps[name], cycle_identity(name, args)
    path = Path(args.checkpoint_dir) / f"{name}.pt"
    state = {"step": 0, "train_s": 0.0}
    if path.is_file():
        saved = torch.load(path, weights_only=False)
        if saved["identity"] != identity:
            raise SystemExit(f"{path}: checkpoint of a different run ({saved['identity']} != {identity}); "
                             "delete it or pass another --checkpoint-dir")
        if saved["step"] > steps and saved.get("cycle") != cycle:
            raise SystemExit(f"{path}: checkpoint of a different second cycle ({saved.get('cycle')} != {cycle}); "
                             "delete it or pass another --checkpoint-dir")
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["torch_rng"])
        random.setstate(saved["python_rng"])
        state = {"step": saved["step"], "train_s": saved["train_s"]}
        print(f"{name}: resuming at step {state['step']}/{steps + extra_steps} from {path}", flush=True)

    def save() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_save({"identity": identity, "cycle": cycle, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                      "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), **state}, path)

    ids, weights = windows
    total = steps + extra_steps
    bar = tqdm(range(state["step"], total), desc=f"train {name}", mininterval=10, initial=state["step"], total=total)
    started = time.time() - state["train_s"]
    for step in bar:
        lr = learning_rate(step, steps, extra_steps, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        idx = batch_indices(step, args.batch_size, len(ids), args.seed, index)
        batch, w = ids[idx], weights[idx][:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            per_token = token_losses(model, batch)
        loss = (per_token * w).sum() / w.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        eot = w == short_replies.EOT_WEIGHT
        bar.set_postfix(loss=f"{per_token.mean().item():.3f}",
                        eot=f"{per_token[eot].mean().item():.2f}" if eot.any() else "-", refresh=False)
        state = {"step": step + 1, "train_s": time.time() - started}
        if state["step"] % args.save_every == 0 or state["step"] in (steps, total):
            save()
    bar.close()
    if total == 0 or not path.is_file():
        save()
    return model, state


# ----------------------------------------------------------------------------- evaluation
def evaluate(model: EarlyExitLlama, windows, args: argparse.Namespace) -> dict[str, float]:
    """Plain mean loss over every held-out token, and the loss at the <|eot|> closing each assistant reply."""
    ids, weights = windows[0][:args.eval_windows], windows[1][:args.eval_windows]
    model.eval()
    total = eot_total = 0.0
    count = eot_count = 0
    with torch.no_grad():
        for start in range(0, len(ids), args.batch_size):
            per_token = token_losses(model, ids[start:start + args.batch_size])
            eot = weights[start:start + args.batch_size, 1:] == short_replies.EOT_WEIGHT
            total, count = total + per_token.sum().item(), count + per_token.numel()
            eot_total, eot_count = eot_total + per_token[eot].sum().item(), eot_count + int(eot.sum())
    model.train()
    return {"held_out_loss": total / max(1, count), "held_out_eot_loss": eot_total / max(1, eot_count)}


def replies_that_end(member_dir: Path, val_conversations, args: argparse.Namespace, cap: int = 128) -> dict:
    """Loads the saved member with transformers and greedily answers held-out first user turns (cap tokens)."""
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    if args.eos_prompts <= 0:
        return {}
    tokenizer = Tokenizer.from_file(str(member_dir / "tokenizer.json"))
    model = LlamaForCausalLM.from_pretrained(str(member_dir), dtype=torch.float32).eval()
    lengths = []
    for conversation in val_conversations:
        if len(lengths) == args.eos_prompts:
            break
        first = conversation.messages[0]
        text = f"<|{first['role']}|>\n{first['content']}<|eot|>\n<|assistant|>\n"
        prompt = [short_replies.BOS_ID] + tokenizer.encode(text).ids
        if first["role"] != "user" or len(prompt) > args.window - cap:
            continue
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=cap, do_sample=False,
                                 eos_token_id=short_replies.EOT_ID, pad_token_id=0)
        reply = out[0, len(prompt):].tolist()
        lengths.append(reply.index(short_replies.EOT_ID) + 1 if short_replies.EOT_ID in reply else cap + 1)
    ended = [n for n in lengths if n <= cap]
    return {"eos_prompts": len(lengths), "replies_ending_within_128": len(ended) / max(1, len(lengths)),
            "median_ended_reply_tokens": sorted(ended)[len(ended) // 2] if ended else None}


# ----------------------------------------------------------------------------- saving
def save_member(model: EarlyExitLlama, name: str, out: Path, tokenizer_from: Path) -> Path:
    from safetensors.torch import save_file

    member_dir = out / name
    member_dir.mkdir(parents=True, exist_ok=True)
    shape = model.s
    save_file(member_state_dict(model, shape.num_layers), str(member_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (member_dir / "config.json").write_text(json.dumps(member_config(shape, shape.num_layers), indent=2) + "\n")
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}
    (member_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for file in TOKENIZER_FILES:  # byte for byte: the tokenizer hash MFS compares must match the nested family's
        shutil.copyfile(tokenizer_from / file, member_dir / file)
    return member_dir


def write_family_files(out: Path, results: dict[str, dict], recipe: dict) -> None:
    from build_scripts.separate_family_readme import readme_text

    entries = "".join(f"  - name: {n}\n    checkpoint: {n}\n    held_out_loss: {r['held_out_loss']:.4f}\n"
                      for n, r in results.items())
    (out / "family.yaml").write_text(
        "# The shipped tiny separate-weight family: three independent networks, one tokenizer (the nested\n"
        "# tiny family's). Written by build_scripts/train_separate_family.py; members ordered small to large.\n"
        f"name: {FAMILY_NAME}\nkind: separate\nmembers:\n{entries}")
    (out / "training.json").write_text(json.dumps({"members": results, **recipe}, indent=2) + "\n")
    (out / "README.md").write_text(readme_text(results, recipe))


def main(argv: list[str] | None = None) -> None:
    from tokenizers import Tokenizer

    args = parse_args(argv)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.time()
    tokenizer_from = Path(args.tokenizer_from)
    tokenizer = Tokenizer.from_file(str(tokenizer_from / "tokenizer.json"))
    data, val_conversations = load_data(tokenizer, args)
    print(f"data ready: train windows {len(data['train'][0])}, val windows {len(data['val'][0])}; "
          f"{time.time() - started:.0f}s", flush=True)
    out, results = Path(args.out), {}
    for index, name in enumerate(MEMBERS):
        model, state = train_member(name, index, data["train"], args)
        losses = evaluate(model, data["val"], args)
        member_dir = save_member(model, name, out, tokenizer_from)
        shape = model.s
        results[name] = {"layers": shape.num_layers, "hidden_size": shape.hidden_size,
                         "intermediate_size": shape.intermediate_size, "heads": shape.num_heads,
                         "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
                         "parameters": parameter_count(shape), "steps": state["step"],
                         "train_tokens": state["step"] * args.batch_size * args.window,
                         "train_wall_s": round(state["train_s"], 1), **losses,
                         **replies_that_end(member_dir, val_conversations, args)}
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    recipe = {"command": "python -m build_scripts.train_separate_family " + " ".join(argv or sys.argv[1:]),
              "first_cycle_lr": args.lr, "second_cycle_lr": args.extra_lr,
              "first_cycle_steps": max(args.member_steps.values()), "batch_size": args.batch_size,
              "window": args.window, "lr": args.lr, "seed": args.seed,
              "bf16_autocast": args.bf16, "threads": args.threads,
              "train_windows": len(data["train"][0]), "val_windows": min(args.eval_windows, len(data["val"][0])),
              "reply_rule": short_replies.REPLY_RULE,
              "wall_s": round(time.time() - started, 1),
              "train_wall_s_all_runs": round(sum(r["train_wall_s"] for r in results.values()), 1)}
    write_family_files(out, results, recipe)
    print(f"wrote {out} in {time.time() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
