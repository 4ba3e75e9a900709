"""Trains the shipped tiny NESTED family: one Llama network whose lower layers are the smaller members.

One run trains all members: an early-exit loss at each member's depth goes through the shared
final norm and (tied) LM head, LayerSkip style. Deterministic for a seed. Writes, per member, a
standalone Hugging Face checkpoint (config.json + model.safetensors, fp16) plus the tokenizer and a
family.yaml, under --out (default engines/families/tiny).

    python -m build_scripts.train_tiny_family --steps 1200 --out engines/families/tiny
"""
from __future__ import annotations

import argparse
import json
import sys
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from orchestrator.sharegpt import iter_conversations

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eot|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|eot|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class TinyShape:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 640
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    context_tokens: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


MEMBER_DEPTHS = {"tiny-s": 2, "tiny-m": 4, "tiny-l": 8}  # small to large; nested: each is the next one's lower layers
EXIT_LOSS_WEIGHTS = {2: 1.0, 4: 1.0, 8: 1.0}


# ----------------------------------------------------------------------------- text and tokenizer
def render_chat(messages) -> str:
    """Same text the chat template renders (kept in sync by a test)."""
    body = "".join(f"<|{m['role']}|>\n{m['content']}<|eot|>\n" for m in messages)
    return "<|bos|>" + body


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def save_tokenizer(tokenizer, out_dir: Path, context_tokens: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>", "eos_token": "<|eot|>", "pad_token": "<|pad|>",
        "add_bos_token": False, "add_eos_token": False,
        "model_max_length": context_tokens, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": "<|bos|>", "eos_token": "<|eot|>", "pad_token": "<|pad|>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


# ----------------------------------------------------------------------------- model (HF Llama names)
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, s: TinyShape):
        super().__init__()
        self.s = s
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x, cos, sin):  # x: [batch, seq, hidden]
        s, a = self.s, self.self_attn
        b, t, _ = x.shape
        h = self.input_layernorm(x)
        q = a.q_proj(h).view(b, t, s.num_heads, s.head_dim).transpose(1, 2)
        k = a.k_proj(h).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = a.v_proj(h).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + a.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


def rope_tables(s: TinyShape, seq_len: int):
    inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


class EarlyExitLlama(nn.Module):
    def __init__(self, s: TinyShape):
        super().__init__()
        self.s = s
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.model.layers = nn.ModuleList(Block(s) for _ in range(s.num_layers))
        self.model.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        for layer in self.model.layers:  # scaled residual init keeps deep exits stable
            nn.init.normal_(layer.self_attn.o_proj.weight, std=0.02 / math.sqrt(2 * s.num_layers))
            nn.init.normal_(layer.mlp.down_proj.weight, std=0.02 / math.sqrt(2 * s.num_layers))

    def exit_logits(self, ids, depths):  # -> {depth: [batch, seq, vocab]}
        cos, sin = rope_tables(self.s, ids.shape[1])
        x = self.model.embed_tokens(ids)
        out = {}
        for i, layer in enumerate(self.model.layers, start=1):
            x = layer(x, cos, sin)
            if i in depths:
                out[i] = F.linear(self.model.norm(x), self.model.embed_tokens.weight)  # tied head
        return out


# ----------------------------------------------------------------------------- data
def load_token_windows(tokenizer, num_conversations: int, window: int, seed: int):
    conversations = list(iter_conversations(limit=num_conversations))
    random.Random(seed).shuffle(conversations)
    num_val = max(50, len(conversations) // 50)
    splits = {"val": conversations[:num_val], "train": conversations[num_val:]}
    windows = {}
    for name, convs in splits.items():
        encodings = tokenizer.encode_batch([render_chat(c.messages) for c in convs])
        stream: list[int] = []
        for enc in encodings:
            stream.extend(enc.ids)
        usable = (len(stream) // window) * window
        windows[name] = torch.tensor(stream[:usable], dtype=torch.long).view(-1, window)
    return windows


def evaluate(model, windows, batch_size: int) -> dict[int, float]:
    model.eval()
    totals = {d: 0.0 for d in EXIT_LOSS_WEIGHTS}
    num_batches = 0
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            batch = windows[start:start + batch_size]
            logits = model.exit_logits(batch[:, :-1], set(EXIT_LOSS_WEIGHTS))
            for depth, lg in logits.items():
                totals[depth] += F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), batch[:, 1:].reshape(-1)).item()
            num_batches += 1
    model.train()
    return {d: totals[d] / num_batches for d in totals}


# ----------------------------------------------------------------------------- saving
def member_state_dict(model: EarlyExitLlama, depth: int) -> dict[str, torch.Tensor]:
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= depth:
                continue
        state[name] = tensor.detach().to(torch.float16).contiguous()
    return state


def member_config(s: TinyShape, depth: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": s.vocab_size, "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
        "num_hidden_layers": depth, "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim, "hidden_act": "silu", "max_position_embeddings": s.context_tokens,
        "rms_norm_eps": s.rms_norm_eps, "rope_theta": s.rope_theta, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": True, "torch_dtype": "float16",
        "bos_token_id": SPECIAL_TOKENS.index("<|bos|>"), "eos_token_id": SPECIAL_TOKENS.index("<|eot|>"),
        "pad_token_id": SPECIAL_TOKENS.index("<|pad|>"), "initializer_range": 0.02, "use_cache": True,
    }


def save_family(model, tokenizer, s: TinyShape, out: Path, losses: dict[int, float], recipe: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    members_yaml = []
    for name, depth in MEMBER_DEPTHS.items():
        member_dir = out / name
        member_dir.mkdir(parents=True, exist_ok=True)
        save_file(member_state_dict(model, depth), str(member_dir / "model.safetensors"), metadata={"format": "pt"})
        (member_dir / "config.json").write_text(json.dumps(member_config(s, depth), indent=2) + "\n")
        generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}
        (member_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        save_tokenizer(tokenizer, member_dir, s.context_tokens)
        members_yaml.append(f"  - name: {name}\n    checkpoint: {name}\n    held_out_loss: {losses[depth]:.4f}\n")
    (out / "family.yaml").write_text(
        "# The shipped tiny family: nested (each member is the next one's lower layers).\n"
        "# Written by build_scripts/train_tiny_family.py; members ordered small to large.\n"
        "name: tiny\nkind: nested\nmembers:\n" + "".join(members_yaml)
    )
    (out / "training.json").write_text(json.dumps({"held_out_loss": {n: losses[d] for n, d in MEMBER_DEPTHS.items()},
                                                   **recipe}, indent=2) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="engines/families/tiny")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--window", type=int, default=1024, help="training sequence length (tokens)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=12000)
    parser.add_argument("--tokenizer-conversations", type=int, default=4000)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast (CPU AMX)")
    parser.add_argument("--init-from", default=None,
                        help="continue from a family this script wrote (its tokenizer and largest member's weights)")
    parser.add_argument("--skip-windows", type=int, default=0,
                        help="training windows already consumed by the run being continued (fresh data only)")
    return parser.parse_args(argv)


def family_tokenizer(args: argparse.Namespace, shape: TinyShape):
    """A fresh BPE over ShareGPT text, or the continued family's own (same ids: the family stays compatible)."""
    if args.init_from:
        from tokenizers import Tokenizer

        largest = Path(args.init_from) / list(MEMBER_DEPTHS)[-1]
        return Tokenizer.from_file(str(largest / "tokenizer.json"))
    texts = [render_chat(c.messages) for c in iter_conversations(limit=args.tokenizer_conversations)]
    return train_tokenizer(texts, shape.vocab_size)


def initial_model(args: argparse.Namespace, shape: TinyShape) -> EarlyExitLlama:
    model = EarlyExitLlama(shape)
    if args.init_from:
        from safetensors.torch import load_file

        state = load_file(str(Path(args.init_from) / list(MEMBER_DEPTHS)[-1] / "model.safetensors"))
        model.load_state_dict({k: v.float() for k, v in state.items()})
    return model


def train(model: EarlyExitLlama, train_windows: torch.Tensor, args: argparse.Namespace) -> None:
    """AdamW with linear warm-up then cosine decay; every exit depth's loss, weighted (EXIT_LOSS_WEIGHTS)."""
    from tqdm import tqdm

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    order = torch.randperm(len(train_windows), generator=torch.Generator().manual_seed(args.seed))
    bar = tqdm(range(args.steps), desc="train tiny family", mininterval=10)
    for step in bar:
        lr = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        # --skip-windows: a continued run starts where the previous one stopped in the same shuffled order.
        idx = order[(torch.arange(args.batch_size) + step * args.batch_size + args.skip_windows) % len(order)]
        batch = train_windows[idx]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model.exit_logits(batch[:, :-1], set(EXIT_LOSS_WEIGHTS))
            losses = {d: F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), batch[:, 1:].reshape(-1))
                      for d, lg in logits.items()}
            loss = sum(EXIT_LOSS_WEIGHTS[d] * l for d, l in losses.items())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        bar.set_postfix({f"L{d}": f"{l.item():.2f}" for d, l in losses.items()})


def training_recipe(args: argparse.Namespace, argv: list[str] | None, wall_s: float) -> dict:
    """What training.json records: the command, the run it continues, the knobs and the tokens seen."""
    previous = {}
    if args.init_from and (Path(args.init_from) / "training.json").is_file():
        previous = json.loads((Path(args.init_from) / "training.json").read_text())
    return {"command": "python -m build_scripts.train_tiny_family " + " ".join(argv or sys.argv[1:]),
            "continues": previous or None,
            "steps": args.steps, "batch_size": args.batch_size, "window": args.window, "lr": args.lr,
            "seed": args.seed, "train_tokens": args.steps * args.batch_size * args.window,
            "wall_s": round(wall_s, 1), "bf16_autocast": args.bf16}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    shape = TinyShape(context_tokens=args.window)
    started = time.time()

    tokenizer = family_tokenizer(args, shape)
    windows = load_token_windows(tokenizer, args.conversations, args.window + 1, args.seed)
    print(f"tokenizer ready ({tokenizer.get_vocab_size()} tokens); train windows {len(windows['train'])}, "
          f"val windows {len(windows['val'])}; {time.time() - started:.0f}s", flush=True)
    model = initial_model(args, shape)
    train(model, windows["train"], args)
    held_out = evaluate(model, windows["val"][:64], args.batch_size)
    save_family(model, tokenizer, shape, Path(args.out), held_out, training_recipe(args, argv, time.time() - started))
    for name, depth in MEMBER_DEPTHS.items():
        print(f"{name}: {depth} layers, held-out loss {held_out[depth]:.4f}")
    print(f"wrote {args.out} in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
