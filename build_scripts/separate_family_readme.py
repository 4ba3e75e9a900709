"""README.md text for the separate-weight tiny family, filled from the run's results (train_separate_family.py)."""
from __future__ import annotations


def _row(name: str, r: dict) -> str:
    ended = r.get("replies_ending_within_128")
    ended_text = "not measured" if ended is None else f"{100 * ended:.0f}% of {r['eos_prompts']}"
    if r.get("median_ended_reply_tokens"):  # an empty reply also "ends": the median shows they are not
        ended_text += f" (median {r['median_ended_reply_tokens']} tokens)"
    return (f"| {name} | {r['layers']} | {r['hidden_size']} | {r['intermediate_size']} | {r['heads']} / {r['kv_heads']} "
            f"| {r['parameters'] / 1e6:.2f} M | {r['train_tokens'] / 1e6:.1f} M | {r['held_out_loss']:.3f} "
            f"| {r['held_out_eot_loss']:.3f} | {ended_text} |")


def readme_text(results: dict[str, dict], recipe: dict) -> str:
    smallest = min(r["parameters"] for r in results.values())
    ratio = " : ".join(f"{r['parameters'] / smallest:.1f}" for r in results.values())
    rows = "\n".join(_row(n, r) for n, r in results.items())
    minutes = recipe["train_wall_s_all_runs"] / 60
    return f"""# The tiny-sep family (shipped)

A SEPARATE-WEIGHT Llama family beside the nested `tiny` family: three independent networks trained from
scratch (RMSNorm, RoPE, head_dim 64, 2 KV heads in every member so all get the same tokens per KV page,
SwiGLU, tied embeddings, vocabulary 4096, context {recipe['window']}). No layer is shared, so MFS detects
separate lineages from the weights (`kind: separate` in `family.yaml` is documentation only). Every member
uses the nested family's tokenizer files byte for byte (same ids, same tokenizer hash, same chat template).
Parameters are about {ratio} (the 4,096 x width embedding dominates the small members).

| member | layers | width | MLP | heads / KV heads | parameters | train tokens | held-out loss | loss at reply-closing EOS | greedy replies ending within 128 tokens |
|---|---|---|---|---|---|---|---|---|---|
{rows}

Losses are nats/token over {recipe['val_windows']} held-out windows of {recipe['window']} tokens (2% of the
conversations, cut by the rule below, so not comparable with the nested family's losses on whole replies).
The last column: each member, loaded with `transformers.LlamaForCausalLM`, answers held-out first user turns
greedily with a 128-token cap.

## How replies were taught to end

The nested family trained on whole ShareGPT replies (often far longer than 128 tokens) and almost never
emits `<|eot|>`. Here the training text is the same ShareGPT chats rendered with the chat template, with
every assistant reply cut short (`build_scripts/short_replies.py`):

{recipe['reply_rule']}

So about 96% of training replies are under 100 tokens (median about 36), and every one is closed by
`<|eot|>`, which the loss weights 5x.

## How it was made

{recipe['threads']} CPU threads, bf16 autocast, deterministic for seed {recipe['seed']}; members train one
after another (smallest first), batch {recipe['batch_size']} x {recipe['window']} tokens, AdamW at lr
{recipe['lr']} with warm-up and cosine decay, then (members whose steps above exceed the first cycle's
{recipe.get('first_cycle_steps', 700)}) a second cosine cycle restarted at lr {recipe.get('second_cycle_lr', recipe['lr'])}
(`--extra-steps`, `--extra-lr`); {minutes:.0f} min of training wall time in all:

```bash
{recipe['command']}
```

The script checkpoints model, optimizer, step and RNG state every `--save-every` steps under
`--checkpoint-dir` (default `~/.cache/mfs/train-tiny-sep`); rerunning the same command resumes there.
`training.json` records the same numbers. These are toy models: their text is barely coherent, which is
fine for what they are for (exercising a separate-weight family end to end on a CPU).
"""
